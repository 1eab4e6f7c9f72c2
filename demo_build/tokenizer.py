"""A byte-level BPE tokenizer trained on the training split, with end-of-text and mask tokens."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from demo_build.corpus import read_text
from shared.byte_tokenizer import END_OF_TEXT, MASK

# tools (hermes-style calls, as Qwen3 writes them) render only where a request offers them
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTo call a function, answer <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n"
    "</tool_call>. The functions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}<tool_call>\n{{ {'name': call.function.name, 'arguments': "
    "call.function.arguments} | tojson }}\n</tool_call>{% endfor %}{% endif %}{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return tokenizer


def write_tokenizer_files(tokenizer: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        # tokenizer.json as it is: a model_type of qwen3 alone makes AutoTokenizer pick Qwen2Tokenizer, whose
        # own pre-tokenizer splits text differently (46 of the 48 benchmark prompts got other ids)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_TEXT, "mask_token": MASK, "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1024,
    }, indent=2) + "\n")
