"""Builds the embedded demo pair under models/: corpus, tokenizer, target pretraining, target-generated data,
drafter training. `python -m demo_build --help`; every stage resumes from its checkpoints."""
