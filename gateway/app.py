"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics
(and /tokenize, /detokenize: token_routes.py).
The routes only: a request's choices (choices.py), its messages to the verify worker (submission.py), its answer
(responses.py) and the readiness probe (readiness.py) live beside them."""

import asyncio
import logging
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.anthropic_routes import AnthropicRoutes, add_anthropic_routes
from gateway.body_limit import body_bytes
from gateway.chat_grammar import CLOSE as CLOSE_THINKING, chat_grammar
from gateway.choices import ChoiceSet
from gateway.metrics import GatewayMetrics
from gateway.readiness import ReadinessProbe
from gateway.reasoning import opens_thinking, reasoning_parser_on
from gateway.request_bounds import RequestBounds
from gateway.request_fields import CHAT, COMPLETIONS, body_schema, unknown_fields
from gateway.responses import Responses
from gateway.schemas import ApiError, GenerationParams, Prompt, parse_chat, parse_completion, parse_json
from gateway.structured_outputs import Constraint, GrammarCompiler, constraint_of
from gateway.submission import ModelLimits, max_tokens_for, submit_messages
from gateway.token_routes import add_token_routes
from gateway.tokenization import RenderedTooLong, TextCodec
from gateway.tool_calls import call_format
from gateway.verify_client import VerifyClient
from shared.channel_gateway import RequestFailed

FAILURE_STATUS = {"invalid_request": 400, "queue_full": 429, "verify_worker_down": 503}
UNKNOWN_FIELDS_LOGGED = 256  # distinct names logged at most (a client could send endless new ones)


def documented_body(endpoint: str) -> dict:
    """The OpenAPI requestBody of an endpoint (the route still reads the raw body, for OpenAI-style errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema(endpoint)}}}}


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


def refusal(failed: RequestFailed) -> ApiError:
    """The HTTP error of a choice the verify worker refused before it started."""
    status = FAILURE_STATUS.get(failed.code, 500)
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, failed.message, code=failed.code, kind=kind,
                    headers={"Retry-After": "1"} if status in (429, 503) else None)


def create_app(settings: GatewaySettings, codec: TextCodec, log: logging.Logger | None = None) -> FastAPI:
    log = log or logging.getLogger("dflash.gateway")
    metrics = GatewayMetrics()
    client = VerifyClient(settings.requests_addr, settings.events_addr, settings.dead_after_s, log,
                          on_bad_message=lambda: metrics.bad.labels("gateway").inc())
    probe = ReadinessProbe(client, settings.drafter_configured, settings.probe_interval_s, settings.ready_window_s)
    bounds = RequestBounds(settings.max_body_bytes or body_bytes(None, settings.max_model_len),
                           settings.max_model_len, codec.longest_token_bytes, settings.max_pending)
    limits = ModelLimits(settings.vocab_size, settings.max_model_len, settings.default_max_tokens)
    call_fmt = call_format(settings.tool_call_parser, codec.chat_template)  # None: tools are refused
    splits_reasoning = reasoning_parser_on(settings.reasoning_parser, codec.chat_template)
    tags = codec.added_token_texts  # tags a grammar names as tokens
    responses = Responses(codec, settings.model_name, log, call_fmt)
    grammars = GrammarCompiler(codec.tokenizer, settings.vocab_size, codec.eos_token_ids)
    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None)
    app.state.client, app.state.metrics, app.state.probe, app.state.bounds = client, metrics, probe, bounds

    @app.on_event("startup")
    async def startup():
        client.start()
        app.state.probe_task = asyncio.get_running_loop().create_task(probe.run())

    @app.on_event("shutdown")
    async def shutdown():
        app.state.probe_task.cancel()
        await client.close()

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

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        ok, body = probe.status()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        metrics.verify_up.set(1 if client.alive else 0)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        heartbeat = client.last_heartbeat
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": 0, "owned_by": "dflash-serve",
            "root": settings.model_name, "parent": None, "max_model_len": settings.max_model_len,
            "drafter": {"kind": heartbeat.drafter_kind if heartbeat else "unknown",
                        "available": bool(heartbeat and heartbeat.drafter_available),
                        "license": settings.drafter_license},
        }]}

    unknown_logged: set[str] = set()

    async def read_json(request: Request, endpoint: str) -> dict:
        """The body, read under its cap and parsed; fields no endpoint field has are logged once per name (they
        are ignored, as in vLLM: a harness that sends a field this server lacks learns it from the log)."""
        body = parse_json(await bounds.read_body(request))
        for name in unknown_fields(body, endpoint):
            if name not in unknown_logged and len(unknown_logged) < UNKNOWN_FIELDS_LOGGED:
                unknown_logged.add(name)
                log.warning("request field %.60r is not supported and is ignored (logged once)%s", name,
                            "; further unknown fields are not logged" if len(unknown_logged) == UNKNOWN_FIELDS_LOGGED
                            else "")
        return body

    def needs_text(what: str, param: str) -> None:
        if not codec.has_tokenizer:
            raise ApiError(400, f"{what} needs a tokenizer, and this server has none (the target folder has no "
                           "tokenizer.json): send the prompt as token ids, without stop strings", param=param)

    async def constrain(params: GenerationParams, body: dict) -> None:
        """The request's grammar (response_format, structured_outputs, guided_*), compiled off the event loop."""
        constraint = constraint_of(body)
        if constraint is not None:
            params.grammar = await grammars.grammar(constraint)

    async def constrain_chat(params: GenerationParams, body: dict) -> None:
        """A chat answer's grammar (chat_grammar.py), compiled off the event loop."""
        constraint = chat_grammar(params, constraint_of(body), call_fmt, tags)
        if constraint is not None:
            params.grammar = await grammars.grammar(constraint)
        if params.thinking and params.thinking_budget is not None:  # chat_grammar checked </think> is a token
            params.thinking_end = [params.thinking_budget, codec.tokenizer.token_to_id(CLOSE_THINKING)]

    add_token_routes(app, codec, bounds, settings.model_name, settings.max_model_len, settings.vocab_size, authorize)

    @app.post("/v1/completions", openapi_extra=documented_body(COMPLETIONS))
    async def completions(request: Request):
        authorize(request)
        body = await read_json(request, COMPLETIONS)
        params = parse_completion(body, settings.model_name, settings.vocab_size, bounds.max_choices)
        await constrain(params, body)
        if any(prompt.text is not None for prompt in params.prompts):
            needs_text("a text prompt", "prompt")
        if params.stop:
            needs_text("a stop string", "stop")
        bounds.check_params(params, codec.normalized_chars)
        for prompt in params.prompts:
            if prompt.text is not None:
                prompt.ids = codec.encode(prompt.text)
        return await generate(request, params, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=documented_body(CHAT))
    async def chat_completions(request: Request):
        authorize(request)
        params = await prepare_chat(await read_json(request, CHAT))
        return await generate(request, params, chat=True)

    async def prepare_chat(body: dict) -> GenerationParams:
        """A chat body's parameters, its prompt rendered and tokenized, its grammar compiled."""
        params = parse_chat(body, settings.model_name, settings.vocab_size, bounds.context_tokens)
        if params.tools is not None and call_fmt is None:
            raise ApiError(400, "tool calling is off on this server (--tool-call-parser none)", param="tools")
        needs_text("a chat completion (its messages go through the chat template)", "messages")
        bounds.check_params(params, codec.normalized_chars)
        try:
            text = codec.render_chat(params.messages, bounds.text_chars,
                                     tools=params.tools.raw if params.tools else None,
                                     template_kwargs=params.template_kwargs)
        except RenderedTooLong:
            raise ApiError(400, f"the conversation through the chat template passes {bounds.text_chars} characters, "
                           f"more than this model's context of {settings.max_model_len} tokens can hold",
                           param="messages", code="context_length_exceeded") from None
        except Exception as exc:  # jinja raises many types on a template the messages do not fit
            raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", param="messages")
        bounds.check_text(text, codec.normalized_chars, "messages", "the conversation through the chat template")
        params.thinking = opens_thinking(text) if splits_reasoning else None
        await constrain_chat(params, body)
        params.prompts = [Prompt(None, codec.encode(text))]
        return params

    async def generate(request: Request, params: GenerationParams, chat: bool):
        """The answer of a request in OpenAI's shapes (start: its choices)."""
        started = await start(request, params, "chatcmpl-" if chat else "cmpl-")
        if isinstance(started, Response):
            return started
        choices, early, base = started
        if params.stream:
            return StreamingResponse(responses.stream(choices, early, chat, base), media_type="text/event-stream")
        return await responses.collect(choices, early, chat, base)

    async def start(request: Request, params: GenerationParams, id_prefix: str):
        """Submit one verify-worker request per choice (n per prompt), all answering on one queue: (the choices,
        their first events, the response id), or a 499 for a client gone; an HTTP error if any choice is refused
        before it starts."""
        max_tokens = [max_tokens_for(params, prompt, limits) for prompt in params.prompts]
        count = len(params.prompts) * params.n  # at most max_pending: RequestBounds.check_params
        if not client.alive:
            raise ApiError(503, "the verify worker is not available", kind="server_error", code="service_unavailable",
                           headers={"Retry-After": "5"})
        user_requests = [r for r in client.queues if not r.startswith("probe-")]
        if len(user_requests) + count > settings.max_pending:
            metrics.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at capacity ({settings.max_pending} requests in flight); retry "
                           "shortly", kind="rate_limit_error", code="server_busy", headers={"Retry-After": "1"})
        base = id_prefix + uuid.uuid4().hex
        choices = ChoiceSet(request, params, client, metrics)
        await choices.submit(submit_messages(params, max_tokens, base, count, codec.eos_token_ids), codec)
        metrics.prompt_tokens.inc(sum(len(prompt.ids) for prompt in params.prompts))
        early = await choices.first_events()
        if early is None or isinstance(early, RequestFailed):
            await choices.release()
        if early is None:
            return Response(status_code=499)
        if isinstance(early, RequestFailed):
            metrics.requests.labels("rejected" if early.code == "queue_full" else "error").inc()
            raise refusal(early)
        return choices, early, base

    add_anthropic_routes(app, AnthropicRoutes(prepare_chat, start, responses, codec, settings, bounds))
    return app
