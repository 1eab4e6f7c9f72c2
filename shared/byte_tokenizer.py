"""A byte-level tokenizer.json (256 byte tokens plus special tokens) built with the tokenizers library.

Used for the random demo pair and for tests: it needs no training and round-trips any UTF-8 text.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

END_OF_TEXT = "<|endoftext|>"
MASK = "<|mask|>"


def byte_symbols() -> list[str]:
    """The printable stand-in character of each byte value 0..255, as byte-level BPE tokenizers use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            codes[byte] = byte
        else:
            codes[byte] = 256 + extra
            extra += 1
    return [chr(codes[byte]) for byte in range(256)]


def build_byte_tokenizer(special_tokens: tuple[str, ...] = (END_OF_TEXT, MASK)) -> Tokenizer:
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer


def write_byte_tokenizer(folder: str | Path) -> Tokenizer:
    tokenizer = build_byte_tokenizer()
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    return tokenizer
