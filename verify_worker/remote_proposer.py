"""The Proposer that talks to a draft worker process over ZeroMQ (DEALER -> the worker's ROUTER).

A drafter fault costs speed, never a request, and is noticed fast:
- a drafter that dies closes its connection: a monitor on the socket sees the disconnect while a call waits,
  and the call gives up at once (milliseconds, not a timeout);
- a drafter that hangs (stopped, stuck) misses its deadline, a multiple of its recent latency scaled by the
  call's context rows (`DraftDeadline`), not a fixed number of seconds.
Either way the drafter is marked unavailable: the engine decodes without drafts, and `tick()` (called by the
verify worker's loop) sends a ping every retry interval without waiting for the answer; the first pong makes
it available again. Replies are matched by call id, so a late answer to an abandoned call is dropped, and the
socket is rebuilt when the drafter is marked down so that messages queued for a dead peer never reach its
successor.
"""

import itertools
import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.channel_draft import TO_VERIFIER, DraftReply, Ping, Pong, Release
from shared.draft_codec import request_message, results_from_message, stacked_features
from shared.draft_config import DraftConfig
from shared.feature_transport import FrameTransport, TransportError
from shared.proposals import DraftItem, DraftResult, ProposerUnavailable
from shared.tensor_frames import from_raw
from shared.wire import WireError, decode, encode
from verify_worker.draft_deadline import STEADY_BLOCKS, DraftDeadline


class RemoteProposer:
    def __init__(self, address: str, draft_config: DraftConfig, block_size: int | None = None,
                 timeout_s: float = 5.0, retry_interval_s: float = 0.5, log: logging.Logger | None = None,
                 transport=None, deadline: DraftDeadline | None = None):
        self.address = address
        self.transport = transport or FrameTransport()  # how the context features travel (frames or pair)
        self.block_size = block_size or draft_config.block_size
        self.target_layer_ids = draft_config.target_layer_ids
        self.num_target_layers = draft_config.num_target_layers
        self.feature_width = draft_config.num_taps * draft_config.hidden_size
        self.kind = draft_config.kind  # "dflash" or "dflash2"; the drafter's pong confirms it
        self.masks_grammars = False  # whether its drafts obey grammars (LocalProposer.masks_grammars): its pong says
        self.vocab_size = draft_config.vocab_size
        self.deadline = deadline or DraftDeadline(cap_s=timeout_s)
        self.retry_interval_s = retry_interval_s
        self.log = log or logging.getLogger("dflash.verify")
        self.context = zmq.Context.instance()
        self.socket = self.monitor = None
        self.call_ids = itertools.count(1)
        self.available = False
        self.next_probe = 0.0
        self.last_timing: dict[str, float] = {}
        self.bad_messages = 0
        self._connect()

    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=0)
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(self.address)

    def _disconnected(self) -> bool:
        """Whether the monitor reported a lost connection since the last look (drains its events)."""
        lost = False
        while self.monitor.poll(0):
            lost |= recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        return lost

    def _receive(self):
        """One decoded message from the drafter, or None for one that is rejected."""
        frames = self.socket.recv_multipart(copy=False)
        try:
            return decode(frames, TO_VERIFIER)
        except WireError as exc:
            self.bad_messages += 1
            self.log.warning("rejected drafter message: %s", exc)
            return None

    def _exchange(self, message, timeout: Callable[[], float], after_send=None):
        """Send one message (then run after_send) and wait for the reply carrying its call id, at most timeout()
        seconds (asked once the message is on its way: the drafter works meanwhile). Returns the reply, or a
        string saying why there is none (timeout, connection lost)."""
        self._disconnected()  # events of earlier connections say nothing about this call
        try:
            self.socket.send_multipart(encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return "not connected"
        if after_send is not None:
            after_send()
        timeout_s = timeout()
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.monitor in ready and self._disconnected():
                return "the drafter closed its connection"
            if self.socket in ready:
                reply = self._receive()
                if reply is not None and reply.call_id == message.call_id:
                    return reply
        return f"no answer within {timeout_s:.2f} s"

    def _mark_down(self, why: str) -> None:
        if self.available:
            self.log.warning("drafter unavailable (%s): decoding without speculation", why)
        self.available = False
        self.next_probe = time.monotonic() + self.retry_interval_s
        self.deadline.reset()
        self.transport.reset()
        self._connect()

    def tick(self) -> None:
        """While the drafter is unavailable: take any pong that arrived and send the next ping when it is due.
        Never waits, so a hung drafter does not slow the verify worker's loop."""
        if self.available:
            if self._disconnected():  # it died between calls: say so now, not at the next call
                self._mark_down("the drafter closed its connection")
            return
        while self.socket.poll(0):
            reply = self._receive()
            if isinstance(reply, Pong):
                self.log.info("drafter available (%s, block size %d%s)", reply.drafter_kind, reply.block_size,
                              ", drafting under grammars" if reply.masks_grammars else "")
                self.available, self.kind, self.masks_grammars = True, reply.drafter_kind, reply.masks_grammars
                return
        if time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + self.retry_interval_s
            try:
                self.socket.send_multipart(encode(Ping(call_id=next(self.call_ids))), flags=zmq.NOBLOCK)
            except zmq.Again:  # not connected (yet): nothing is queued for it
                pass

    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        self.tick()
        if not self.available:
            raise ProposerUnavailable("drafter unavailable")
        started = time.perf_counter()
        catch_up = any(len(item.context_features) > STEADY_BLOCKS * self.block_size for item in items)
        rows = sum(len(item.context_features) for item in items)
        features = stacked_features(items, self.feature_width)
        outgoing = self.transport.outgoing(features)
        message = request_message(next(self.call_ids), items, outgoing)
        try:
            reply = self._exchange(message, lambda: self.deadline.timeout(rows),
                                   lambda: self.transport.push(features, outgoing))
        except TransportError as exc:
            self._mark_down(str(exc))
            raise ProposerUnavailable("feature transport failed") from None
        if not isinstance(reply, DraftReply):
            self._mark_down(reply)
            raise ProposerUnavailable(f"drafter call failed: {reply}")
        problem = self._implausible(items, reply)
        if problem:  # a drafter's output is checked like any peer's message: a bad one costs drafts, not requests
            self.bad_messages += 1
            self._mark_down(f"bad proposals: {problem}")
            raise ProposerUnavailable(f"bad proposals: {problem}")
        elapsed = time.perf_counter() - started
        # a request the drafter had to resync wrote no rows: its rows would make the per-row figure too small
        ingest = None if any(reply.resync) else reply.ingest_seconds
        self.deadline.observe(elapsed, catch_up, rows, ingest)
        self.last_timing = {"draft": reply.draft_seconds, "transfer": elapsed - reply.draft_seconds}
        return results_from_message(reply)

    def _implausible(self, items: list[DraftItem], reply: DraftReply) -> str:
        """Why these proposals cannot be verified ("" when they can): more tokens than asked, token or candidate
        ids outside the vocabulary, dense q of another width (the wire format checked the other shapes)."""
        if len(reply.counts) != len(items):
            return f"{len(reply.counts)} results for {len(items)} requests"
        over = next((i.request_id for i, n in zip(items, reply.counts) if n > i.num_draft), None)
        if over is not None:
            return f"more tokens than asked for {over}"
        for name, raw in (("token", reply.tokens), ("candidate", reply.q_ids)):
            ids = None if raw is None else from_raw(raw)
            if ids is not None and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.vocab_size):
                return f"a {name} id outside the vocabulary ({self.vocab_size})"
        dense = "dense" in reply.q_kinds
        if dense and reply.q_probs.shape[-1] != self.vocab_size:
            return f"dense q of width {reply.q_probs.shape[-1]}, vocabulary {self.vocab_size}"
        return ""

    def release(self, request_id: str) -> None:
        if not self.available:
            return
        try:
            self.socket.send_multipart(encode(Release(request_ids=[request_id])), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
