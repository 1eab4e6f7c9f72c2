"""The verify worker's loop: between engine steps it takes in every message that arrived (submits, aborts), so
requests join and leave at step boundaries; it streams each step's token events, reports its state to the
heartbeat thread, and fails every request when a tensor-parallel rank is lost. A request with a grammar has its
matcher built in a thread of its own, off the step, and joins once it is built. Rank > 0 runs FollowerServer.

Gateway channel: PULL (submits, aborts) and PUSH (token events, failures, heartbeats), both bound here.
"""

import concurrent.futures
import logging
import os
import threading
import time
import traceback

import zmq

from shared.channel_gateway import (
    TO_VERIFY,
    AbortRequest,
    Heartbeat,
    RequestFailed,
    TokenBatch,
    WorkerStopping,
)
from shared.errors import RequestError
from shared.generation_request import GenerationRequest
from shared.wire import WireError, decode, encode
from verify_worker.engine import SpeculativeEngine
from verify_worker.event_codec import event_totals, token_event
from verify_worker.liveness import HeartbeatThread
from verify_worker.parallel.driver import ParallelFailure, follow
from verify_worker.parallel.group import leave_group
from verify_worker.request import StepEvent
from verify_worker.worker_metrics import VerifyMetrics


class VerifyServer:
    def __init__(self, engine: SpeculativeEngine, requests_addr: str, events_addr: str, metrics: VerifyMetrics,
                 max_waiting: int, log: logging.Logger, heartbeat_s: float = 0.25, keep_alive=None,
                 stall_s: float = 300.0):
        self.engine, self.metrics, self.max_waiting, self.log = engine, metrics, max_waiting, log
        self.keep_alive = keep_alive  # pings the tensor-parallel followers while idle (None at TP 1)
        self.heartbeat_s = heartbeat_s
        context = zmq.Context.instance()
        self.inbox = context.socket(zmq.PULL)
        self.inbox.bind(requests_addr)
        self.outbox = context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.bind(events_addr)
        self.send_lock = threading.Lock()  # the loop and the heartbeat thread share the PUSH socket
        self.heartbeats = HeartbeatThread(self._send, heartbeat_s, stall_s, self._stalled, log)
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.building: dict[str, tuple[GenerationRequest, concurrent.futures.Future]] = {}  # grammars in the pool

    def serve_forever(self) -> None:
        self._report_state()
        self.heartbeats.start()
        try:
            while True:
                busy = self.engine.has_work()  # then this turn waits for nothing: all of it is the step's cost
                started = time.perf_counter()
                self._take_messages(block=not busy)
                self._admit_built()
                stepped = self.engine.has_work()
                if stepped:
                    self._step()
                self._report_state()
                if self.keep_alive is not None:
                    self.keep_alive()
                if busy and stepped:
                    self.engine.observe_loop(time.perf_counter() - started)
        except ParallelFailure as exc:  # a rank is gone: every request fails now, and the worker stops
            self.heartbeats.stop()  # and joined: no heartbeat may follow WorkerStopping
            self.log.error("%s", exc)
            self._fail_all("internal", "the verify worker lost a tensor-parallel rank")
            self._send(WorkerStopping(reason=str(exc)))
            time.sleep(0.2)  # let the PUSH socket flush before the process exits (LINGER is 0)
            raise

    def _stalled(self, seconds: float) -> None:
        """The heartbeat thread found the loop hung: tell the gateway (its requests fail at once) and exit, so
        that a supervisor restarts the service rather than leaving it silent."""
        self._send(WorkerStopping(reason=f"the verify loop made no progress for {seconds:.0f} s"))
        time.sleep(0.2)
        os._exit(3)

    def _fail_all(self, code: str, message: str, waiting_too: bool = True) -> None:
        """Abort and fail every request holding a slot (and, with waiting_too, every queued one)."""
        engine = self.engine
        queued = engine.prefilling + (engine.waiting if waiting_too else [])
        for request_id in list(engine.running) + [s.request_id for s in queued]:
            engine.abort(request_id)
            self._send(RequestFailed(request_id=request_id, code=code, message=message))
        for request_id in list(self.building) if waiting_too else []:
            del self.building[request_id]
            self._send(RequestFailed(request_id=request_id, code=code, message=message))

    def _take_messages(self, block: bool) -> None:
        timeout = (1 if self.building else int(self.heartbeat_s * 1000)) if block else 0
        while self.inbox.poll(timeout):
            timeout = 0
            frames = self.inbox.recv_multipart(copy=False)
            try:
                message = decode(frames, TO_VERIFY)
            except WireError as exc:
                self.metrics.bad.labels("verify").inc()
                self.log.warning("rejected message: %s", exc)
                continue
            if isinstance(message, AbortRequest):
                if self.engine.abort(message.request_id) or self.building.pop(message.request_id, None):
                    self.log.info("aborted %s", message.request_id)
            elif isinstance(message, GenerationRequest):
                self._submit(message)

    def _submit(self, request: GenerationRequest) -> None:
        try:
            if len(self.engine.waiting) + len(self.building) >= self.max_waiting:
                raise _Rejected("queue_full", f"the queue is full ({self.max_waiting} requests waiting)")
            if request.grammar is None:
                self.engine.add(request)
            else:  # checked now; its matcher built off the step, in the pool
                self.engine.validate(request)
                future = self.grammar_pool.submit(self.engine.build_grammar, request.grammar)
                self.building[request.request_id] = (request, future)
        except RequestError as exc:
            self._send(RequestFailed(request_id=request.request_id, code="invalid_request", message=str(exc)))
        except _Rejected as exc:
            self._send(RequestFailed(request_id=request.request_id, code=exc.code, message=exc.message))
        except Exception as exc:  # noqa: BLE001 - a bad request must not stop the loop that serves the others
            self.log.error("cannot admit %s:\n%s", request.request_id, traceback.format_exc())
            self._send(RequestFailed(request_id=request.request_id, code="invalid_request",
                                     message=f"the request cannot be served: {exc}"))

    def _admit_built(self) -> None:
        """Requests whose grammar's matcher is built join the engine's queue (in the order they came)."""
        for request_id, (request, future) in list(self.building.items()):
            if not future.done():
                continue
            del self.building[request_id]
            try:
                self.engine.add(request, grammar=future.result())
            except RequestError as exc:
                self._send(RequestFailed(request_id=request_id, code="invalid_request", message=str(exc)))

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except ParallelFailure:
            raise
        except Exception:  # a bug must not take the other requests' streams down silently
            self.log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_all("internal", "the verify worker failed on this step", waiting_too=False)
            return
        plain: list[StepEvent] = []  # events without log-probabilities: one TokenBatch for the step
        for event in events:
            if event.error is not None:  # this request failed a step on its own; the others went on
                self._send(RequestFailed(request_id=event.request_id, code="internal",
                                         message=f"this request failed in the verify worker ({event.error}); the "
                                         "requests beside it were not affected"))
            elif event.logprobs is None and event.prompt_logprobs is None:
                plain.append(event)
            else:
                self._send(token_event(event))
        if plain:  # straight into the batch's lists (64 events: 23 us, 65 us through a TokenEvent each)
            totals = [event_totals(event.stats) for event in plain]
            verify_steps, draft_tokens, accepted_tokens, cached_tokens = (list(column) for column in zip(*totals))
            self._send(TokenBatch(request_ids=[e.request_id for e in plain], token_ids=[e.new_token_ids for e in plain],
                                  finish_reasons=[e.finish_reason for e in plain], verify_steps=verify_steps,
                                  draft_tokens=draft_tokens, accepted_tokens=accepted_tokens,
                                  cached_tokens=cached_tokens))
        for report in self.engine.last_reports:
            self.metrics.record(report)

    def _report_state(self) -> None:
        """Once per loop: drafter upkeep (pings while it is unavailable, never waiting), gauges, and the state
        the heartbeat thread reports."""
        proposer = self.engine.proposer
        if proposer is not None and hasattr(proposer, "tick"):
            proposer.tick()  # notice a (re)started drafter even while idle
        available = proposer is not None and proposer.available
        kind = proposer.kind if proposer is not None else "none"
        self.metrics.drafter.labels(kind).set(1 if available else 0)
        self.metrics.running.set(self.engine.num_running)
        engine = self.engine
        self.metrics.record_prefixes(engine.prefix_query_tokens, engine.prefix_hit_tokens, engine.kept_prefix_tokens)
        pages = engine.pages
        self.metrics.record_pool(0 if pages is None else pages.cache.num_pages, 0 if pages is None else pages.used,
                                 engine.preemptions)
        waiting = len(self.engine.waiting) + len(self.building)
        self.metrics.waiting.set(waiting)
        self.heartbeats.progress(Heartbeat(running=self.engine.num_running, waiting=waiting,
                                           drafter_kind=kind, drafter_available=available))

    def _send(self, message) -> None:
        frames = encode(message)
        try:
            with self.send_lock:
                self.outbox.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # no gateway connected yet (heartbeats before it starts)
            if not isinstance(message, Heartbeat):
                self.log.warning("gateway not connected: dropped %s", message.TYPE)


class _Rejected(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class FollowerServer:
    """A tensor-parallel rank > 0: no sockets, it runs what rank 0 announces until STOP or a failure."""

    def __init__(self, target, log: logging.Logger):
        self.target, self.log = target, log

    def serve_forever(self) -> None:
        try:
            follow(self.target)
        except ParallelFailure:
            leave_group(self.target.tp, orderly=False)
            raise
        leave_group(self.target.tp)
