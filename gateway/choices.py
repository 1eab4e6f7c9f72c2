"""The choices of one HTTP request (n per prompt), each a verify-worker request answering on one shared queue:
submitting them, taking their events in arrival order, and letting them go (abort what still runs, stop
listening, count the request once)."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from gateway.metrics import GatewayMetrics
from gateway.schemas import ApiError, GenerationParams
from gateway.tokenization import StopMatcher, TextCodec
from gateway.turn import Turn
from gateway.verify_client import UnencodableRequest, VerifyClient
from shared.channel_gateway import RequestFailed
from shared.generation_request import GenerationRequest

# GenerationRequest fields named differently in the request (None: set by the server, not by the client)
SUBMIT_FIELD_PARAMS = {"prompt_ids": "prompt", "prompt_logprobs": "echo", "request_id": None}


class Failed(Exception):
    """A choice failed after the response began."""

    def __init__(self, event: RequestFailed):
        super().__init__(event.message)
        self.event = event


class Disconnected(Exception):
    """The client went away."""


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


class ChoiceSet:
    """One HTTP request's choices: their turns (text, stops, log-probabilities) by request id, in choice order."""

    def __init__(self, request: Request, params: GenerationParams, client: VerifyClient, metrics: GatewayMetrics):
        self.request, self.params, self.client, self.metrics = request, params, client, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.turns: dict[str, Turn] = {}

    @property
    def ordered(self) -> list[Turn]:
        return sorted(self.turns.values(), key=lambda t: t.index)

    async def submit(self, messages: list[GenerationRequest], codec: TextCodec) -> None:
        """Send every choice; if one cannot be sent, those already sent are released and the request fails with
        the HTTP error that says why (503: the worker is gone; 400: a value the wire cannot carry)."""
        params = self.params
        for message in messages:
            request_id, index = message.request_id, len(self.turns)
            self.turns[request_id] = Turn(request_id, index, params.prompts[index // params.n], params,
                                          codec.detokenizer(), StopMatcher(params.stop), time.monotonic())
            try:
                await self.client.submit(message, self.queue)
            except BaseException as exc:  # the choices already sent must not run on with nobody reading them
                self.turns.pop(request_id)
                await self.release()
                if isinstance(exc, ConnectionError):
                    raise ApiError(503, str(exc), kind="server_error", code="service_unavailable") from None
                if isinstance(exc, UnencodableRequest):
                    raise ApiError(400, str(exc), param=SUBMIT_FIELD_PARAMS.get(exc.field, exc.field)) from None
                raise

    async def abort_unfinished(self) -> None:
        for turn in self.turns.values():
            if turn.finish_reason is None:
                await self.client.abort(turn.request_id)

    async def release(self) -> None:
        """Abort the choices still running and stop listening for every choice's events."""
        await self.abort_unfinished()
        for turn in self.turns.values():
            self.client.finish(turn.request_id)

    async def next_event(self):
        """The next event of the choices, or None when the client went away (the caller releases them)."""
        while True:
            try:
                return await next_within(self.queue, 0.5)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.metrics.requests.labels("aborted").inc()
                    return None

    async def first_events(self):
        """Take events as they arrive (a stop string acts at once) until every choice has been heard from, so
        that a refusal is still an HTTP error. Returns the (turn, delta, event) items to replay, the
        RequestFailed that refused a choice, or None if the client went away. A request with more choices than
        the worker runs at once is answered once its last choice has started."""
        early, heard = [], set()
        while len(heard) < len(self.turns):
            event = await self.next_event()
            if event is None or isinstance(event, RequestFailed):
                return event
            heard.add(event.request_id)
            item = await self.take(event)
            if item is not None:
                early.append(item)
        return early

    async def take(self, event):
        """Absorb a token event into its choice: (turn, text delta, event, whether the choice ended with it), or None
        for a choice already ended (replayed items carry the flag: their turn may have ended since)."""
        turn = self.turns.get(event.request_id)
        if turn is None or turn.finish_reason is not None:
            return None  # a stop string ended this choice already; its late events are dropped
        delta = turn.absorb(event, self.metrics)
        if turn.finish_reason is not None and event.finish_reason is None:
            await self.client.abort(turn.request_id)  # a stop string ended it: stop the verify worker too
        return turn, delta, event, turn.finish_reason is not None

    async def events(self, early: list):
        """Yields the early items, then (turn, text delta, event, ended) until every choice has ended; raises Failed on
        a failure event and Disconnected when the client went away."""
        for item in early:
            yield item
        while any(turn.finish_reason is None for turn in self.turns.values()):
            event = await self.next_event()
            if event is None:
                raise Disconnected()
            if isinstance(event, RequestFailed):
                raise Failed(event)
            item = await self.take(event)
            if item is not None:
                yield item

    def finish(self, outcome: str) -> None:
        """Counted once per request (its generated tokens: every choice's)."""
        for turn in self.turns.values():
            self.client.finish(turn.request_id)
            self.metrics.generation_tokens.inc(len(turn.token_ids))
        self.metrics.requests.labels(outcome).inc()
        self.metrics.e2e.observe(time.monotonic() - min(turn.started for turn in self.turns.values()))

    async def guarded(self, lines: AsyncIterator[str], error_lines: Callable[[int, str, str], list[str]],
                      log: logging.Logger, name: str) -> AsyncIterator[str]:
        """A response stream's lines, its choices finished after the last; a failed choice ends it with
        error_lines(status, message, code) (503), a bug with a 500's, never a reset connection; a client that
        went away releases the choices."""
        finished = False
        try:
            async for line in lines:
                yield line
            finished = True
            self.finish("success")
        except Failed as failed:
            finished = True
            await self.abort_unfinished()
            self.finish("error")
            for line in error_lines(503, failed.event.message, failed.event.code):
                yield line
        except Disconnected:
            finished = True
            await self.release()
        except Exception:  # a bug here must end this stream with an error event, not a reset connection
            finished = True
            log.exception("stream %s failed", name)
            await self.release()
            self.finish("error")
            for line in error_lines(500, "internal server error", "internal"):
                yield line
        finally:
            if not finished:  # the client went away while we were sending
                await self.release()
                self.metrics.requests.labels("aborted").inc()
