"""The verify worker process: owns every request, runs the engine step by step, streams token events.

Gateway channel: PULL (submits, aborts) and PUSH (token events, failures, heartbeats), both bound here.
Continuous batching: between engine steps it takes in every message that arrived, so requests join and leave
at step boundaries.
"""

import argparse
import logging
import os
import sys
import threading
import time
import traceback

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import DraftSampling, LocalProposer
from shared import metric_names as names
from shared.channel_gateway import (
    TO_VERIFY,
    AbortRequest,
    Heartbeat,
    RequestFailed,
    SubmitRequest,
    TokenBatch,
    TokenEvent,
    WorkerStopping,
)
from shared.config_json import read_config
from shared.draft_config import DraftConfig
from shared.errors import DFlashError, RequestError
from shared.feature_transport import add_transport_flags, make_transport
from shared.packed_linear import kernel_layout
from shared.role import configure_process, run_worker, usable_cores
from shared.target_facts import TargetFacts
from shared.wire import WireError, decode, encode
from verify_worker.draft_deadline import DraftDeadline
from verify_worker.engine import SpeculativeEngine
from verify_worker.liveness import HeartbeatThread
from verify_worker.logprobs import TokenLogprob
from verify_worker.parallel.driver import ParallelFailure, TargetLeader, follow
from verify_worker.parallel.group import GroupSettings, join_group, leave_group
from verify_worker.remote_proposer import RemoteProposer
from verify_worker.request import GenerationRequest, StepEvent, StepReport
from verify_worker.spec_policy import AdaptiveSpeculation
from verify_worker.target_loader import batch_invariant_refusal, load_target

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class VerifyMetrics:
    def __init__(self, drafter_kind: str):
        r = self.registry = CollectorRegistry()
        self.drafts = Counter(names.SPEC_DRAFTS, "Request verify steps that carried drafts", registry=r)
        self.draft_tokens = Counter(names.SPEC_DRAFT_TOKENS, "Drafted tokens verified", registry=r)
        self.accepted = Counter(names.SPEC_ACCEPTED_TOKENS, "Drafted tokens accepted", registry=r)
        self.accepted_at = Counter(names.SPEC_ACCEPTED_PER_POSITION, "Accepted drafts by block position",
                                   ["position"], registry=r)
        self.drafted_at = Counter(names.SPEC_DRAFTED_PER_POSITION, "Drafts by block position", ["position"],
                                  registry=r)
        self.step = Histogram(names.STEP_SECONDS, "Time per engine step by phase", ["phase"], registry=r,
                              buckets=STEP_BUCKETS)
        self.running = Gauge(names.RUNNING, "Requests holding a cache slot", registry=r)
        self.waiting = Gauge(names.WAITING, "Requests queued for a cache slot", registry=r)
        self.drafter = Gauge(names.DRAFTER_AVAILABLE, "1 when the drafter answers", ["kind"], registry=r)
        self.fallback = Counter(names.FALLBACK_STEPS, "Steps decoded without drafts for want of a drafter",
                                registry=r)
        self.policy_plain = Counter(names.POLICY_PLAIN_STEPS, "Steps the speculation policy decoded plainly",
                                    registry=r)
        self.bad = Counter(names.BAD_MESSAGES, "Rejected wire messages", ["role"], registry=r)
        self.bad.labels("verify")  # exported at 0 from the start: a dashboard shows 0, not "no data"
        self.kind = drafter_kind
        self.children: dict[tuple, object] = {}  # (metric, label) -> its labelled child, looked up once

    def _child(self, metric, label: str):
        child = self.children.get((metric, label))
        if child is None:
            child = self.children[(metric, label)] = metric.labels(label)
        return child

    def record(self, report: StepReport) -> None:
        """One step's figures (once a step: the labelled children are kept, not looked up again each time)."""
        for phase, seconds in report.seconds.items():
            self._child(self.step, phase).observe(seconds)
        rows_with_drafts = report.drafted_at[0] if report.drafted_at else 0
        self.drafts.inc(rows_with_drafts)
        self.draft_tokens.inc(report.draft_tokens)
        self.accepted.inc(report.accepted_tokens)
        for position, (drafted, accepted) in enumerate(zip(report.drafted_at, report.accepted_at), start=1):
            if drafted:
                self._child(self.drafted_at, str(position)).inc(drafted)
                self._child(self.accepted_at, str(position)).inc(accepted)
        if report.fallback:
            self.fallback.inc()
        if report.policy_plain:
            self.policy_plain.inc()


def _totals(stats) -> tuple[int, int, int]:
    """A request's running (verify steps, draft tokens, accepted tokens), as its token events carry them."""
    return (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) if stats else (0, 0, 0)


def _token_event(event: StepEvent) -> TokenEvent:
    """A step's event of a request that asked for log-probabilities, as a message of its own."""
    values, top_ids, top_values = _logprob_lists(event.logprobs)
    prompt_values, prompt_top_ids, prompt_top_values = _logprob_lists(event.prompt_logprobs)
    verify_steps, draft_tokens, accepted_tokens = _totals(event.stats)
    return TokenEvent(
        request_id=event.request_id, token_ids=event.new_token_ids, finish_reason=event.finish_reason,
        verify_steps=verify_steps, draft_tokens=draft_tokens, accepted_tokens=accepted_tokens, logprobs=values,
        top_ids=top_ids, top_logprobs=top_values, prompt_logprobs=prompt_values, prompt_top_ids=prompt_top_ids,
        prompt_top_logprobs=prompt_top_values,
    )


def _logprob_lists(logprobs: list[TokenLogprob] | None) -> tuple:
    """TokenLogprobs as the three parallel lists of a token event (or three Nones)."""
    if logprobs is None:
        return None, None, None
    return [t.logprob for t in logprobs], [t.top_ids for t in logprobs], [t.top_logprobs for t in logprobs]


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

    def serve_forever(self) -> None:
        self._report_state()
        self.heartbeats.start()
        try:
            while True:
                busy = self.engine.has_work()  # then this turn waits for nothing: all of it is the step's cost
                started = time.perf_counter()
                self._take_messages(block=not busy)
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

    def _take_messages(self, block: bool) -> None:
        timeout = int(self.heartbeat_s * 1000) if block else 0
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
                if self.engine.abort(message.request_id):
                    self.log.info("aborted %s", message.request_id)
            elif isinstance(message, SubmitRequest):
                self._submit(message)

    def _submit(self, message: SubmitRequest) -> None:
        try:
            if len(self.engine.waiting) >= self.max_waiting:
                raise _Rejected("queue_full", f"the queue is full ({self.max_waiting} requests waiting)")
            request = GenerationRequest(
                tuple(message.prompt_ids), message.max_tokens, message.sampling, tuple(message.stop_token_ids),
                message.num_speculative_tokens, request_id=message.request_id, logprobs=message.logprobs,
                prompt_logprobs=message.prompt_logprobs, min_tokens=message.min_tokens,
            )
            self.engine.add(request)
        except RequestError as exc:
            self._send(RequestFailed(request_id=message.request_id, code="invalid_request", message=str(exc)))
        except _Rejected as exc:
            self._send(RequestFailed(request_id=message.request_id, code=exc.code, message=exc.message))
        except Exception as exc:  # noqa: BLE001 - a bad request must not stop the loop that serves the others
            self.log.error("cannot admit %s:\n%s", message.request_id, traceback.format_exc())
            self._send(RequestFailed(request_id=message.request_id, code="invalid_request",
                                     message=f"the request cannot be served: {exc}"))

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
                self._send(_token_event(event))
        if plain:  # straight into the batch's lists (64 events: 23 us, 65 us through a TokenEvent each)
            totals = [_totals(event.stats) for event in plain]
            verify_steps, draft_tokens, accepted_tokens = (list(column) for column in zip(*totals))
            self._send(TokenBatch(request_ids=[e.request_id for e in plain], token_ids=[e.new_token_ids for e in plain],
                                  finish_reasons=[e.finish_reason for e in plain], verify_steps=verify_steps,
                                  draft_tokens=draft_tokens, accepted_tokens=accepted_tokens))
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
        self.metrics.waiting.set(len(self.engine.waiting))
        self.heartbeats.progress(Heartbeat(running=self.engine.num_running, waiting=len(self.engine.waiting),
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


def parse_args(argv):
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="dflash-verify-worker", description="The DFlash verify worker role.")
    parser.add_argument("--role", default="verify", choices=["verify"], help=argparse.SUPPRESS)
    parser.add_argument("--target", default=env("DFLASH_TARGET"), help="target checkpoint folder")
    parser.add_argument("--draft", default=env("DFLASH_DRAFT"),
                        help="drafter checkpoint folder (its config.json says which target layers to tap)")
    parser.add_argument("--no-draft", action="store_true", help="serve without speculation")
    parser.add_argument("--requests-addr", default=env("DFLASH_REQUESTS_ADDR", "tcp://127.0.0.1:5555"))
    parser.add_argument("--events-addr", default=env("DFLASH_EVENTS_ADDR", "tcp://127.0.0.1:5556"))
    parser.add_argument("--draft-addr", default=env("DFLASH_DRAFT_ADDR", "tcp://127.0.0.1:5557"))
    parser.add_argument("--draft-placement", choices=["worker", "local"],
                        default=env("DFLASH_DRAFT_PLACEMENT", "worker"),
                        help="worker: the draft worker process at --draft-addr; local: the drafter runs in this "
                             "process (no draft call between processes; a drafter fault then stops this worker)")
    parser.add_argument("--draft-sampling", choices=[m.value for m in DraftSampling], default="dense",
                        help="how a local drafter proposes for sampled requests (a draft worker has its own flag)")
    parser.add_argument("--metrics-port", type=int, default=int(env("DFLASH_VERIFY_METRICS_PORT", "9101")),
                        help="Prometheus port (0 = none)")
    parser.add_argument("--metrics-host", default=env("DFLASH_METRICS_HOST", "127.0.0.1"))
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-running", type=int, default=64, help="requests holding a KV-cache slot at once")
    parser.add_argument("--max-waiting", type=int, default=64, help="requests queued for a slot")
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens per request")
    parser.add_argument("--max-prefill-tokens", type=int, default=512, help="prompt tokens prefilled per step")
    parser.add_argument("--kv-cache-budget-mb", type=float, default=None,
                        help="cap on the memory requests hold here (the KV cache, and the feature rows kept for "
                             "the drafter): max-running is lowered to fit (error if one request does not)")
    parser.add_argument("--draft-timeout", type=float, default=5.0,
                        help="the longest wait for a draft (a fresh drafter waits it until 4 calls are answered); "
                             "other calls wait 8x their recent median plus their extra context rows at the measured "
                             "cost of a row, at least --draft-deadline-floor; a drafter that closes its connection "
                             "is noticed at once")
    parser.add_argument("--draft-deadline-floor", type=float, default=0.25,
                        help="the shortest deadline of a steady draft call (seconds)")
    parser.add_argument("--stall-timeout", type=float, default=float(env("DFLASH_STALL_TIMEOUT", "300")),
                        help="a verify loop that makes no progress for this long is hung: the worker tells the "
                             "gateway and exits (0 = never); heartbeats flow meanwhile, whatever a step takes")
    parser.add_argument("--spec-policy", choices=["always", "adaptive"], default=env("DFLASH_SPEC_POLICY", "adaptive"),
                        help="always: every step drafts; adaptive: decode plainly while drafting is expected not to "
                             "pay (a drafted step after 8 plain ones, and rarer where such probes would cost over "
                             "5%% of the time, re-measures it)")
    parser.add_argument("--device", default=env("DFLASH_DEVICE", "cpu"))
    parser.add_argument("--batch-invariant", action="store_true",
                        help="on a GPU, the target's projections, norms and attention through cuda_ext's row kernels "
                             "(a row's sums never depend on the batch), for greedy speculative output equal to plain "
                             "decoding (--device cuda, bfloat16, TP 1, a Qwen3/Llama target; not yet run on a GPU)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay decode steps from CUDA graphs, one per shape bucket (rows padded to a power of "
                             "two, a verify step to the block size, keys to a power of two), all captured at "
                             "start-up before the worker reports ready")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=int(env("DFLASH_VERIFY_THREADS", "0")),
                        help="PyTorch's threads (0: half the cores, see shared.role.default_threads)")
    parser.add_argument("--kernel-threads", type=int, default=int(env("DFLASH_VERIFY_KERNEL_THREADS", "0")),
                        help="threads of the C++ CPU layer stack, where it runs (0: every core this process may "
                             "use; a busy core's thread just takes no share, the caller does its parts)")
    add_transport_flags(parser, env)
    tp = parser.add_argument_group("tensor parallelism (one process per rank; rank 0 owns the sockets)")
    tp.add_argument("--world-size", type=int, default=int(env("DFLASH_TP_WORLD_SIZE", "1")),
                    help="tensor-parallel size (ranks over all hosts)")
    tp.add_argument("--rank", type=int, default=int(env("DFLASH_TP_RANK", "0")), help="this process's rank")
    tp.add_argument("--master-addr", default=env("DFLASH_TP_MASTER_ADDR", "127.0.0.1"),
                    help="address of rank 0, reachable from every rank")
    tp.add_argument("--master-port", type=int, default=int(env("DFLASH_TP_MASTER_PORT", "29500")))
    tp.add_argument("--tp-backend", default=env("DFLASH_TP_BACKEND", "auto"), choices=["auto", "gloo", "nccl"],
                    help="auto = nccl on CUDA, gloo on CPU")
    tp.add_argument("--collective-timeout", type=float, default=float(env("DFLASH_TP_TIMEOUT", "30")),
                    help="seconds a collective may wait for a rank before the worker fails")
    return parser.parse_args(argv)


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


def rank_device(device: str, rank: int, world_size: int) -> str:
    """A bare "cuda" at TP > 1 means one GPU per rank: rank R takes cuda:(R mod the GPUs of this host)."""
    if device == "cuda" and world_size > 1:
        import torch

        return f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return device


def served_max_len(args, cfg) -> int:
    """Tokens a request may reach: --max-model-len, at most the target's max_position_embeddings."""
    return min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def request_bytes(target, capacity: int, num_taps: int) -> int:
    """The memory one request holds in this worker at `capacity` positions: the target's state (its KV cache) and,
    where a drafter is fed, the tapped feature rows the engine keeps for it (num_taps x hidden per committed token,
    in the activations' dtype, kept for the request's life so that a restarted drafter can be resynchronised)."""
    feature_row = num_taps * target.config.hidden_size * target.embed_weight.element_size()
    return target.state_bytes_per_slot(capacity) + capacity * feature_row


def local_proposer(args, target, max_running: int) -> LocalProposer:
    """The drafter in the verify worker's own process, sharing the target's embedding and lm_head."""
    drafter = load_drafter(args.draft, dtype=target.embed_weight.dtype, device=args.device)
    checkpoint_dtype = TargetFacts.from_config(read_config(args.target)).checkpoint_dtype
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=args.block_size,
                             max_requests=max_running, max_model_len=served_max_len(args, target.config),
                             draft_sampling=DraftSampling(args.draft_sampling),
                             layout=kernel_layout(args.dtype, checkpoint_dtype, args.device))
    # its calls and the target's alternate: on the target's pool where it has one
    proposer.share_kernel_threads(args.kernel_threads or usable_cores(), getattr(target, "pool", None))
    return proposer


def build_server(args, log) -> VerifyServer:
    if not args.target:
        raise DFlashError("--target is required")
    settings = GroupSettings(args.rank, args.world_size, args.master_addr, args.master_port, args.tp_backend,
                             args.collective_timeout)
    if args.world_size < 1:
        raise DFlashError(f"--world-size must be >= 1, got {args.world_size}")
    if args.cuda_graphs and not str(args.device).startswith("cuda"):
        raise DFlashError(f"--cuda-graphs needs a CUDA device (--device cuda), not {args.device!r}")
    if args.batch_invariant and batch_invariant_refusal(args.device):
        raise DFlashError(batch_invariant_refusal(args.device))
    if args.cuda_graphs and args.world_size > 1:
        raise DFlashError("--cuda-graphs needs --world-size 1 (the other ranks mirror each step eagerly)")
    if args.draft_timeout <= 0 or args.draft_deadline_floor <= 0:
        raise DFlashError("--draft-timeout and --draft-deadline-floor must be > 0")
    longest_wait = max(args.draft_timeout, args.collective_timeout)
    if args.stall_timeout and args.stall_timeout <= 2 * longest_wait:
        raise DFlashError(f"--stall-timeout ({args.stall_timeout:g} s) must exceed twice the longest wait of a step "
                          f"(--draft-timeout / --collective-timeout: {longest_wait:g} s), or be 0")
    args.device = rank_device(args.device, args.rank, args.world_size)
    tp = join_group(settings, args.device)
    target = load_target(args.target, device=args.device, dtype=args.dtype, tp=tp,
                         kernel_threads=args.kernel_threads or usable_cores(), batch_invariant=args.batch_invariant)
    if tp.rank > 0:
        log.info("tensor-parallel rank %d of %d: following rank 0", tp.rank, tp.world_size)
        return FollowerServer(target, log)
    if tp.parallel:
        target = TargetLeader(target)
    proposer = None
    drafting = bool(args.draft) and not args.no_draft
    local = drafting and args.draft_placement == "local"
    if local and tp.parallel:
        raise DFlashError("--draft-placement local needs --world-size 1 (the drafter needs the whole lm_head)")
    if drafting:
        draft_cfg = DraftConfig.from_dict(read_config(args.draft))
        if args.block_size is not None and args.block_size < 2:
            raise DFlashError(f"--block-size must be >= 2, got {args.block_size}")
    if drafting and not local:
        transport = make_transport(args.feature_transport, args.feature_pair_addr, sender=True, device=args.device,
                                   backend=args.feature_pair_backend, timeout_s=args.feature_pair_timeout)
        deadline = DraftDeadline(cap_s=args.draft_timeout, floor_s=args.draft_deadline_floor)
        proposer = RemoteProposer(args.draft_addr, draft_cfg, args.block_size, log=log, transport=transport,
                                  deadline=deadline)
    max_running = args.max_running
    if args.kv_cache_budget_mb is not None:
        cfg = target.config
        max_len = served_max_len(args, cfg)
        capacity = max_len + ((args.block_size or draft_cfg.block_size) if drafting else 1)
        slot_bytes = request_bytes(target, capacity, len(draft_cfg.target_layer_ids) if drafting else 0)
        fit = int(args.kv_cache_budget_mb * 2**20 // slot_bytes)
        if fit < 1:
            raise DFlashError(f"--kv-cache-budget-mb {args.kv_cache_budget_mb} holds no request of {max_len} tokens "
                              f"({slot_bytes / 2**20:.1f} MiB each: KV cache and the drafter's feature rows): raise "
                              f"it or lower --max-model-len")
        if fit < max_running:
            log.warning("KV-cache budget (KV cache and drafter feature rows) fits %d requests: max running lowered "
                        "from %d", fit, max_running)
            max_running = fit
    if local:
        proposer = local_proposer(args, target, max_running)
        log.info("drafter %s runs in this process (%s, block size %d)", args.draft, proposer.kind,
                 proposer.block_size)
    policy = AdaptiveSpeculation() if args.spec_policy == "adaptive" else None
    engine = SpeculativeEngine(target, proposer, max_requests=max_running, max_model_len=args.max_model_len,
                               max_prefill_tokens=args.max_prefill_tokens, policy=policy,
                               step_buckets="cuda-graphs" if args.cuda_graphs else None)
    capacity = engine.state.capacity
    per_request = target.state_bytes_per_slot(capacity)
    features = request_bytes(target, capacity, len(engine.tap_layers)) - per_request
    log.info("target %s: %d layers, cache %d slots x %d positions (%.1f MiB: %.1f MiB per request, %.1f KiB per "
             "token); drafter feature rows up to %.1f MiB per request", args.target, target.config.num_layers,
             max_running, capacity, engine.state.nbytes() / 2**20, per_request / 2**20, per_request / capacity / 2**10,
             features / 2**20)
    if args.cuda_graphs:  # every decode step shape captured now, so that no request waits for a capture
        engine.warm_up(progress=log.info)
    metrics = VerifyMetrics(proposer.kind if proposer else "none")
    server = VerifyServer(engine, args.requests_addr, args.events_addr, metrics, args.max_waiting, log,
                          keep_alive=target.keep_alive if tp.parallel else None, stall_s=args.stall_timeout)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    return server


def main(argv=None) -> int:
    args = parse_args(argv)
    log = configure_process("verify", args.threads)
    return run_worker("verify", "dflash-verify-worker", lambda: build_server(args, log), _ready_detail)


def _ready_detail(server) -> str:
    if isinstance(server, FollowerServer):
        return f"rank={server.target.tp.rank}"
    return f"max_model_len={server.engine.max_model_len}"


if __name__ == "__main__":
    sys.exit(main())
