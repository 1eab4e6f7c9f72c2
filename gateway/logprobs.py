"""OpenAI `logprobs` objects from the verify worker's per-token log-probabilities (pure formatting).

Completions use the legacy form {tokens, token_logprobs, top_logprobs, text_offset}; each top_logprobs entry
holds the k alternatives plus the chosen token, and a token that is only part of a UTF-8 character is named
"bytes:\\xNN...", as OpenAI's API does. Chat uses {content: [{token, logprob, bytes, top_logprobs}]}, where such
a token shows as U+FFFD in `token` and `bytes` has its exact bytes.
"""

import codecs
from dataclasses import dataclass, field

from gateway.tokenization import TextCodec


@dataclass
class TokenLogprobs:
    """Log-probabilities of a run of tokens, as the verify worker sent them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: "TokenLogprobs") -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


def legacy_token(codec: TextCodec, token_id: int) -> str:
    """A token as the legacy completions object names it: its text, or "bytes:\\xNN..." when its bytes are not
    valid UTF-8 by themselves (part of a character), as OpenAI's API writes them."""
    raw = codec.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token's text starts in the output text (characters), across the chunks of a stream: bytes of
    an unfinished character wait for the rest of it, special tokens add no text (the output skips them) unless
    the text is a prompt as the client wrote it (keep_special)."""

    def __init__(self, codec: TextCodec):
        self.codec, self.chars = codec, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_ids: list[int], keep_special: bool = False) -> list[int]:
        starts = []
        for token_id in token_ids:
            starts.append(self.chars)
            if keep_special or not self.codec.is_special(token_id):
                self.chars += len(self.decoder.decode(self.codec.token_bytes(token_id)))
        return starts


def completion_logprobs(run: TokenLogprobs, codec: TextCodec, offsets: TextOffsets,
                        keep_special: bool = False) -> dict:
    """The legacy completions object; offsets carries on from the previous chunk of the same stream."""
    tokens = [legacy_token(codec, t) for t in run.token_ids]
    top = []
    for token, logprob, ids, values in zip(tokens, run.logprobs, run.top_ids, run.top_logprobs):
        entry = {legacy_token(codec, i): v for i, v in zip(ids, values)}
        entry.setdefault(token, logprob)  # the chosen token is always listed
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": run.logprobs, "top_logprobs": top,
            "text_offset": offsets.take(run.token_ids, keep_special)}


def chat_logprobs(run: TokenLogprobs, codec: TextCodec) -> dict:
    def described(token_id: int, logprob: float) -> dict:
        raw = codec.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    content = []
    for token_id, logprob, ids, values in zip(run.token_ids, run.logprobs, run.top_ids, run.top_logprobs):
        content.append({**described(token_id, logprob),
                        "top_logprobs": [described(i, v) for i, v in zip(ids, values)]})
    return {"content": content}


def prompt_logprobs(prompt_ids: list[int], scored: TokenLogprobs | None, codec: TextCodec,
                    offsets: TextOffsets, as_written: bool) -> dict:
    """The echoed prompt's part of a legacy completions object: the first token has no log-probability (null),
    the others are scored (tokens 1..); offsets carries on into the completion's part. as_written: the echoed
    text is the client's own prompt string, special tokens included."""
    first = {"tokens": [legacy_token(codec, prompt_ids[0])], "token_logprobs": [None], "top_logprobs": [None],
             "text_offset": offsets.take(prompt_ids[:1], as_written)}
    if scored is None or not scored.token_ids:
        return first
    return joined(first, completion_logprobs(scored, codec, offsets, as_written))


def joined(*parts: dict) -> dict:
    """Legacy completions objects one after the other (prompt, then completion)."""
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}
