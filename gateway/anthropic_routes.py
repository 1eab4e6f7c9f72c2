"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path (anthropic_messages.py
translates), streamed in Anthropic's event sequence; errors in Anthropic's shape; the API key in x-api-key or
Authorization: Bearer."""

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.anthropic_messages import MessageEvents, chat_body, error_body, event, message_of
from gateway.generation_path import GenerationPath
from gateway.request_bounds import RequestBounds
from gateway.schemas import ApiError, parse_json


@dataclass
class AnthropicRoutes:
    path: GenerationPath
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
            params = await routes.path.prepare_chat({**await read(request, count_only=True), "stream": False})
        except ApiError as exc:
            return refused(exc)
        return {"input_tokens": len(params.prompts[0].ids)}

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            params = await routes.path.prepare_chat(await read(request, count_only=False))
            started = await routes.path.start(request, params, "msg_")
            if isinstance(started, Response):
                return started
            choices, early, message_id = started
            if params.stream:
                return StreamingResponse(stream(choices, early, message_id, params),
                                         media_type="text/event-stream")
            answer = await routes.path.responses.collect(choices, early, True, message_id)
        except ApiError as exc:
            return refused(exc)
        if isinstance(answer, Response):
            return answer
        return message_of(message_id, params.model, answer, choices.ordered[0].stops.matched)

    async def stream(choices, early, message_id: str, params):
        turn = choices.ordered[0]  # heard from already: its cached prompt tokens are known
        events = MessageEvents(params.model, len(params.prompts[0].ids), turn.cached_tokens)
        events.id = message_id
        reader = routes.path.responses.reader(turn)

        async def lines():
            yield events.start()
            async for _, delta, _, ended in choices.events(early):  # one choice: `turn`
                for parts in reader.feed(delta, ended) if reader.reads else ([{"content": delta}] if delta else []):
                    for line in events.delta(parts):
                        yield line
            for line in events.stop(reader.finish_reason(turn.finish_reason), len(turn.token_ids), turn.stops.matched):
                yield line

        def error_lines(status: int, message: str, _code: str) -> list[str]:
            return [event("error", error_body(status, message))]

        async for line in choices.guarded(lines(), error_lines, log, message_id):
            yield line
