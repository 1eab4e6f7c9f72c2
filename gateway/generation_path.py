"""The one path of a generation request, whichever API it came in by (OpenAI's completions and chat,
Anthropic's messages): its body read under its bounds, its prompt rendered and tokenized, its grammar compiled,
one checked GenerationRequest per choice submitted (submission.py, choices.py), and its answer written
(responses.py)."""

import logging
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway.chat_grammar import CLOSE as CLOSE_THINKING, chat_grammar
from gateway.choices import ChoiceSet
from gateway.metrics import GatewayMetrics
from gateway.reasoning import opens_thinking, reasoning_parser_on
from gateway.request_bounds import RequestBounds
from gateway.request_fields import unknown_fields
from gateway.responses import Responses
from gateway.schemas import ApiError, GenerationParams, Prompt, parse_chat, parse_completion, parse_json
from gateway.structured_outputs import GrammarCompiler, constraint_of
from gateway.submission import ModelLimits, generation_requests
from gateway.tokenization import RenderedTooLong, TextCodec
from gateway.tool_calls import call_format
from gateway.verify_client import VerifyClient
from shared.channel_gateway import RequestFailed

FAILURE_STATUS = {"invalid_request": 400, "queue_full": 429, "verify_worker_down": 503}
UNKNOWN_FIELDS_LOGGED = 256  # distinct names logged at most (a client could send endless new ones)


def refusal(failed: RequestFailed) -> ApiError:
    """The HTTP error of a choice the verify worker refused before it started."""
    status = FAILURE_STATUS.get(failed.code, 500)
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, failed.message, code=failed.code, kind=kind,
                    headers={"Retry-After": "1"} if status in (429, 503) else None)


class GenerationPath:
    """The served model's request path: settings is the app's GatewaySettings."""

    def __init__(self, settings, codec: TextCodec, client: VerifyClient, metrics: GatewayMetrics,
                 bounds: RequestBounds, log: logging.Logger):
        self.settings, self.codec, self.client, self.metrics, self.bounds, self.log = \
            settings, codec, client, metrics, bounds, log
        self.limits = ModelLimits(settings.vocab_size, settings.max_model_len, settings.default_max_tokens)
        self.call_format = call_format(settings.tool_call_parser, codec.chat_template)  # None: tools are refused
        self.splits_reasoning = reasoning_parser_on(settings.reasoning_parser, codec.chat_template)
        self.tags = codec.added_token_texts  # tags a grammar names as tokens
        self.responses = Responses(codec, settings.model_name, log, self.call_format)
        self.grammars = GrammarCompiler(codec.tokenizer, settings.vocab_size, codec.eos_token_ids)
        self.unknown_logged: set[str] = set()

    async def read_json(self, request: Request, endpoint: str) -> dict:
        """The body, read under its cap and parsed; fields no endpoint field has are logged once per name (they
        are ignored, as in vLLM: a harness that sends a field this server lacks learns it from the log)."""
        body = parse_json(await self.bounds.read_body(request))
        logged = self.unknown_logged
        for name in unknown_fields(body, endpoint):
            if name not in logged and len(logged) < UNKNOWN_FIELDS_LOGGED:
                logged.add(name)
                self.log.warning("request field %.60r is not supported and is ignored (logged once)%s", name,
                                 "; further unknown fields are not logged" if len(logged) == UNKNOWN_FIELDS_LOGGED
                                 else "")
        return body

    def needs_text(self, what: str, param: str) -> None:
        if not self.codec.has_tokenizer:
            raise ApiError(400, f"{what} needs a tokenizer, and this server has none (the target folder has no "
                           "tokenizer.json): send the prompt as token ids, without stop strings", param=param)

    async def prepare_completion(self, body: dict) -> GenerationParams:
        """A completions body's parameters, its prompts tokenized, its grammar compiled (off the event loop)."""
        settings, codec, bounds = self.settings, self.codec, self.bounds
        params = parse_completion(body, settings.model_name, settings.vocab_size, bounds.max_choices)
        constraint = constraint_of(body)
        if constraint is not None:
            params.grammar = await self.grammars.grammar(constraint)
        if any(prompt.text is not None for prompt in params.prompts):
            self.needs_text("a text prompt", "prompt")
        if params.stop:
            self.needs_text("a stop string", "stop")
        bounds.check_params(params, codec.normalized_chars)
        for prompt in params.prompts:
            if prompt.text is not None:
                prompt.ids = codec.encode(prompt.text)
        return params

    async def prepare_chat(self, body: dict) -> GenerationParams:
        """A chat body's parameters, its prompt rendered and tokenized, its grammar compiled."""
        settings, codec, bounds = self.settings, self.codec, self.bounds
        params = parse_chat(body, settings.model_name, settings.vocab_size, bounds.context_tokens)
        if params.tools is not None and self.call_format is None:
            raise ApiError(400, "tool calling is off on this server (--tool-call-parser none)", param="tools")
        self.needs_text("a chat completion (its messages go through the chat template)", "messages")
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
        params.thinking = opens_thinking(text) if self.splits_reasoning else None
        constraint = chat_grammar(params, constraint_of(body), self.call_format, self.tags)
        if constraint is not None:
            params.grammar = await self.grammars.grammar(constraint)
        if params.thinking and params.thinking_budget is not None:  # chat_grammar checked </think> is a token
            params.thinking_end = [params.thinking_budget, codec.tokenizer.token_to_id(CLOSE_THINKING)]
        params.prompts = [Prompt(None, codec.encode(text))]
        return params

    async def generate(self, request: Request, params: GenerationParams, chat: bool):
        """The answer of a request in OpenAI's shapes (start: its choices)."""
        started = await self.start(request, params, "chatcmpl-" if chat else "cmpl-")
        if isinstance(started, Response):
            return started
        choices, early, base = started
        if params.stream:
            return StreamingResponse(self.responses.stream(choices, early, chat, base),
                                     media_type="text/event-stream")
        return await self.responses.collect(choices, early, chat, base)

    async def start(self, request: Request, params: GenerationParams, id_prefix: str):
        """Submit one verify-worker request per choice (n per prompt), all answering on one queue: (the choices,
        their first events, the response id), or a 499 for a client gone; an HTTP error if any choice is refused
        before it starts."""
        client, metrics, max_pending = self.client, self.metrics, self.settings.max_pending
        base = id_prefix + uuid.uuid4().hex
        requests = generation_requests(params, self.limits, base, self.codec.eos_token_ids)
        count = len(requests)  # at most max_pending: RequestBounds.check_params
        if not client.alive:
            raise ApiError(503, "the verify worker is not available", kind="server_error", code="service_unavailable",
                           headers={"Retry-After": "5"})
        user_requests = [r for r in client.queues if not r.startswith("probe-")]
        if len(user_requests) + count > max_pending:
            metrics.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at capacity ({max_pending} requests in flight); retry "
                           "shortly", kind="rate_limit_error", code="server_busy", headers={"Retry-After": "1"})
        choices = ChoiceSet(request, params, client, metrics)
        await choices.submit(requests, self.codec)
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
