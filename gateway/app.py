"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics."""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.body_limit import body_bytes
from gateway.logprobs import TextOffsets, chat_logprobs, completion_logprobs, joined, prompt_logprobs
from gateway.metrics import GatewayMetrics
from gateway.request_bounds import RequestBounds
from gateway.request_fields import CHAT, COMPLETIONS, body_schema, unknown_fields
from gateway.schemas import ApiError, GenerationParams, Prompt, choice_seed, parse_chat, parse_completion, parse_json
from gateway.tokenization import RenderedTooLong, StopMatcher, TextCodec
from gateway.turn import Turn, event_logprobs, usage
from gateway.verify_client import UnencodableRequest, VerifyClient
from shared.channel_gateway import RequestFailed, SubmitRequest
from shared.errors import RequestError
from shared.sampling_params import SamplingParams

FAILURE_STATUS = {"invalid_request": 400, "queue_full": 429, "verify_worker_down": 503}
# SubmitRequest fields named differently in the request (None: set by the server, not by the client)
SUBMIT_FIELD_PARAMS = {"prompt_ids": "prompt", "prompt_logprobs": "echo", "request_id": None}
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


@dataclass
class Probe:
    last_ok: float = 0.0
    drafted: bool = False
    detail: str = "no probe has run yet"


async def next_within(queue: asyncio.Queue, seconds: float):
    """queue's next item, or asyncio.TimeoutError after `seconds` without one. A queued item is taken without
    suspending; otherwise one timer guards the wait (asyncio.wait_for wraps each wait in a task of its own
    before Python 3.12: a task and two more turns of the loop per token event)."""
    if not queue.empty():
        return queue.get_nowait()
    if not hasattr(asyncio, "timeout"):  # Python 3.10
        return await asyncio.wait_for(queue.get(), seconds)
    async with asyncio.timeout(seconds):
        return await queue.get()


def create_app(settings: GatewaySettings, codec: TextCodec, log: logging.Logger | None = None) -> FastAPI:
    log = log or logging.getLogger("dflash.gateway")
    metrics = GatewayMetrics()
    client = VerifyClient(settings.requests_addr, settings.events_addr, settings.dead_after_s, log,
                          on_bad_message=lambda: metrics.bad.labels("gateway").inc())
    probe = Probe()
    bounds = RequestBounds(settings.max_body_bytes or body_bytes(None, settings.max_model_len),
                           settings.max_model_len, codec.longest_token_bytes, settings.max_pending)
    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None)
    app.state.client, app.state.metrics, app.state.probe, app.state.bounds = client, metrics, probe, bounds

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
            message = SubmitRequest(request_id=request_id, prompt_ids=[0], max_tokens=3,
                                    sampling=SamplingParams(seed=0), stop_token_ids=[], num_speculative_tokens=1)
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

    @app.post("/v1/completions", openapi_extra=documented_body(COMPLETIONS))
    async def completions(request: Request):
        authorize(request)
        params = parse_completion(await read_json(request, COMPLETIONS), settings.model_name, settings.vocab_size,
                                  bounds.max_choices)
        bounds.check_params(params, codec.normalized_chars)
        for prompt in params.prompts:
            if prompt.text is not None:
                prompt.ids = codec.encode(prompt.text)
        return await generate(request, params, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=documented_body(CHAT))
    async def chat_completions(request: Request):
        authorize(request)
        params = parse_chat(await read_json(request, CHAT), settings.model_name, settings.vocab_size,
                            bounds.context_tokens)
        bounds.check_params(params, codec.normalized_chars)
        try:
            text = codec.render_chat(params.messages, bounds.text_chars)
        except RenderedTooLong:
            raise ApiError(400, f"the conversation through the chat template passes {bounds.text_chars} characters, "
                           f"more than this model's context of {settings.max_model_len} tokens can hold",
                           param="messages", code="context_length_exceeded") from None
        except Exception as exc:  # jinja raises many types on a template the messages do not fit
            raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", param="messages")
        bounds.check_text(text, codec.normalized_chars, "messages", "the conversation through the chat template")
        params.prompts = [Prompt(None, codec.encode(text))]
        return await generate(request, params, chat=True)

    def max_tokens_for(params: GenerationParams, prompt: Prompt) -> int:
        """The prompt's checks against the vocabulary and the context; returns its max_tokens."""
        prompt_len = len(prompt.ids)
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        bad = next((t for t in prompt.ids if not 0 <= t < settings.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (size {settings.vocab_size})",
                           param="prompt")
        room = settings.max_model_len - prompt_len
        if room < (0 if params.max_tokens == 0 else 1):  # scoring a prompt (echo, max_tokens 0) needs no room
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{settings.max_model_len} tokens", param="prompt", code="context_length_exceeded")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ApiError(400, f"max_tokens ({params.max_tokens}) plus the prompt ({prompt_len} tokens) exceeds "
                           f"this model's context of {settings.max_model_len} tokens", param="max_tokens",
                           code="context_length_exceeded")
        limit = min(settings.default_max_tokens, room) if params.max_tokens is None else params.max_tokens
        if params.min_tokens > limit:
            raise ApiError(400, f"min_tokens ({params.min_tokens}) exceeds max_tokens ({limit}"
                           f"{', the default within the context' if params.max_tokens is None else ''})",
                           param="min_tokens")
        return limit

    async def generate(request: Request, params: GenerationParams, chat: bool):
        """Submit one verify-worker request per choice (n per prompt), all answering on one queue; fail the
        whole request with an HTTP error if any choice is refused before it starts."""
        limits = [max_tokens_for(params, prompt) for prompt in params.prompts]
        count = len(params.prompts) * params.n  # at most max_pending: RequestBounds.check_params
        if not client.alive:
            raise ApiError(503, "the verify worker is not available", kind="server_error", code="service_unavailable",
                           headers={"Retry-After": "5"})
        user_requests = [r for r in client.queues if not r.startswith("probe-")]
        if len(user_requests) + count > settings.max_pending:
            metrics.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at capacity ({settings.max_pending} requests in flight); retry "
                           "shortly", kind="rate_limit_error", code="server_busy", headers={"Retry-After": "1"})
        base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        messages = submit_messages(params, limits, base, count)
        queue: asyncio.Queue = asyncio.Queue()
        turns: dict[str, Turn] = {}
        for message in messages:
            request_id, index = message.request_id, len(turns)
            turns[request_id] = Turn(request_id, index, params.prompts[index // params.n], params,
                                     codec.detokenizer(), StopMatcher(params.stop), time.monotonic())
            try:
                await client.submit(message, queue)
            except BaseException as exc:  # the choices already sent must not run on with nobody reading them
                turns.pop(request_id)
                await release(turns)
                if isinstance(exc, ConnectionError):
                    raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
                if isinstance(exc, UnencodableRequest):
                    raise ApiError(400, str(exc), param=SUBMIT_FIELD_PARAMS.get(exc.field, exc.field)) from None
                raise
        metrics.prompt_tokens.inc(sum(len(prompt.ids) for prompt in params.prompts))
        early = await first_events(request, queue, turns)
        if early is None or isinstance(early, RequestFailed):
            await release(turns)
        if early is None:
            return Response(status_code=499)
        if isinstance(early, RequestFailed):
            failed = early
            metrics.requests.labels("rejected" if failed.code == "queue_full" else "error").inc()
            status = FAILURE_STATUS.get(failed.code, 500)
            kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
            raise ApiError(status, failed.message, code=failed.code, kind=kind,
                           headers={"Retry-After": "1"} if status in (429, 503) else None)
        if params.stream:
            return StreamingResponse(stream(request, queue, turns, early, chat, base), media_type="text/event-stream")
        return await collect(request, queue, turns, early, chat, base)

    def submit_messages(params: GenerationParams, limits: list[int], base: str, count: int) -> list[SubmitRequest]:
        """One verify-worker request per choice, in choice order (index = prompt index * n + j)."""
        stop_ids = list(dict.fromkeys(([] if params.ignore_eos else list(codec.eos_token_ids)) +
                                      params.stop_token_ids))
        messages = []
        for prompt_index, (prompt, limit) in enumerate(zip(params.prompts, limits)):
            for j in range(params.n):
                index = prompt_index * params.n + j
                try:
                    sampling = SamplingParams(params.temperature, params.top_p, params.top_k,
                                              choice_seed(params.seed, index, count))
                except RequestError as exc:
                    raise ApiError(400, str(exc)) from None
                messages.append(SubmitRequest(
                    request_id=base if count == 1 else f"{base}-{index}", prompt_ids=prompt.ids, max_tokens=limit,
                    sampling=sampling, stop_token_ids=stop_ids, min_tokens=params.min_tokens,
                    num_speculative_tokens=params.num_speculative_tokens, logprobs=params.logprobs,
                    prompt_logprobs=params.echo and params.logprobs is not None))
        return messages

    def echoed_prompt(prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return codec.tokenizer.decode(prompt.ids, skip_special_tokens=True)

    async def abort_unfinished(turns: dict[str, Turn]) -> None:
        for turn in turns.values():
            if turn.finish_reason is None:
                await client.abort(turn.request_id)

    async def release(turns: dict[str, Turn]) -> None:
        """Abort the choices still running and stop listening for every choice's events."""
        await abort_unfinished(turns)
        for turn in turns.values():
            client.finish(turn.request_id)

    async def next_event(request: Request, queue: asyncio.Queue):
        """The next event of a request's choices, or None when the client went away (the caller releases them)."""
        while True:
            try:
                return await next_within(queue, 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    metrics.requests.labels("aborted").inc()
                    return None

    async def first_events(request: Request, queue: asyncio.Queue, turns: dict[str, Turn]):
        """Take events as they arrive (a stop string acts at once) until every choice has been heard from, so
        that a refusal is still an HTTP error. Returns the (turn, delta, event) items to replay, the
        RequestFailed that refused a choice, or None if the client went away. A request with more choices than
        the worker runs at once is answered once its last choice has started."""
        early, heard = [], set()
        while len(heard) < len(turns):
            event = await next_event(request, queue)
            if event is None or isinstance(event, RequestFailed):
                return event
            heard.add(event.request_id)
            item = await take(turns, event)
            if item is not None:
                early.append(item)
        return early

    async def take(turns: dict[str, Turn], event):
        """Absorb a token event into its choice: (turn, text delta, event), or None for a choice already ended."""
        turn = turns.get(event.request_id)
        if turn is None or turn.finish_reason is not None:
            return None  # a stop string ended this choice already; its late events are dropped
        delta = turn.absorb(event, metrics)
        if turn.finish_reason is not None and event.finish_reason is None:
            await client.abort(turn.request_id)  # a stop string ended it: stop the verify worker too
        return turn, delta, event

    def finish_request(turns: dict[str, Turn], outcome: str) -> None:
        """Counted once per request (its generated tokens: every choice's)."""
        for turn in turns.values():
            client.finish(turn.request_id)
            metrics.generation_tokens.inc(len(turn.token_ids))
        metrics.requests.labels(outcome).inc()
        metrics.e2e.observe(time.monotonic() - min(turn.started for turn in turns.values()))

    async def events_of(request, queue, turns: dict[str, Turn], early: list):
        """Yields the early items, then (turn, text delta, event) until every choice has ended; raises _Failed
        on a failure event and _Disconnected when the client went away."""
        for item in early:
            yield item
        while any(turn.finish_reason is None for turn in turns.values()):
            event = await next_event(request, queue)
            if event is None:
                raise _Disconnected()
            if isinstance(event, RequestFailed):
                raise _Failed(event)
            item = await take(turns, event)
            if item is not None:
                yield item

    def choice_of(turn: Turn, chat: bool) -> dict:
        choice = {"index": turn.index, "finish_reason": turn.finish_reason, "logprobs": None}
        if chat and turn.logprobs is not None:
            choice["logprobs"] = chat_logprobs(turn.logprobs, codec)
        elif turn.params.logprobs is not None and not chat:
            offsets = TextOffsets(codec)
            parts = [prompt_logprobs(turn.prompt.ids, turn.prompt_logprobs, codec, offsets,
                                     turn.prompt.text is not None)] if turn.params.echo else []
            if turn.logprobs is not None:
                parts.append(completion_logprobs(turn.logprobs, codec, offsets))
            choice["logprobs"] = joined(*parts) if parts else None
        if turn.params.return_token_ids:
            choice["token_ids"] = turn.token_ids
        if chat:
            choice["message"] = {"role": "assistant", "content": turn.text}
        else:
            choice["text"] = (echoed_prompt(turn.prompt) if turn.params.echo else "") + turn.text
        return choice

    async def collect(request, queue, turns: dict[str, Turn], early: list, chat: bool, response_id: str):
        try:
            async for _ in events_of(request, queue, turns, early):
                pass
        except _Failed as failed:
            await abort_unfinished(turns)
            finish_request(turns, "error")
            raise ApiError(503 if failed.event.code == "verify_worker_down" else 500, failed.event.message,
                           kind="server_error", code=failed.event.code) from None
        except _Disconnected:
            await release(turns)
            return Response(status_code=499)
        ordered = sorted(turns.values(), key=lambda t: t.index)
        finish_request(turns, "success")
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": settings.model_name, "choices": [choice_of(t, chat) for t in ordered],
            "usage": usage(ordered),
        }

    async def stream(request, queue, turns: dict[str, Turn], early: list, chat: bool, response_id: str):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        ordered = sorted(turns.values(), key=lambda t: t.index)
        offsets = {turn.request_id: TextOffsets(codec) for turn in ordered}  # legacy text_offset, per choice
        params = ordered[0].params

        def chunk(turn: Turn, delta: str | None, finish: str | None, role: bool = False, token_ids=None,
                  logprobs: dict | None = None) -> str:
            if chat:
                body = {} if delta is None else {"content": delta}
                if role:
                    body["role"] = "assistant"
                choice = {"index": turn.index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": turn.index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
            if params.return_token_ids:
                choice["token_ids"] = token_ids or []
            payload = {"id": response_id, "object": kind, "created": created, "model": settings.model_name,
                       "choices": [choice]}
            if params.include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        finished = False
        try:
            wants_logprobs = params.logprobs is not None
            for turn in ordered:  # every choice was heard from: its prompt's log-probabilities are in
                if chat:
                    yield chunk(turn, "", None, role=True)
                elif params.echo:  # the prompt first, with its log-probabilities when asked for
                    yield chunk(turn, echoed_prompt(turn.prompt), None, logprobs=prompt_logprobs(
                        turn.prompt.ids, turn.prompt_logprobs, codec, offsets[turn.request_id],
                        turn.prompt.text is not None) if wants_logprobs else None)
            async for turn, delta, event in events_of(request, queue, turns, early):
                if delta or (event.token_ids and (params.return_token_ids or wants_logprobs)):
                    run = event_logprobs(event) if wants_logprobs else None
                    logprobs = None if run is None else chat_logprobs(run, codec) if chat else \
                        completion_logprobs(run, codec, offsets[turn.request_id])
                    yield chunk(turn, delta, None, token_ids=event.token_ids, logprobs=logprobs)
                if turn.finish_reason is not None:
                    yield chunk(turn, None if chat else "", turn.finish_reason)
            if params.include_usage:
                body = {"id": response_id, "object": kind, "created": created, "model": settings.model_name,
                        "choices": [], "usage": usage(ordered)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
            finish_request(turns, "success")
        except _Failed as failed:
            finished = True
            await abort_unfinished(turns)
            finish_request(turns, "error")
            error = ApiError(503, failed.event.message, kind="server_error", code=failed.event.code).body()
            yield f"data: {json.dumps(error)}\n\n"
            yield "data: [DONE]\n\n"
        except _Disconnected:
            finished = True
            await release(turns)
        except Exception:  # a bug here must end this stream with an error event, not a reset connection
            finished = True
            log.exception("stream %s failed", response_id)
            await release(turns)
            finish_request(turns, "error")
            error = ApiError(500, "internal server error", kind="server_error", code="internal").body()
            yield f"data: {json.dumps(error)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away while we were sending
                await release(turns)
                metrics.requests.labels("aborted").inc()

    return app


class _Failed(Exception):
    def __init__(self, event: RequestFailed):
        super().__init__(event.message)
        self.event = event


class _Disconnected(Exception):
    pass
