"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path (anthropic_messages.py
translates), streamed in Anthropic's event sequence; errors in Anthropic's shape; the API key in x-api-key or
Authorization: Bearer."""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.anthropic_messages import MessageEvents, chat_body, error_body, event, message_of
from gateway.choices import Disconnected, Failed
from gateway.request_bounds import RequestBounds
from gateway.responses import Responses
from gateway.schemas import ApiError, parse_json
from gateway.tokenization import TextCodec


@dataclass
class AnthropicRoutes:
    prepare_chat: Callable  # async (chat body) -> GenerationParams
    start: Callable  # async (request, params, id prefix) -> (choices, early events, id) or a Response
    responses: Responses
    codec: TextCodec
    settings: object  # the app's GatewaySettings
    bounds: RequestBounds


def add_anthropic_routes(app: FastAPI, routes: AnthropicRoutes) -> None:
    settings, log = routes.settings, logging.getLogger("dflash.gateway")

    def refused(exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status, headers=exc.headers)

    def authorized(request: Request) -> bool:
        key = settings.api_key
        return not key or request.headers.get("x-api-key") == key or \
            request.headers.get("authorization") == f"Bearer {key}"

    async def read(request: Request, count_only: bool) -> dict:
        if not authorized(request):
            raise ApiError(401, "a valid API key is required (x-api-key, or Authorization: Bearer)")
        body = parse_json(await routes.bounds.read_body(request))
        chat = chat_body(body, count_only)
        chat.setdefault("model", settings.model_name)
        return chat

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            params = await routes.prepare_chat({**await read(request, count_only=True), "stream": False})
        except ApiError as exc:
            return refused(exc)
        return {"input_tokens": len(params.prompts[0].ids)}

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            params = await routes.prepare_chat(await read(request, count_only=False))
            started = await routes.start(request, params, "msg_")
            if isinstance(started, Response):
                return started
            choices, early, message_id = started
            if params.stream:
                return StreamingResponse(stream(choices, early, message_id, params),
                                         media_type="text/event-stream")
            answer = await routes.responses.collect(choices, early, True, message_id)
        except ApiError as exc:
            return refused(exc)
        if isinstance(answer, Response):
            return answer
        return message_of(message_id, params.model, answer, choices.ordered[0].stops.matched)

    async def stream(choices, early, message_id: str, params):
        events = MessageEvents(params.model, len(params.prompts[0].ids))
        events.id = message_id
        turn = choices.ordered[0]
        reader = routes.responses.reader(turn)
        finished = False
        try:
            yield events.start()
            async for turn, delta, _, ended in choices.events(early):
                for parts in reader.feed(delta, ended) if reader.reads else ([{"content": delta}] if delta else []):
                    for line in events.delta(parts):
                        yield line
            for line in events.stop(reader.finish_reason(turn.finish_reason), len(turn.token_ids), turn.stops.matched):
                yield line
            finished = True
            choices.finish("success")
        except Failed as failed:
            finished = True
            await choices.abort_unfinished()
            choices.finish("error")
            yield event("error", error_body(503, failed.event.message))
        except Disconnected:
            finished = True
            await choices.release()
        except Exception:  # a bug here must end this stream with an error event, not a reset connection
            finished = True
            log.exception("message stream %s failed", message_id)
            await choices.release()
            choices.finish("error")
            yield event("error", error_body(500, "internal server error"))
        finally:
            if not finished:
                await choices.release()
