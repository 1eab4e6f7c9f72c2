"""The HTTP app: its settings, the verify-worker client and readiness probe it starts and stops, its error
shapes, and its routes, each group in its module: OpenAI's generation routes (openai_routes.py), Anthropic's
(anthropic_routes.py), /tokenize and /detokenize (token_routes.py), /health, /ready, /metrics and /v1/models
(service_routes.py); every generation request takes one path (generation_path.py)."""

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.anthropic_routes import AnthropicRoutes, add_anthropic_routes
from gateway.body_limit import body_bytes
from gateway.generation_path import GenerationPath
from gateway.metrics import GatewayMetrics
from gateway.openai_routes import add_openai_routes
from gateway.readiness import ReadinessProbe
from gateway.request_bounds import RequestBounds
from gateway.schemas import ApiError
from gateway.service_routes import add_service_routes
from gateway.token_routes import add_token_routes
from gateway.tokenization import TextCodec
from gateway.verify_client import VerifyClient


@dataclass
class GatewaySettings:
    model_name: str
    vocab_size: int
    max_model_len: int
    requests_addr: str
    events_addr: str
    api_key: str | None = None
    max_pending: int = 64  # requests admitted at once (running + queued); more get 429
    default_max_tokens: int = 256
    drafter_configured: bool = True
    probe_interval_s: float = 2.0
    ready_window_s: float = 10.0
    dead_after_s: float = 2.0
    max_body_bytes: int | None = None  # None: body_limit.default_body_bytes(max_model_len)
    tool_call_parser: str = "auto"  # tool_calls.call_format's choice (--tool-call-parser)
    reasoning_parser: str = "auto"  # reasoning.reasoning_parser_on's choice (--reasoning-parser)
    drafter_license: str | None = None  # as the drafter's model card names it (shared/model_card.py)


def create_app(settings: GatewaySettings, codec: TextCodec, log: logging.Logger | None = None) -> FastAPI:
    log = log or logging.getLogger("dflash.gateway")
    metrics = GatewayMetrics()
    client = VerifyClient(settings.requests_addr, settings.events_addr, settings.dead_after_s, log,
                          on_bad_message=lambda: metrics.bad.labels("gateway").inc())
    probe = ReadinessProbe(client, settings.drafter_configured, settings.probe_interval_s, settings.ready_window_s)
    bounds = RequestBounds(settings.max_body_bytes or body_bytes(None, settings.max_model_len),
                           settings.max_model_len, codec.longest_token_bytes, settings.max_pending)
    path = GenerationPath(settings, codec, client, metrics, bounds, log)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        app.state.probe_task = asyncio.get_running_loop().create_task(probe.run())
        try:
            yield
        finally:
            app.state.probe_task.cancel()
            await client.close()

    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.client, app.state.metrics, app.state.probe, app.state.bounds = client, metrics, probe, bounds

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), status_code=500)

    def authorize(request: Request) -> None:
        if settings.api_key and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise ApiError(401, "a valid API key is required (Authorization: Bearer ...)",
                           kind="authentication_error", code="invalid_api_key")

    add_service_routes(app, settings, client, probe, metrics, authorize)
    add_token_routes(app, codec, bounds, settings.model_name, settings.max_model_len, settings.vocab_size, authorize)
    add_openai_routes(app, path, authorize)
    add_anthropic_routes(app, AnthropicRoutes(path, settings, bounds))
    return app
