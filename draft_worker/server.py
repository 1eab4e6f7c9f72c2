"""The draft worker process: serves draft calls from the verify worker over a ZeroMQ ROUTER socket.

It loads the drafter and only the target's embedding and lm_head tensors, never the whole target.
"""

import logging
import sys
import time

import torch
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import DraftSampling, LocalProposer
from shared import metric_names as names
from shared.channel_draft import TO_DRAFTER, DraftReply, DraftRequest, Ping, Pong, Release
from shared.checkpoint_io import load_tensors
from shared.config_json import read_config
from shared.cpu_kernels.library import pool_awake
from shared.draft_codec import items_from_message, reply_message
from shared.dtype_choice import resolve_dtype
from shared.errors import DFlashError
from shared.feature_transport import FrameTransport, make_transport
from shared.grammar import target_grammar_vocabulary
from shared.packed_linear import float32_kernels_run, kernel_layout
from shared.proposals import DraftResult
from shared.role import configure_process, run_worker, usable_cores
from shared.settings.commands import DraftCommand
from shared.settings.options import build_parser, parse_command
from shared.target_facts import TargetFacts
from shared.wire import WireError, decode, encode


def load_target_head(target_path: str, dtype: torch.dtype, device: str):
    """(embedding, lm_head) of the target, read alone from its checkpoint."""
    facts = TargetFacts.from_config(read_config(target_path))
    tensors = load_tensors(target_path, names={*facts.embed_names, facts.head_name}, dtype=dtype, device=device)
    embed = next((tensors[n] for n in facts.embed_names if n in tensors), None)
    if embed is None:
        raise DFlashError(f"{target_path!r} has no {' or '.join(facts.embed_names)}")
    head = embed if facts.tie_word_embeddings else tensors.get(facts.head_name)
    if head is None:
        raise DFlashError(f"{target_path!r} has no {facts.head_name} and does not tie its embeddings")
    return embed, head


class DraftMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.calls = Counter(names.DRAFT_CALLS, "Draft calls served", registry=self.registry)
        self.forward = Histogram(names.DRAFT_FORWARD, "Time to serve one draft call", registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.cached = Gauge(names.DRAFT_CACHED_REQUESTS, "Requests with a drafter context cache",
                            registry=self.registry)
        self.resyncs = Counter(names.DRAFT_RESYNCS, "Requests asked to resend their context",
                               registry=self.registry)
        self.bad = Counter(names.BAD_MESSAGES, "Rejected wire messages", ["role"], registry=self.registry)
        self.bad.labels("draft")  # exported at 0 from the start: a dashboard shows 0, not "no data"


class DraftServer:
    def __init__(self, proposer: LocalProposer, address: str, metrics: DraftMetrics, log: logging.Logger,
                 transport=None):
        self.proposer, self.metrics, self.log = proposer, metrics, log
        self.transport = transport or FrameTransport()
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)

    def serve_forever(self) -> None:
        while True:
            identity, *frames = self.socket.recv_multipart(copy=False)
            try:
                message = decode(frames, TO_DRAFTER)
            except WireError as exc:
                self.metrics.bad.labels("draft").inc()
                self.log.warning("rejected message: %s", exc)
                continue
            # a draft call's helpers wake while it is decoded, not at the draft (pings and releases need none)
            with pool_awake(self.proposer.pool if isinstance(message, DraftRequest) else None):
                reply = self.handle(message)
            if reply is not None:
                self.socket.send_multipart([identity, *encode(reply)], copy=False)
                self._record(reply)  # after the send: the verify worker waits for the reply, not for the metrics

    def handle(self, message):
        if isinstance(message, Ping):
            return Pong(call_id=message.call_id, drafter_kind=self.proposer.drafter.config.kind,
                        block_size=self.proposer.block_size, masks_grammars=self.proposer.masks_grammars)
        if isinstance(message, Release):
            for request_id in message.request_ids:
                self.proposer.release(request_id)
            self.metrics.cached.set(len(self.proposer.slots))
            return None
        assert isinstance(message, DraftRequest)
        started = time.perf_counter()
        try:
            features = self.transport.pull(message.features, message.pair_session, message.feature_dtype,
                                           message.feature_shape)
            items = items_from_message(message, features)
        except DFlashError as exc:
            self.metrics.bad.labels("draft").inc()
            self.log.warning("rejected draft call %d: %s", message.call_id, exc)
            return None
        try:
            results = self.proposer.propose(items)
            ingest_seconds = self.proposer.last_timing.get("ingest")
        except Exception as exc:  # noqa: BLE001 - one request must not cost the others their drafts
            self.log.warning("draft call %d failed (%s: %s): drafting its %d requests one by one", message.call_id,
                             type(exc).__name__, exc, len(items))
            results = [self._draft_alone(item) for item in items]
            ingest_seconds = None  # split over calls, some failed: not a measure of this call's rows
        return reply_message(message.call_id, results, time.perf_counter() - started, ingest_seconds)

    def _record(self, reply) -> None:
        """A served call's metrics (Pongs count nothing)."""
        if not isinstance(reply, DraftReply):
            return
        self.metrics.calls.inc()
        self.metrics.forward.observe(reply.draft_seconds)
        self.metrics.resyncs.inc(sum(reply.resync))
        self.metrics.cached.set(len(self.proposer.slots))

    def _draft_alone(self, item) -> DraftResult:
        """One request's drafts; a request that fails on its own gets none this step and its context is
        dropped (it is asked to resend it), which costs it speed, never its output."""
        try:
            return self.proposer.propose([item])[0]
        except Exception:  # noqa: BLE001
            self.log.exception("request %s fails drafting on its own: no drafts for it this step", item.request_id)
            self.proposer.release(item.request_id)
            return DraftResult(tokens=None)


def parse_args(argv) -> DraftCommand:
    """The draft worker's settings (shared.settings: DraftCommand), from flags, $DFLASH_* or the launcher."""
    parser = build_parser(DraftCommand, "dflash-draft-worker", "The DFlash draft worker role.")
    return parse_command(DraftCommand, parser, argv)[0]


def build_server(settings: DraftCommand, log: logging.Logger) -> DraftServer:
    model = settings.model
    if not model.target or not model.draft:
        raise DFlashError("--target and --draft are required")
    target_cfg = TargetFacts.from_config(read_config(model.target))
    kernels = float32_kernels_run(model.device)  # the drafter packs like a llama target
    dtype = resolve_dtype(model.dtype, target_cfg.checkpoint_dtype, model.device, kernels)
    drafter = load_drafter(model.draft, dtype=dtype, device=model.device)
    embed, head = load_target_head(model.target, dtype, model.device)
    proposer = LocalProposer(
        drafter, embed, head, block_size=model.block_size, max_requests=settings.worker.max_requests,
        max_model_len=model.max_model_len or target_cfg.max_position_embeddings,
        draft_sampling=DraftSampling(settings.speculation.draft_sampling),
        layout=kernel_layout(model.dtype, target_cfg.checkpoint_dtype, model.device),
        grammar_vocabulary=target_grammar_vocabulary(model.target, drafter.config.vocab_size, log),
    )
    proposer.share_kernel_threads(settings.threads.kernel_threads or usable_cores())
    metrics = DraftMetrics()
    wire = settings.transport
    transport = make_transport(wire.feature_transport, wire.feature_pair_addr, sender=False, device=model.device,
                               backend=wire.feature_pair_backend, timeout_s=wire.feature_pair_timeout)
    server = DraftServer(proposer, settings.channels.draft_addr, metrics, log, transport)
    if settings.metrics.metrics_port:
        start_http_server(settings.metrics.metrics_port, addr=settings.metrics.metrics_host, registry=metrics.registry)
    return server


def main(argv=None) -> int:
    settings = parse_args(argv)
    log = configure_process("draft", settings.threads.threads)
    return run_worker("draft", "dflash-draft-worker", lambda: build_server(settings, log),
                      lambda _: settings.channels.draft_addr)


if __name__ == "__main__":
    sys.exit(main())
