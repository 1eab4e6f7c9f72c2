"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics."""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.logprobs import TextOffsets, TokenLogprobs, chat_logprobs, completion_logprobs, joined, prompt_logprobs
from gateway.metrics import GatewayMetrics
from gateway.schemas import ApiError, GenerationParams, parse_chat, parse_completion, parse_json
from gateway.tokenization import IncrementalDetokenizer, StopMatcher, TextCodec
from gateway.verify_client import VerifyClient
from shared.channel_gateway import RequestFailed, SubmitRequest, TokenEvent

FAILURE_STATUS = {"invalid_request": 400, "queue_full": 429, "verify_worker_down": 503}


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


@dataclass
class Probe:
    last_ok: float = 0.0
    drafted: bool = False
    detail: str = "no probe has run yet"


@dataclass
class Turn:
    """The state of one request while its events arrive."""

    request_id: str
    params: GenerationParams
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    started: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: TokenLogprobs | None = None  # every token's, when the request asked for them
    prompt_logprobs: TokenLogprobs | None = None  # the prompt's tokens 1.., with echo and logprobs

    def absorb(self, event: TokenEvent, metrics: GatewayMetrics) -> str:
        """Take one event; returns the text it adds (stop strings cut, broken UTF-8 held back)."""
        now = time.monotonic()
        if event.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.started)
            elif self.last_token_at is not None:
                per_token = (now - self.last_token_at) / len(event.token_ids)
                for _ in event.token_ids:
                    metrics.itl.observe(per_token)
            self.last_token_at = now
        self.token_ids.extend(event.token_ids)
        if event.prompt_logprobs is not None and self.params.logprobs is not None:
            self.prompt_logprobs = event_prompt_logprobs(event, self.params)
        run = event_logprobs(event)
        if run is not None and self.params.logprobs is not None:
            self.logprobs = self.logprobs or TokenLogprobs()
            self.logprobs.extend(run)
        self.verify_steps, self.draft_tokens = event.verify_steps, event.draft_tokens
        self.accepted_tokens = event.accepted_tokens
        delta = self.detokenizer.add(event.token_ids)
        if event.finish_reason is not None:
            delta += self.detokenizer.flush()
        emitted, stopped = self.stops.feed(delta)
        if stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            emitted += self.stops.flush()
            self.finish_reason = event.finish_reason
        self.text += emitted
        return emitted

    def usage(self) -> dict:
        completion = len(self.token_ids)
        return {
            "prompt_tokens": len(self.params.prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(self.params.prompt_ids) + completion,
            "completion_tokens_details": {
                "accepted_prediction_tokens": self.accepted_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_tokens,
            },
            "speculative": {
                "verify_steps": self.verify_steps,
                "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_length": round((completion - 1) / self.verify_steps, 4) if self.verify_steps else 0.0,
            },
        }


def event_logprobs(event: TokenEvent) -> TokenLogprobs | None:
    if event.logprobs is None:
        return None
    return TokenLogprobs(list(event.token_ids), list(event.logprobs), list(event.top_ids), list(event.top_logprobs))


def event_prompt_logprobs(event, params: GenerationParams) -> TokenLogprobs | None:
    """The prompt's scored tokens (1..) carried by a request's first event, if it carries them."""
    if not isinstance(event, TokenEvent) or event.prompt_logprobs is None:
        return None
    return TokenLogprobs(params.prompt_ids[1:], list(event.prompt_logprobs), list(event.prompt_top_ids),
                         list(event.prompt_top_logprobs))


def create_app(settings: GatewaySettings, codec: TextCodec, log: logging.Logger | None = None) -> FastAPI:
    log = log or logging.getLogger("dflash.gateway")
    metrics = GatewayMetrics()
    client = VerifyClient(settings.requests_addr, settings.events_addr, settings.dead_after_s, log,
                          on_bad_message=lambda: metrics.bad.labels("gateway").inc())
    probe = Probe()
    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None)
    app.state.client, app.state.metrics, app.state.probe = client, metrics, probe

    @app.on_event("startup")
    async def startup():
        client.start()
        app.state.probe_task = asyncio.get_running_loop().create_task(probe_loop())

    @app.on_event("shutdown")
    async def shutdown():
        app.state.probe_task.cancel()
        await client.close()

    async def probe_loop():
        """A real generation through the verify worker (and the drafter) every probe_interval_s."""
        while True:
            await asyncio.sleep(settings.probe_interval_s if probe.last_ok else 0.2)
            if not client.alive:
                probe.detail = "the verify worker is not responding"
                continue
            request_id = f"probe-{uuid.uuid4().hex}"
            message = SubmitRequest(request_id, [0], 3, 0.0, 1.0, 0, 0, [], 1)
            try:
                queue = await client.submit(message)
                while True:
                    event = await asyncio.wait_for(queue.get(), timeout=10)
                    if isinstance(event, RequestFailed):
                        probe.detail = f"probe failed: {event.message}"
                        break
                    if event.finish_reason is not None:
                        probe.last_ok, probe.drafted = time.monotonic(), event.draft_tokens > 0
                        probe.detail = "ok" if probe.drafted or not settings.drafter_configured else \
                            "the drafter did not take part (unavailable): serving without speculation"
                        break
            except (asyncio.TimeoutError, ConnectionError) as exc:
                probe.detail = f"probe failed: {exc or 'timeout'}"
            finally:
                client.finish(request_id)

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
        recent = probe.last_ok and time.monotonic() - probe.last_ok < settings.ready_window_s
        heartbeat = client.last_heartbeat
        drafter_up = bool(probe.drafted and heartbeat and heartbeat.drafter_available)
        ok = client.alive and recent and (drafter_up or not settings.drafter_configured)
        body = {
            "ready": bool(ok),
            "verify_worker": "up" if client.alive else "down",
            "drafter": ("available" if heartbeat and heartbeat.drafter_available else "unavailable")
            if settings.drafter_configured else "none",
            "detail": probe.detail if client.alive else "the verify worker is not responding",
            "running": heartbeat.running if heartbeat else None,
            "waiting": heartbeat.waiting if heartbeat else None,
        }
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
            "max_model_len": settings.max_model_len,
            "drafter": {"kind": heartbeat.drafter_kind if heartbeat else "unknown",
                        "available": bool(heartbeat and heartbeat.drafter_available)},
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        params = parse_completion(parse_json(await request.body()), settings.model_name)
        if params.prompt_text is not None:
            params.prompt_ids = codec.encode(params.prompt_text)
        return await generate(request, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        params = parse_chat(parse_json(await request.body()), settings.model_name)
        try:
            params.prompt_ids = codec.encode(codec.render_chat(params.messages))
        except Exception as exc:  # jinja raises many types on a template the messages do not fit
            raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", param="messages")
        return await generate(request, params, chat=True)

    def check_lengths(params: GenerationParams) -> None:
        prompt_len = len(params.prompt_ids)
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        bad = next((t for t in params.prompt_ids if not 0 <= t < settings.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (size {settings.vocab_size})",
                           param="prompt")
        room = settings.max_model_len - prompt_len
        if room < (0 if params.max_tokens == 0 else 1):  # scoring a prompt (echo, max_tokens 0) needs no room
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{settings.max_model_len} tokens", param="prompt", code="context_length_exceeded")
        if params.max_tokens is None:
            params.max_tokens = min(settings.default_max_tokens, room)
        elif params.max_tokens > room:
            raise ApiError(400, f"max_tokens ({params.max_tokens}) plus the prompt ({prompt_len} tokens) exceeds "
                           f"this model's context of {settings.max_model_len} tokens", param="max_tokens",
                           code="context_length_exceeded")

    async def generate(request: Request, params: GenerationParams, chat: bool):
        check_lengths(params)
        if not client.alive:
            raise ApiError(503, "the verify worker is not available", kind="server_error", code="service_unavailable",
                           headers={"Retry-After": "5"})
        user_requests = [r for r in client.queues if not r.startswith("probe-")]
        if len(user_requests) >= settings.max_pending:
            metrics.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at capacity ({settings.max_pending} requests in flight); retry "
                           "shortly", kind="rate_limit_error", code="server_busy", headers={"Retry-After": "1"})
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        turn = Turn(request_id, params, codec.detokenizer(), StopMatcher(params.stop), time.monotonic())
        message = SubmitRequest(
            request_id, params.prompt_ids, params.max_tokens, params.temperature, params.top_p, params.top_k,
            params.seed, list(codec.eos_token_ids), params.num_speculative_tokens, params.logprobs,
            params.echo and params.logprobs is not None,
        )
        try:
            queue = await client.submit(message)
        except ConnectionError as exc:
            raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
        metrics.prompt_tokens.inc(len(params.prompt_ids))
        first = await next_event(request, queue, request_id)
        if isinstance(first, RequestFailed):
            client.finish(request_id)
            metrics.requests.labels("rejected" if first.code == "queue_full" else "error").inc()
            status = FAILURE_STATUS.get(first.code, 500)
            kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
            raise ApiError(status, first.message, code=first.code, kind=kind,
                           headers={"Retry-After": "1"} if status in (429, 503) else None)
        if first is None:
            return Response(status_code=499)
        if params.stream:
            return StreamingResponse(stream(request, queue, turn, first, chat), media_type="text/event-stream")
        return await collect(request, queue, turn, first, chat)

    def echoed_prompt(params: GenerationParams) -> str:
        if params.prompt_text is not None:
            return params.prompt_text
        return codec.tokenizer.decode(params.prompt_ids, skip_special_tokens=True)

    async def next_event(request: Request, queue: asyncio.Queue, request_id: str):
        """The next event, or None when the client went away (the request is then aborted)."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    await client.abort(request_id)
                    metrics.requests.labels("aborted").inc()
                    return None

    def finish_turn(turn: Turn, outcome: str) -> None:
        client.finish(turn.request_id)
        metrics.requests.labels(outcome).inc()
        metrics.generation_tokens.inc(len(turn.token_ids))
        metrics.e2e.observe(time.monotonic() - turn.started)

    async def events_of(request, queue, turn: Turn, first):
        """Yields text deltas until the request ends; raises _Failed on a failure event."""
        event = first
        while True:
            if isinstance(event, RequestFailed):
                raise _Failed(event)
            delta = turn.absorb(event, metrics)
            if turn.finish_reason is not None:
                if event.finish_reason is None:  # a stop string ended it: stop the verify worker too
                    await client.abort(turn.request_id)
                yield delta, event
                return
            yield delta, event
            event = await next_event(request, queue, turn.request_id)
            if event is None:
                raise _Disconnected()

    async def collect(request, queue, turn: Turn, first, chat: bool):
        try:
            async for _ in events_of(request, queue, turn, first):
                pass
        except _Failed as failed:
            finish_turn(turn, "error")
            raise ApiError(503 if failed.event.code == "verify_worker_down" else 500, failed.event.message,
                           kind="server_error", code=failed.event.code) from None
        except _Disconnected:
            client.finish(turn.request_id)
            return Response(status_code=499)
        finish_turn(turn, "success")
        choice = {"index": 0, "finish_reason": turn.finish_reason, "logprobs": None}
        if chat and turn.logprobs is not None:
            choice["logprobs"] = chat_logprobs(turn.logprobs, codec)
        elif turn.params.logprobs is not None:
            offsets = TextOffsets(codec)
            parts = [prompt_logprobs(turn.params.prompt_ids, turn.prompt_logprobs, codec, offsets,
                                     turn.params.prompt_text is not None)] if turn.params.echo else []
            if turn.logprobs is not None:
                parts.append(completion_logprobs(turn.logprobs, codec, offsets))
            choice["logprobs"] = joined(*parts) if parts else None
        if turn.params.return_token_ids:
            choice["token_ids"] = turn.token_ids
        if chat:
            choice["message"] = {"role": "assistant", "content": turn.text}
        else:
            choice["text"] = (echoed_prompt(turn.params) if turn.params.echo else "") + turn.text
        return {
            "id": turn.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": settings.model_name, "choices": [choice], "usage": turn.usage(),
        }

    async def stream(request, queue, turn: Turn, first, chat: bool):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        offsets = TextOffsets(codec)  # the legacy text_offset runs on across chunks

        def chunk(delta: str | None, finish: str | None, role: bool = False, token_ids=None,
                  logprobs: dict | None = None) -> str:
            if chat:
                body = {} if delta is None else {"content": delta}
                if role:
                    body["role"] = "assistant"
                choice = {"index": 0, "delta": body, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
            if turn.params.return_token_ids:
                choice["token_ids"] = token_ids or []
            payload = {"id": turn.request_id, "object": kind, "created": created, "model": settings.model_name,
                       "choices": [choice]}
            if turn.params.include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk("", None, role=True)
            wants_logprobs = turn.params.logprobs is not None
            if turn.params.echo:  # the prompt first, with its log-probabilities when asked for
                scored = event_prompt_logprobs(first, turn.params) if wants_logprobs else None
                yield chunk(echoed_prompt(turn.params), None, logprobs=prompt_logprobs(
                    turn.params.prompt_ids, scored, codec, offsets, turn.params.prompt_text is not None)
                    if wants_logprobs else None)
            async for delta, event in events_of(request, queue, turn, first):
                if delta or (event.token_ids and (turn.params.return_token_ids or wants_logprobs)):
                    run = event_logprobs(event) if wants_logprobs else None
                    logprobs = None if run is None else \
                        chat_logprobs(run, codec) if chat else completion_logprobs(run, codec, offsets)
                    yield chunk(delta, None, token_ids=event.token_ids, logprobs=logprobs)
            yield chunk(None if chat else "", turn.finish_reason)
            if turn.params.include_usage:
                usage = {"id": turn.request_id, "object": kind, "created": created, "model": settings.model_name,
                         "choices": [], "usage": turn.usage()}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
            finish_turn(turn, "success")
        except _Failed as failed:
            finished = True
            finish_turn(turn, "error")
            error = ApiError(503, failed.event.message, kind="server_error", code=failed.event.code).body()
            yield f"data: {json.dumps(error)}\n\n"
            yield "data: [DONE]\n\n"
        except _Disconnected:
            finished = True
            client.finish(turn.request_id)
        finally:
            if not finished:  # the client went away while we were sending
                await client.abort(turn.request_id)
                metrics.requests.labels("aborted").inc()

    return app


class _Failed(Exception):
    def __init__(self, event: RequestFailed):
        super().__init__(event.message)
        self.event = event


class _Disconnected(Exception):
    pass
