"""Grammar-constrained decoding with llguidance (docs/decisions/0027): the grammar vocabulary built from a
tokenizer.json and grammars checked under fixed limits; torch-free, for the gateway too (a request's matcher is
shared/grammar_matcher.py)."""

from pathlib import Path

import llguidance
from tokenizers import Tokenizer

from shared.config_json import read_config
from shared.end_of_text import end_of_text_ids, tokenizer_settings
from shared.target_facts import TargetFacts

# what one grammar may cost to compile and to step: a grammar past them is refused, in bounded time
GRAMMAR_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                      step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)


def grammar_limits() -> "llguidance.LLParserLimits":
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


def grammar_vocabulary(tokenizer: Tokenizer, vocab_size: int, eos_ids) -> "llguidance.LLTokenizer | None":
    """The tokenizer as grammars see it (special tokens are never text), over at least the model's vocab_size ids
    (the logits' width; a wider tokenizer keeps its own), ended by those of eos_ids the tokenizer has; None where it
    has none of them (a grammar could never end: grammars are then refused). About a second for 150k tokens."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    ends = [t for t in eos_ids if 0 <= t < size]
    if not ends:
        return None
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=max(vocab_size, size), eos_token=ends)


def folder_vocabulary(folder: str | Path, vocab_size: int, config_eos: tuple[int, ...]):
    """A model folder's grammar vocabulary, ended by the gateway's stop tokens (shared.end_of_text); None where
    the folder has no tokenizer.json or the tokenizer has none of them."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    return grammar_vocabulary(tokenizer, vocab_size, end_of_text_ids(tokenizer, tokenizer_settings(folder), config_eos))


def new_matcher(vocabulary, grammar: str) -> "llguidance.LLMatcher":
    """A matcher of the grammar over the vocabulary, compiled within GRAMMAR_LIMITS (ValueError with what is
    wrong where it does not compile)."""
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=grammar_limits())
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


def target_grammar_vocabulary(folder: str, vocab_size: int, log):
    """A target folder's grammar vocabulary (folder_vocabulary, ended by its stop tokens), or None with a log line:
    a target it cannot be built for is served without structured outputs (and a drafter drafts without them)."""
    try:
        vocabulary = folder_vocabulary(folder, vocab_size, TargetFacts.from_config(read_config(folder)).eos_token_ids)
    except Exception as exc:  # noqa: BLE001 - an optional feature: the llguidance or tokenizers error is logged
        log.warning("structured outputs are off: the grammar vocabulary cannot be built (%s)", exc)
        return None
    if vocabulary is None:
        log.info("structured outputs are off: the target has no tokenizer.json or no end-of-text token")
    return vocabulary
