"""The Proposer that talks to a draft worker process over ZeroMQ (DEALER -> the worker's ROUTER).

A call that gets no answer within the timeout marks the drafter unavailable: the engine then decodes without
drafts, and every retry_interval one cheap ping checks whether the drafter is back. Replies are matched by
call id, so a late answer to an abandoned call is dropped. The socket is rebuilt after a timeout so that
requests queued for a dead peer are not delivered to its successor.
"""

import itertools
import logging
import time

import zmq

from draft_worker.draft_config import DraftConfig
from shared.channel_draft import TO_VERIFIER, DraftReply, Ping, Pong, Release
from shared.draft_codec import request_message, results_from_message, stacked_features
from shared.feature_transport import FrameTransport, TransportError
from shared.proposals import DraftItem, DraftResult, ProposerUnavailable
from shared.wire import WireError, decode, encode


class RemoteProposer:
    def __init__(self, address: str, draft_config: DraftConfig, block_size: int | None = None,
                 timeout_s: float = 5.0, ping_timeout_s: float = 0.2, retry_interval_s: float = 0.5,
                 log: logging.Logger | None = None, transport=None):
        self.address = address
        self.transport = transport or FrameTransport()  # how the context features travel (frames or pair)
        self.block_size = block_size or draft_config.block_size
        self.target_layer_ids = draft_config.target_layer_ids
        self.num_target_layers = draft_config.num_target_layers
        self.feature_width = draft_config.num_taps * draft_config.hidden_size
        self.kind = draft_config.kind  # "dflash" or "dflash2"; the drafter's pong confirms it
        self.timeout_s, self.ping_timeout_s, self.retry_interval_s = timeout_s, ping_timeout_s, retry_interval_s
        self.log = log or logging.getLogger("dflash.verify")
        self.context = zmq.Context.instance()
        self.socket = None
        self.call_ids = itertools.count(1)
        self.available = False
        self.next_probe = 0.0
        self.last_timing: dict[str, float] = {}
        self.bad_messages = 0
        self._connect()

    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
        self.socket.connect(self.address)

    def _exchange(self, message, timeout_s: float, after_send=None):
        """Send one message (then run after_send) and wait for the reply carrying its call id; None on
        timeout."""
        try:
            self.socket.send_multipart(encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if after_send is not None:
            after_send()
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000) + 1):
                continue
            frames = self.socket.recv_multipart(copy=False)
            try:
                reply = decode(frames, TO_VERIFIER)
            except WireError as exc:
                self.bad_messages += 1
                self.log.warning("rejected drafter message: %s", exc)
                continue
            if reply.call_id == message.call_id:
                return reply
        return None

    def _mark_down(self, why: str) -> None:
        if self.available:
            self.log.warning("drafter unavailable (%s): decoding without speculation", why)
        self.available = False
        self.next_probe = time.monotonic() + self.retry_interval_s
        self.transport.reset()
        self._connect()

    def probe(self) -> bool:
        """One ping; True when the drafter answers with a matching block size."""
        reply = self._exchange(Ping(call_id=next(self.call_ids)), self.ping_timeout_s)
        if not isinstance(reply, Pong):
            self._mark_down("no answer to ping")
            return False
        if not self.available:
            self.log.info("drafter available (%s, block size %d)", reply.drafter_kind, reply.block_size)
        self.available, self.kind = True, reply.drafter_kind
        return True

    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        if not self.available and (time.monotonic() < self.next_probe or not self.probe()):
            raise ProposerUnavailable("drafter unavailable")
        started = time.perf_counter()
        features = stacked_features(items, self.feature_width)
        outgoing = self.transport.outgoing(features)
        message = request_message(next(self.call_ids), items, outgoing)
        try:
            reply = self._exchange(message, self.timeout_s, lambda: self.transport.push(features, outgoing))
        except TransportError as exc:
            self._mark_down(str(exc))
            raise ProposerUnavailable("feature transport failed") from None
        if not isinstance(reply, DraftReply):
            self._mark_down(f"no answer within {self.timeout_s:.1f} s")
            raise ProposerUnavailable("drafter timed out")
        self.last_timing = {"draft": reply.draft_seconds, "transfer": time.perf_counter() - started - reply.draft_seconds}
        return results_from_message(reply)

    def release(self, request_id: str) -> None:
        if not self.available:
            return
        try:
            self.socket.send_multipart(encode(Release(request_ids=[request_id])), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
