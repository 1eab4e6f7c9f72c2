"""The request-body cap: its default, derived from the context (the flag is --max-body-mb, in shared.settings)."""

MIB = 1 << 20
BODY_FLOOR_BYTES = 4 * MIB
# A token of the longest context, written in a request body, takes at most about 10 bytes in practice: English
# text averages 4-5 bytes a token, CJK text escaped as \uXXXX about 8, code with its \n and \" escapes 8-10, a
# token id 8 ("151643, "). 32 leaves room for three times that and for the rest of the body.
BODY_BYTES_PER_TOKEN = 32


def default_body_bytes(max_model_len: int) -> int:
    """The body cap when no flag sets it: 32 bytes a token of the context, at least 4 MiB (a batch of prompts,
    the messages of a conversation and the other fields fit beside a small context's prompt)."""
    return max(BODY_FLOOR_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def body_bytes(megabytes: float | None, max_model_len: int) -> int:
    """The cap in bytes: --max-body-mb's value, or the default for this context."""
    return default_body_bytes(max_model_len) if megabytes is None else max(1, int(megabytes * MIB))


def mebibytes(count: int) -> str:
    return f"{count / MIB:g} MiB"
