"""Grammar-constrained decoding with llguidance (docs/decisions/0027): the grammar vocabulary built from a
tokenizer.json and grammars checked under fixed limits; torch-free, for the gateway too (a request's matcher is
shared/grammar_matcher.py)."""

from pathlib import Path

import llguidance

from shared.end_of_text import end_of_text_ids, tokenizer_settings

# what one grammar may cost to compile and to step: a grammar past them is refused, in bounded time
GRAMMAR_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                      step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)


def grammar_limits() -> "llguidance.LLParserLimits":
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


def grammar_vocabulary(tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> "llguidance.LLTokenizer":
    """The tokenizer as grammars see it (special tokens are never text), over at least the model's vocab_size ids
    (the logits' width; a wider tokenizer keeps its own), ended by those of eos_ids the tokenizer has (ValueError
    where it has none of them: a grammar could never end). Built once per model: about a second for 150k tokens."""
    from tokenizers import Tokenizer

    size = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    ends = [t for t in eos_ids if 0 <= t < size]
    if not ends:
        raise ValueError(f"none of the end-of-text ids {list(eos_ids)} is a token of the tokenizer ({size} tokens)")
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=max(vocab_size, size), eos_token=ends)


def folder_vocabulary(folder: str | Path, vocab_size: int, config_eos: tuple[int, ...]):
    """A model folder's grammar vocabulary, ended by the gateway's stop tokens (shared.end_of_text) that the
    tokenizer has; None where the folder has no tokenizer.json or no such end-of-text token: grammars are then
    refused."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    text = path.read_text()
    tokenizer = Tokenizer.from_str(text)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = [t for t in end_of_text_ids(tokenizer, tokenizer_settings(folder), config_eos) if t < size]
    return grammar_vocabulary(text, vocab_size, eos) if eos else None


def compile_error(vocabulary, grammar: str) -> str | None:
    """None where the grammar compiles within GRAMMAR_LIMITS for this vocabulary; else what is wrong."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary,
                                                                               limits=grammar_limits())
    if is_error:
        return messages[0] if messages else "the grammar does not compile"
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=grammar_limits())
    return matcher.get_error() if matcher.is_error() else None
