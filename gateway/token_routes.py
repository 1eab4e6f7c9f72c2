"""/tokenize and /detokenize in vLLM's shapes: a prompt, or chat messages (with tools) through the chat template, to
the token ids a request would send ({"count", "max_model_len", "tokens", "token_strs"}); token ids back to text
({"prompt"})."""

from collections.abc import Callable

from fastapi import FastAPI, Request

from gateway.request_bounds import RequestBounds
from gateway.schemas import ApiError, parse_json, parse_messages, served_model_of, template_kwargs
from gateway.tokenization import RenderedTooLong, TextCodec
from gateway.tool_calls import tool_request


def add_token_routes(app: FastAPI, codec: TextCodec, bounds: RequestBounds, model_name: str, max_model_len: int,
                     vocab_size: int, authorize: Callable[[Request], None]) -> None:

    async def read(request: Request) -> dict:
        """The body of an authorized request for the served model, on a server with a tokenizer."""
        authorize(request)
        body = parse_json(await bounds.read_body(request))
        served_model_of(body, model_name)
        if not codec.has_tokenizer:
            raise ApiError(400, "this server has no tokenizer (the target folder has no tokenizer.json)",
                           param="prompt")
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read(request)
        strings = body.get("return_token_strs", False)
        if not isinstance(strings, bool):
            raise ApiError(400, "'return_token_strs' must be a boolean", param="return_token_strs")
        if "messages" in body:
            generation = body.get("add_generation_prompt", True)
            if not isinstance(generation, bool):
                raise ApiError(400, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
            tools = tool_request(body)
            try:
                text = codec.render_chat(parse_messages(body["messages"], bounds.context_tokens), bounds.text_chars,
                                         tools=tools.raw if tools else None, add_generation_prompt=generation,
                                         template_kwargs=template_kwargs(body))
            except RenderedTooLong:
                raise ApiError(400, f"the conversation through the chat template passes {bounds.text_chars} "
                               "characters", param="messages", code="context_length_exceeded") from None
            except Exception as exc:  # jinja raises many types on a template the messages do not fit
                raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", param="messages")
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "send 'prompt' (a string) or 'messages'", param="prompt")
        bounds.check_text(text, codec.normalized_chars, "prompt", "the text")
        ids = codec.encode(text)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": [codec.tokenizer.id_to_token(i) for i in ids] if strings else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
                                                for i in ids):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab_size})", param="tokens")
        if len(ids) > max_model_len:
            raise ApiError(400, f"'tokens' holds {len(ids)} ids, more than the context of {max_model_len}",
                           param="tokens")
        return {"prompt": codec.decode(ids)}
