"""What one request may cost the gateway, bounded at the first place each cost can be known: the body's bytes
while it is read (never buffered past the cap), then every prompt, chat message and stop string before it is
tokenised or rendered, and the number of choices before any of them is."""

from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from gateway.body_limit import mebibytes
from gateway.schemas import ApiError, GenerationParams

@dataclass(frozen=True)
class RequestBounds:
    """The limits of one server. text_chars bounds every text before it is tokenised: no text of more characters
    fits the context, since a token stands for at most token_bytes bytes (the longest token of the vocabulary)
    and a character is at least one byte. That holds for every tokenizer whose pre-tokenizer drops no text
    (byte-level BPE as in Qwen3, Llama 3 and GLM; SentencePiece); the normalizer is applied before the count where
    the tokenizer has one (NFC can merge characters)."""

    body_bytes: int
    context_tokens: int
    token_bytes: int
    max_choices: int

    def __post_init__(self):
        if min(self.body_bytes, self.context_tokens, self.token_bytes, self.max_choices) < 1:
            raise ValueError(f"every request bound must be at least 1: {self}")

    @property
    def text_chars(self) -> int:
        return self.context_tokens * self.token_bytes

    def _too_large(self, size: int | None) -> ApiError:
        has = f"has {size} bytes, more than" if size is not None else "passes"
        return ApiError(413, f"the request body {has} this server's limit of {self.body_bytes} bytes "
                        f"({mebibytes(self.body_bytes)}; the operator sets it with --max-body-mb)",
                        code="request_too_large")

    async def read_body(self, request: Request) -> bytes:
        """The request's body, refused with a 413 as soon as it is known to exceed body_bytes: from its
        Content-Length before a byte is read, else while reading (a chunked body), never buffering more than the
        cap and one chunk. The server discards the rest of a refused body without keeping it."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.body_bytes:
            raise self._too_large(int(declared))
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > self.body_bytes:
                    raise self._too_large(None)
                parts.append(part)
        except ClientDisconnect:
            raise ApiError(400, "the client closed the connection before the body ended", code="incomplete_body") \
                from None
        return b"".join(parts)

    def check_text(self, text: str, normalized_chars: Callable[[str], int], param: str, what: str) -> None:
        """A 400 when `text` has more characters than the context can hold (after the tokenizer's normalizer)."""
        if len(text) <= self.text_chars:
            return
        chars = normalized_chars(text)
        if chars > self.text_chars:
            raise ApiError(400, f"{what} has {chars} characters; this model's context of {self.context_tokens} "
                           f"tokens holds at most {self.text_chars} ({self.token_bytes} bytes a token at most, the "
                           "longest token of its vocabulary)", param=param, code="context_length_exceeded")

    def check_ids(self, ids: list[int], param: str) -> None:
        if len(ids) > self.context_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.context_tokens} "
                           "tokens", param=param, code="context_length_exceeded")

    def check_params(self, params: GenerationParams, normalized_chars: Callable[[str], int]) -> None:
        """Every bound a parsed request can be held to before any text is tokenised or rendered: the number of
        choices, each prompt (text or token ids), each stop string and each chat message."""
        choices = max(1, len(params.prompts)) * params.n
        if choices > self.max_choices:
            raise ApiError(400, f"this request asks for {choices} choices (prompts x n); the server admits at most "
                           f"{self.max_choices} at once", param="n")
        for index, prompt in enumerate(params.prompts):
            what = "the prompt" if len(params.prompts) == 1 else f"prompt {index}"
            if prompt.text is None:
                self.check_ids(prompt.ids, "prompt")
            else:
                self.check_text(prompt.text, normalized_chars, "prompt", what)
        for stop in params.stop:
            if len(stop) > self.text_chars:  # longer than any text the context can hold: it could never match
                raise ApiError(400, f"a stop string has {len(stop)} characters; no output of this model's context "
                               f"({self.context_tokens} tokens) is longer than {self.text_chars}", param="stop")
        for index, message in enumerate(params.messages or ()):
            self.check_text(message["content"], normalized_chars, "messages", f"messages[{index}].content")
