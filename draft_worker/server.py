"""The draft worker process: serves draft calls from the verify worker over a ZeroMQ ROUTER socket.

It loads the drafter and only the target's embedding and lm_head tensors, never the whole target.
"""

import argparse
import logging
import os
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
from shared.feature_transport import FrameTransport, add_transport_flags, make_transport
from shared.packed_linear import float32_kernels_run, kernel_layout
from shared.proposals import DraftResult
from shared.role import configure_process, run_worker, usable_cores
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
                        block_size=self.proposer.block_size)
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


def parse_args(argv):
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="dflash-draft-worker", description="The DFlash draft worker role.")
    parser.add_argument("--role", default="draft", choices=["draft"], help=argparse.SUPPRESS)
    parser.add_argument("--target", default=env("DFLASH_TARGET"), help="target checkpoint (embedding and lm_head only)")
    parser.add_argument("--draft", default=env("DFLASH_DRAFT"), help="DFlash drafter checkpoint")
    parser.add_argument("--draft-addr", default=env("DFLASH_DRAFT_ADDR", "tcp://127.0.0.1:5557"),
                        help="ZeroMQ address to bind for draft calls")
    parser.add_argument("--metrics-port", type=int, default=int(env("DFLASH_DRAFT_METRICS_PORT", "9102")),
                        help="Prometheus port (0 = none)")
    parser.add_argument("--metrics-host", default=env("DFLASH_METRICS_HOST", "127.0.0.1"))
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-requests", type=int, default=64, help="requests with a cached context at once")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--draft-sampling", choices=[m.value for m in DraftSampling], default="dense")
    parser.add_argument("--device", default=env("DFLASH_DEVICE", "cpu"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=int(env("DFLASH_DRAFT_THREADS", "0")),
                        help="PyTorch's threads (0: a quarter of the cores, see shared.role.default_threads)")
    parser.add_argument("--kernel-threads", type=int, default=int(env("DFLASH_DRAFT_KERNEL_THREADS", "0")),
                        help="threads of the drafter's C++ CPU projections, where they run (0: every core this "
                             "process may use)")
    add_transport_flags(parser, env)
    return parser.parse_args(argv)


def build_server(args, log: logging.Logger) -> DraftServer:
    if not args.target or not args.draft:
        raise DFlashError("--target and --draft are required")
    target_cfg = TargetFacts.from_config(read_config(args.target))
    kernels = float32_kernels_run(args.device)  # the drafter packs like a llama target
    dtype = resolve_dtype(args.dtype, target_cfg.checkpoint_dtype, args.device, kernels)
    drafter = load_drafter(args.draft, dtype=dtype, device=args.device)
    embed, head = load_target_head(args.target, dtype, args.device)
    proposer = LocalProposer(
        drafter, embed, head, block_size=args.block_size, max_requests=args.max_requests,
        max_model_len=args.max_model_len or target_cfg.max_position_embeddings,
        draft_sampling=DraftSampling(args.draft_sampling),
        layout=kernel_layout(args.dtype, target_cfg.checkpoint_dtype, args.device),
    )
    proposer.share_kernel_threads(args.kernel_threads or usable_cores())
    metrics = DraftMetrics()
    transport = make_transport(args.feature_transport, args.feature_pair_addr, sender=False, device=args.device,
                               backend=args.feature_pair_backend, timeout_s=args.feature_pair_timeout)
    server = DraftServer(proposer, args.draft_addr, metrics, log, transport)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    return server


def main(argv=None) -> int:
    args = parse_args(argv)
    log = configure_process("draft", args.threads)
    return run_worker("draft", "dflash-draft-worker", lambda: build_server(args, log), lambda _: args.draft_addr)


if __name__ == "__main__":
    sys.exit(main())
