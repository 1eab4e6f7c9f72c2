"""The gateway's side of the gateway <-> verify channel (ZeroMQ sockets read from the asyncio loop).

Events are routed to one asyncio.Queue per request. The verify worker sends heartbeats; when none arrives
for dead_after_s, or its connection closes (a socket monitor sees that at once), it is considered dead: every
open request gets a failure and new requests are refused.

The sockets are plain (blocking-mode) ZeroMQ sockets used without blocking: the loop watches their file
descriptors once for good (add_reader) and each wake-up drains every queued message. zmq.asyncio's poller
instead armed a future, a timer and its watchers per poll and woke the loop several times per event: about 26
system calls and 240 us of the gateway's CPU per token event at concurrency 1, where the verify worker's step
is 1 ms on the same two cores.
"""

import asyncio
import dataclasses
import logging
import time

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from shared.channel_gateway import (
    TO_GATEWAY,
    AbortRequest,
    Heartbeat,
    RequestFailed,
    TokenBatch,
    TokenEvent,
    WorkerStopping,
)
from shared.generation_request import GenerationRequest
from shared.wire import WireError, decode, encode


class UnencodableRequest(ValueError):
    """A request msgpack cannot encode (an integer beyond 64 bits, a value of no wire type); field names the
    first GenerationRequest field at fault, or is None."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


def _packable(value) -> bool:
    try:
        msgpack.packb(value)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _fields(record) -> list[tuple[str, object]]:
    """(name, value) of a record's fields; a nested record's (the sampling parameters) by their own names."""
    out = []
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        out += _fields(value) if dataclasses.is_dataclass(value) else [(field.name, value)]
    return out


def encode_submit(message: GenerationRequest) -> list:
    """The frames of a submit request; raises UnencodableRequest naming the field msgpack refuses."""
    try:
        return encode(message)
    except (OverflowError, ValueError, TypeError) as exc:
        field = next((name for name, value in _fields(message) if not _packable(value)), None)
        raise UnencodableRequest(f"the request cannot be sent to the verify worker: "
                                 f"{f'{field!r}: ' if field else ''}{exc}", field) from None


class VerifyClient:
    TICK_S = 0.25  # the liveness check's period while no event arrives (and a drain, should an edge be missed)

    def __init__(self, requests_addr: str, events_addr: str, dead_after_s: float = 2.0,
                 log: logging.Logger | None = None, on_bad_message=None):
        self.context = zmq.Context()
        self.sender = self.context.socket(zmq.PUSH)
        self.sender.setsockopt(zmq.LINGER, 0)
        self.sender.setsockopt(zmq.IMMEDIATE, 1)
        self.sender.connect(requests_addr)
        self.receiver = self.context.socket(zmq.PULL)
        self.monitor = self.receiver.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # a dead worker's socket closes
        self.receiver.connect(events_addr)
        self.dead_after_s = dead_after_s
        self.log = log or logging.getLogger("dflash.gateway")
        self.on_bad_message = on_bad_message or (lambda: None)
        self.queues: dict[str, asyncio.Queue] = {}
        self.last_heartbeat: Heartbeat | None = None
        self.last_seen = 0.0
        self.was_alive = False
        self.why = f"silent for {dead_after_s:.1f} s"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None

    @property
    def alive(self) -> bool:
        return self.last_seen > 0 and time.monotonic() - self.last_seen < self.dead_after_s

    def start(self) -> None:
        """Watch the sockets from the running loop (ZeroMQ signals a descriptor when its socket's state may
        have changed, not per message: every wake-up drains, and the periodic tick drains too)."""
        self.loop = asyncio.get_running_loop()
        for socket in (self.receiver, self.monitor):
            self.loop.add_reader(socket.FD, self._drain)
        self._tick()

    async def close(self) -> None:
        if self.loop is not None:
            for socket in (self.receiver, self.monitor):
                self.loop.remove_reader(socket.FD)
        if self.timer is not None:
            self.timer.cancel()
        self.sender.close(0)
        self.receiver.disable_monitor()
        self.monitor.close(0)
        self.receiver.close(0)
        self.context.term()

    async def submit(self, message: GenerationRequest, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Send a request; its events arrive on the returned queue (several requests may share one)."""
        queue = queue if queue is not None else asyncio.Queue()
        frames = encode_submit(message)  # before the queue is registered: an unencodable request leaves nothing
        self.queues[message.request_id] = queue
        try:
            self.sender.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.queues.pop(message.request_id, None)
            raise ConnectionError("the verify worker is not connected") from None
        return queue

    async def abort(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        try:
            self.sender.send_multipart(encode(AbortRequest(request_id=request_id)), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def finish(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def _tick(self) -> None:
        self._drain()
        self.timer = self.loop.call_later(self.TICK_S, self._tick)

    def _drain(self) -> None:
        """Every event that has arrived, then the monitor's notices (a closed connection is acted on after the
        events its worker sent before it), then the liveness check."""
        self._take_queued()
        while True:
            try:
                notice = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(notice)
            if event["event"] == zmq.EVENT_DISCONNECTED and self.last_seen:
                self.log.error("the verify worker closed its connection")
                self.last_seen, self.why = 0.0, "gone (connection closed)"
        self._check_alive()

    def _check_alive(self) -> None:
        alive = self.alive
        if self.was_alive and not alive:
            self.log.error("verify worker %s: failing %d open requests", self.why, len(self.queues))
            for request_id, queue in list(self.queues.items()):
                queue.put_nowait(RequestFailed(request_id=request_id, code="verify_worker_down",
                                               message="the verify worker stopped responding"))
            self.queues.clear()
        if alive:
            self.why = f"silent for {self.dead_after_s:.1f} s"
        self.was_alive = alive

    def _take_queued(self) -> None:
        """Every event that has arrived, without waiting for more."""
        while True:
            try:
                frames = self.receiver.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._take(frames)

    def _take(self, frames) -> None:
        try:
            message = decode(frames, TO_GATEWAY)
        except WireError as exc:
            self.on_bad_message()
            self.log.warning("rejected message: %s", exc)
            return
        self.last_seen = time.monotonic()
        if isinstance(message, Heartbeat):
            self.last_heartbeat = message
        elif isinstance(message, WorkerStopping):
            self.log.error("the verify worker is stopping: %s", message.reason)
            self.last_seen = 0.0  # down now, not after the heartbeat timeout
        elif isinstance(message, (TokenEvent, RequestFailed)):
            self._route(message)
        elif isinstance(message, TokenBatch):
            for event in message.events():
                self._route(event)

    def _route(self, message: TokenEvent | RequestFailed) -> None:
        queue = self.queues.get(message.request_id)
        if queue is not None:
            queue.put_nowait(message)
