"""Tokenizer, chat template, incremental detokenization and stop strings. Token ids only: no torch here."""

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from shared.byte_tokenizer import byte_symbols
from shared.end_of_text import end_of_text_ids, token_text, tokenizer_settings
from shared.errors import ConfigError

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class TextCodec:
    """The target's tokenizer.json and tokenizer_config.json, as the gateway uses them."""

    tokenizer: Tokenizer | None  # None: token ids only (the target folder has no tokenizer.json)
    chat_template: str
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None

    @classmethod
    def ids_only(cls, config_eos: tuple[int, ...] = ()) -> "TextCodec":
        """No tokenizer: prompts are token ids, outputs are token ids (their text is empty), as vLLM's
        --skip-tokenizer-init serves; a request that needs text (a text prompt, chat, stop strings) gets a 400."""
        return cls(None, FALLBACK_CHAT_TEMPLATE, tuple(dict.fromkeys(config_eos)), None, None)

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    @classmethod
    def from_folder(cls, folder: str | Path, config_eos: tuple[int, ...] = ()) -> "TextCodec":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{str(path)!r} is missing: the gateway needs the target's tokenizer")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
            raise ConfigError(f"cannot read {str(path)!r}: {exc}") from None
        settings = tokenizer_settings(folder)
        eos, bos = token_text(settings.get("eos_token")), token_text(settings.get("bos_token"))
        template = settings.get("chat_template")
        if isinstance(template, list):  # the named-templates form: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, template or FALLBACK_CHAT_TEMPLATE, end_of_text_ids(tokenizer, settings, config_eos),
                   bos, eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict], max_chars: int, tools: list | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        """The conversation (and the tools offered, and the request's template_kwargs: enable_thinking,
        reasoning_effort...) through the chat template;
        RenderedTooLong as soon as the text passes max_chars (a template can expand a small body: it is rendered
        piece by piece and stopped there)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        pieces, chars = [], 0
        variables = {**(template_kwargs or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "tools": tools}
        for piece in env.from_string(self.chat_template).generate(**variables):
            chars += len(piece)
            if chars > max_chars:
                raise RenderedTooLong(max_chars)
            pieces.append(piece)
        return "".join(pieces)

    @cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes of text one token of the vocabulary (added tokens included) stands for: a byte-level
        token's characters are its bytes; any other token's UTF-8 length bounds what it covers (a SentencePiece
        U+2581 counts 3 bytes for one space: a looser bound, never a tighter one)."""
        if self.tokenizer is None:
            return 1
        vocabulary = self.tokenizer.get_vocab(with_added_tokens=True)
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        byte_level = self._byte_alphabet is not None
        return max((len(token) if byte_level and token not in added else len(token.encode("utf-8"))
                    for token in vocabulary), default=1) or 1

    def normalized_chars(self, text: str) -> int:
        """The characters of text after the tokenizer's normalizer (the text's own where it has none)."""
        normalizer = self.tokenizer.normalizer if self.tokenizer is not None else None
        return len(text) if normalizer is None else len(normalizer.normalize_str(text))

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.tokenizer)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (special tokens left out); empty without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    @cached_property
    def _byte_alphabet(self) -> dict[str, int] | None:
        """Byte-level BPE: the stand-in character of each byte -> the byte; None for other tokenizers."""
        if self.tokenizer is None:
            return None
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [])} | {decoder.get("type")}
        return {c: b for b, c in enumerate(byte_symbols())} if "ByteLevel" in kinds else None

    @cached_property
    def _added_tokens(self) -> dict[str, bool]:
        """Added tokens -> whether they are special (the detokenizer leaves those out of the text)."""
        if self.tokenizer is None:
            return {}
        return {t.content: t.special for t in self.tokenizer.get_added_tokens_decoder().values()}

    @property
    def added_token_texts(self) -> frozenset[str]:
        """The texts of the tokenizer's added tokens (special or not)."""
        return frozenset(self._added_tokens)

    def is_special(self, token_id: int) -> bool:
        if self.tokenizer is None:
            return False
        return self._added_tokens.get(self.tokenizer.id_to_token(token_id), False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, for some): byte-level BPE tokens are
        mapped back through their byte alphabet, SentencePiece pieces turn U+2581 into a space and <0xNN> into
        that byte, added tokens give their text; without a tokenizer, "token_id:N" (vLLM's name for it)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}".encode()
        token, alphabet = self.tokenizer.id_to_token(token_id), self._byte_alphabet
        if token is None:
            return b""
        if token in self._added_tokens:
            return token.encode()
        if alphabet is not None and all(c in alphabet for c in token):
            return bytes(alphabet[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("\u2581", " ").encode()


class RenderedTooLong(Exception):
    """The chat template's output passed the number of characters it may have."""

    def __init__(self, max_chars: int):
        super().__init__(f"the chat template's output passes {max_chars} characters")
        self.max_chars = max_chars


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character: text whose
    last character is the replacement character is held back until the following tokens complete it."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are fully emitted and never decoded again
        self.read_offset = 0  # ids before this are reflected in emitted text

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if self.tokenizer is None:  # token ids only: no text
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset: self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is held back, replacement characters included."""
        if self.tokenizer is None:
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset: self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopMatcher:
    """Finds stop strings in streamed text. Text that might be the start of a stop string is held back, so
    no part of a stop string is ever emitted."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        text = self.held + delta
        found = [(text.find(s), s) for s in self.stops if text.find(s) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self.held = ""
            return text[:cut], True
        keep = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    keep = max(keep, length)
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
