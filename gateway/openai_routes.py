"""/v1/completions and /v1/chat/completions: OpenAI's generation routes over the request path
(generation_path.py)."""

from collections.abc import Callable

from fastapi import FastAPI, Request

from gateway.generation_path import GenerationPath
from gateway.request_fields import CHAT, COMPLETIONS, body_schema


def documented_body(endpoint: str) -> dict:
    """The OpenAPI requestBody of an endpoint (the route still reads the raw body, for OpenAI-style errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema(endpoint)}}}}


def add_openai_routes(app: FastAPI, path: GenerationPath, authorize: Callable[[Request], None]) -> None:

    @app.post("/v1/completions", openapi_extra=documented_body(COMPLETIONS))
    async def completions(request: Request):
        authorize(request)
        params = await path.prepare_completion(await path.read_json(request, COMPLETIONS))
        return await path.generate(request, params, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=documented_body(CHAT))
    async def chat_completions(request: Request):
        authorize(request)
        params = await path.prepare_chat(await path.read_json(request, CHAT))
        return await path.generate(request, params, chat=True)
