"""The verify worker's memory plan, made before a tensor is read: from the target's config.json (and the drafter's)
alone, per GPU (tensor-parallel rank), the weights by dtype, what one request holds at the context, the drafter
where the worker hosts it, the activations of the largest step and the CUDA graphs' pool; then how many requests
fit the device, and if the model does not, a refusal that names what does not fit and what would.

On a CPU the device is the host: the memory the server's roles may use together (--cpu-memory-gb, else what the
host has available or its cgroup's limit allows, shared.host_memory), less the gateway's and the draft worker's
share, split between the tensor-parallel ranks; each rank also counts its own process and its loading peak.

The shapes come from the family's placement (its model built on the meta device for this rank, its TP shard plan,
its loader's dtypes and packing), so the plan counts what the loader will place. Activations and graphs are an
estimate (ACTIVATION_BUFFERS below); docs/serving.md says how the plan compares with what was measured.
"""

import sys
from dataclasses import dataclass, field, replace

import torch

from draft_worker.dflash2_model import DFlash2DraftModel
from draft_worker.draft_model import DFlashDraftModel
from shared.draft_config import DraftConfig
from shared.host_memory import read_host_memory
from verify_worker.engine.page_tables import PAGE_SIZE
from verify_worker.families.registry import family_for
from verify_worker.parallel.group import TensorParallel

HEADROOM = 0.08  # of a GPU kept for the CUDA context, NCCL's buffers and the allocator's fragmentation
ACTIVATION_BUFFERS = 16  # hidden-width buffers a step holds at once per row (inputs, norms, projections, residuals)
GB = 10**9  # GPU memory as its datasheet states it (--gpu-memory-gb, --cpu-memory-gb)
PROCESS_BYTES = 2**29  # on a CPU, a worker process besides its tensors: the interpreter, PyTorch, the C++ kernels
GATEWAY_BYTES = 2**28  # on a CPU, the gateway process (no PyTorch; the tokenizer, the requests in flight)
GIB = 2**30
TP_CHOICES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class PlanRequest:
    """What the plan is asked for: the served settings that decide memory."""

    target_config: dict
    draft_config: dict | None
    world_size: int
    max_model_len: int | None  # None: the target's max_position_embeddings
    max_running: int
    max_prefill_tokens: int
    block_size: int | None  # None: the drafter's (1 without one)
    dtype: str
    device: str
    device_bytes: int | None  # one GPU's memory (None: unknown, nothing refused; unused on a CPU)
    local_drafter: bool  # the drafter runs in this worker (--draft-placement local)
    cuda_graphs: bool
    taps: int | None = None  # target layers fed to the drafter (None: the draft config's; 0 without one)
    host_bytes: int | None = None  # on a CPU, the memory the server's roles may use together (None: unknown)
    host_source: str = ""  # where host_bytes comes from, as the plan prints it

    @property
    def on_cpu(self) -> bool:
        return not self.device.startswith("cuda")


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    family: str
    context: int  # tokens a request may reach
    block: int
    step_rows: int  # rows of the largest step: a verify block of every running request, or a prefill chunk
    weights: dict[str, int]  # dtype -> bytes on one rank
    per_request: int  # the target's state and the drafter's feature rows at the context
    drafter_weights: int  # the drafter's weights, where it runs (this GPU only with local placement)
    drafter_per_request: int  # its context cache per request, where it runs
    activations: int
    graphs: int
    notes: tuple[str, ...] = field(default=())
    load_peak: int = 0  # the weights' most while loading (their loaded tensors beside packed copies)
    process: int = 0  # the worker process besides its tensors (counted on a CPU)
    others: int = 0  # on a CPU, what the other roles on the host take: the gateway, a draft worker
    page_bytes: int = 0  # a paged KV cache's page (PAGE_SIZE positions, every layer); 0: a slot a request
    kv_per_request: int = 0  # the KV cache part of per_request (a paged cache's pages, at the context)

    @property
    def paged(self) -> bool:
        return self.page_bytes > 0

    @property
    def pages_per_request(self) -> int:
        """Pages one request holds at the context (the pool's least)."""
        return -(-self.kv_per_request // self.page_bytes) if self.paged else 0

    @property
    def slot_bytes(self) -> int:
        """What a request holds whatever its length: all of request_total for a slot a request; beside a paged
        cache's pool, its drafter feature rows and the drafter's cache at the context."""
        return self.request_total - self.kv_per_request if self.paged else self.request_total

    def pool_pages(self, requests: int) -> int:
        """A paged cache's pages with `requests` slots: what the memory left holds, at most every slot at the
        context (all of them where the memory is unknown)."""
        if not self.paged:
            return 0
        most = requests * self.pages_per_request
        if self.usable is None:
            return most
        return max(0, min(most, (self.usable - self.fixed - requests * self.slot_bytes) // self.page_bytes))

    @property
    def fixed(self) -> int:
        here = self.drafter_weights if self.request.local_drafter else 0
        return self.process + sum(self.weights.values()) + here + self.activations + self.graphs

    @property
    def loading(self) -> int:
        """The most the worker holds before it serves: its weights' loading peak."""
        return self.process + self.load_peak

    @property
    def share(self) -> int | None:
        """One rank's memory: a GPU's, or on a CPU the host's less the other roles', over the ranks."""
        request = self.request
        if request.on_cpu:
            host = request.host_bytes
            return None if host is None else max(0, host - self.others) // request.world_size
        return request.device_bytes

    @property
    def usable(self) -> int | None:
        return None if self.share is None else int(self.share * (1 - HEADROOM))

    def asked(self, requests: int) -> int:
        """The most this rank holds with `requests` running: loading, or serving them (a paged cache: its slots'
        own bytes and the pool)."""
        if self.paged:
            return max(self.loading, self.fixed + requests * self.slot_bytes + self.pool_pages(requests) *
                       self.page_bytes)
        return max(self.loading, self.fixed + requests * self.request_total)

    @property
    def request_total(self) -> int:
        return self.per_request + (self.drafter_per_request if self.request.local_drafter else 0)

    @property
    def fitting_requests(self) -> int | None:
        if self.usable is None:
            return None
        if self.loading > self.usable:
            return 0
        if not self.paged:
            return max(0, (self.usable - self.fixed) // self.request_total)
        room = self.usable - self.fixed - self.pages_per_request * self.page_bytes  # the pool holds one at least
        if room < self.slot_bytes:
            return 0
        return min(self.request.max_running, room // self.slot_bytes) if self.slot_bytes else self.request.max_running

    @property
    def fits(self) -> bool:
        fitting = self.fitting_requests
        return fitting is None or fitting >= self.request.max_running


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def is_fp8(config: dict) -> bool:
    """An FP8 block checkpoint: quantization_config at the top or (GLM-5.3-Flash) in text_config."""
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return (quantization or {}).get("quant_method") == "fp8"


def drafter_bytes(draft_config: dict, dtype: torch.dtype, context: int) -> tuple[int, int]:
    """(the drafter's weights, its context cache per request at `context` positions), in `dtype`."""
    cfg = DraftConfig.from_dict(draft_config)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg) if cfg.dflash2 else DFlashDraftModel(cfg)
    weights = sum(p.numel() for p in model.parameters()) * dtype_bytes(dtype)
    cache = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * dtype_bytes(dtype)
    return weights, cache


def activation_bytes(target_cfg, rows: int, dtype: torch.dtype) -> int:
    """The largest step's transient memory, estimated: ACTIVATION_BUFFERS hidden-width buffers per row (times the
    mHC streams), the MoE's per-pair rows, and the float32 logits and probabilities of every row."""
    hidden, streams = target_cfg.hidden_size, getattr(target_cfg, "hc_mult", 1)
    per_row = ACTIVATION_BUFFERS * hidden * streams * dtype_bytes(dtype)
    top_k = getattr(target_cfg, "num_experts_per_tok", 0)
    if top_k:
        per_row += top_k * (3 * target_cfg.moe_intermediate_size + hidden) * dtype_bytes(dtype)
    per_row += 2 * target_cfg.vocab_size * 4
    return rows * per_row


def make_plan(request: PlanRequest) -> MemoryPlan:
    config = request.target_config
    family = family_for(config)
    placement = family.place(config, TensorParallel(0, request.world_size), request.dtype, request.device)
    model, dtype = placement.model, placement.compute  # the model on the meta device: nothing is allocated
    cfg = model.config
    draft_cfg = DraftConfig.from_dict(request.draft_config) if request.draft_config else None
    block = request.block_size or (draft_cfg.block_size if draft_cfg else 1)
    context = min(request.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    capacity = context + block
    taps = request.taps if request.taps is not None else len(draft_cfg.target_layer_ids) if draft_cfg else 0
    per_request = model.state_bytes_per_slot(capacity, block) + capacity * taps * cfg.hidden_size * dtype_bytes(dtype)
    drafter_weights = drafter_cache = 0
    if request.draft_config:
        drafter_weights, drafter_cache = drafter_bytes(request.draft_config, dtype, capacity)
    rows = max(request.max_running * block, request.max_prefill_tokens)
    activations = activation_bytes(cfg, rows, dtype)
    notes = ("FP8 checkpoint: experts and projections stay FP8 blocks with float32 scales; the embedding, lm_head, "
             "kv_b (read per head), norms and router (and KDA's projections) are not FP8",) if is_fp8(config) else ()
    others = 0
    if request.on_cpu:  # the gateway, and a draft worker holding its weights and a cache for every request
        worker = request.draft_config is not None and not request.local_drafter
        drafter = PROCESS_BYTES + drafter_weights + request.max_running * drafter_cache if worker else 0
        others = GATEWAY_BYTES + drafter
    page_bytes = kv = 0
    if request.on_cpu and hasattr(model, "new_paged_state"):  # the family reads a paged cache on a CPU
        kv = model.state_bytes_per_slot(capacity, block)
        page_bytes = model.state_bytes_per_slot(PAGE_SIZE, block)
    return MemoryPlan(request, family.name, context, block, rows, placement.weights, per_request, drafter_weights,
                      drafter_cache, activations, activations if request.cuda_graphs else 0, notes,
                      placement.load_peak, PROCESS_BYTES if request.on_cpu else 0, others, page_bytes, kv)


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The plan as the operator reads it."""
    request = plan.request
    weights = ", ".join(f"{size / GIB:.2f} GiB {dtype}" for dtype, size in plan.weights.items())
    unit = "per GPU" if request.device.startswith("cuda") else "per process"
    lines = [f"memory plan ({plan.family}, TP {request.world_size}, {request.device}; {unit}):",
             f"  weights: {weights}",
             f"  one request at {plan.context} tokens (+ block {plan.block}): {plan.per_request / GIB:.3f} GiB "
             f"(caches and states{', drafter feature rows' if request.draft_config or request.taps else ''})"]
    if request.draft_config:
        where = "in this worker" if request.local_drafter else \
            "in the draft worker (its own process)" if request.on_cpu else \
            "in the draft worker (its own process and GPU memory)"
        lines.append(f"  drafter {where}: {plan.drafter_weights / GIB:.2f} GiB weights, "
                     f"{plan.drafter_per_request / GIB:.3f} GiB a request (its context cache)")
    graphs = f"; CUDA graphs: {plan.graphs / GIB:.2f} GiB" if request.cuda_graphs else ""
    lines.append(f"  activations (estimate, the largest step: {plan.step_rows} rows): "
                 f"{plan.activations / GIB:.2f} GiB{graphs}")
    lines.extend(f"  note: {note}" for note in plan.notes)
    if request.on_cpu:
        lines.append(f"  this process: {plan.process / GIB:.2f} GiB besides its tensors; loading peaks at "
                     f"{plan.loading / GIB:.2f} GiB (loaded weights beside their packed copies)")
    if plan.usable is None:
        if plan.paged:
            lines.append(pool_line(plan, request.max_running))
        flag = "--cpu-memory-gb" if request.on_cpu else "--gpu-memory-gb"
        lines.append(f"  device memory unknown: {plan.fixed / GIB:.2f} GiB fixed + {plan.request_total / GIB:.3f} GiB "
                     f"a request (give {flag} to check the fit)")
        return lines
    if request.on_cpu:
        ranks = f", over {request.world_size} ranks" if request.world_size > 1 else ""
        drafter = " and the draft worker" if plan.others > GATEWAY_BYTES else ""
        lines.append(f"  host: {request.host_bytes / GIB:.1f} GiB ({request.host_source}), less "
                     f"{plan.others / GIB:.2f} GiB for the gateway{drafter}{ranks}: {plan.usable / GIB:.1f} GiB usable "
                     f"({HEADROOM:.0%} kept)")
    else:
        lines.append(f"  device: {request.device_bytes / GB:.0f} GB, {plan.usable / GIB:.1f} GiB usable "
                     f"({HEADROOM:.0%} kept)")
    running = min(plan.fitting_requests, request.max_running)
    if plan.paged:
        lines.append(pool_line(plan, running))
    lines.append(f"  fixed {plan.fixed / GIB:.2f} GiB; requests that fit: {plan.fitting_requests} "
                 f"(--max-running {request.max_running}); {running} running hold {plan.asked(running) / GIB:.2f} GiB")
    return lines


def pool_line(plan: MemoryPlan, running: int) -> str:
    """What a paged cache's pool holds: its pages, the tokens they take at once, and how they share out."""
    pages = plan.pool_pages(running)
    tokens = pages * PAGE_SIZE
    return (f"  KV pool: {pages} pages of {PAGE_SIZE} positions ({plan.page_bytes / 2**20:.1f} MiB each, "
            f"{pages * plan.page_bytes / GIB:.2f} GiB): {tokens} tokens at once, {running} requests of "
            f"{tokens // max(1, running)} tokens each or {pages // plan.pages_per_request} at {plan.context} "
            f"(memory taken as pages are first used)")


def weights_fit(plan: MemoryPlan) -> bool:
    """The weights, their loading and the step's activations fit, leaving room for requests."""
    return plan.fixed < plan.usable and plan.loading <= plan.usable


def refusal(plan: MemoryPlan) -> str | None:
    """None when --max-running requests at the context fit; else what does not fit and what would."""
    if plan.fits:
        return None
    request = plan.request
    fitting = plan.fitting_requests
    weights = sum(plan.weights.values())
    if not weights_fit(plan) and request.on_cpu:
        what = (f"the weights ({weights / GIB:.1f} GiB a rank, {plan.loading / GIB:.1f} GiB while loading, with the "
                f"process) and the step's activations ({plan.activations / GIB:.1f} GiB) do not fit the "
                f"{plan.usable / GIB:.1f} GiB usable of {request.host_bytes / GIB:.1f} GiB ({request.host_source})")
    elif not weights_fit(plan):
        what = (f"the weights ({weights / GIB:.1f} GiB a GPU at TP {request.world_size}) and the step's activations "
                f"({(plan.activations + plan.graphs) / GIB:.1f} GiB) do not fit one GPU's {plan.usable / GIB:.1f} GiB "
                f"usable")
    else:
        what = (f"{fitting} of --max-running {request.max_running} requests of {plan.context} tokens fit "
                f"({plan.request_total / GIB:.3f} GiB each, {(plan.usable - plan.fixed) / GIB:.1f} GiB left after "
                f"{plan.fixed / GIB:.1f} GiB fixed)")
    nothing = "nothing on this host" if request.on_cpu else f"nothing up to --tp {TP_CHOICES[-1]}"
    return f"{what}; would fit: {'; '.join(alternatives(plan)) or nothing}"


def alternatives(plan: MemoryPlan) -> list[str]:
    """Settings that would fit: where the weights do not, the smallest wider TP that holds them and a request; else
    the requests that fit, the longest context at which --max-running fit, and a wider TP where it makes them fit.
    On a CPU the ranks share the host's memory: a wider TP is no way out there."""
    request, found = plan.request, []
    fit = weights_fit(plan)
    for tp in TP_CHOICES:
        if tp <= request.world_size or request.on_cpu:
            continue
        try:
            wider = make_plan(replace(request, world_size=tp))
        except Exception:  # a width this TP does not divide: not an option
            continue
        if wider.fits if fit else wider.fitting_requests:
            found.append(f"--tp {tp} ({sum(wider.weights.values()) / GIB:.1f} GiB of weights a GPU; "
                         f"{wider.fitting_requests} requests of {wider.context} tokens fit)")
            break
    if not fit:
        return found
    here = [f"--max-running {plan.fitting_requests}"] if plan.fitting_requests else []
    shorter = _longest_context(plan)
    if shorter:
        here.append(f"--max-model-len {shorter}")
    return here + found


def _longest_context(plan: MemoryPlan) -> int | None:
    """The longest context at which --max-running requests fit (a bisection on multiples of 1024), or None."""
    low, high = 0, plan.context
    while high - low > 1024:
        middle = (low + high) // 2 // 1024 * 1024 or 1024
        if middle == low:
            break
        if make_plan(replace(plan.request, max_model_len=middle)).fits:
            low = middle
        else:
            high = middle
    return low or None


def device_memory(device: str, gpu_memory_gb: float | None) -> int | None:
    """One GPU's memory: --gpu-memory-gb where given, else the visible device's own (None on a CPU)."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GB)
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[1]
    return None


def host_memory(cpu_memory_gb: float | None) -> tuple[int | None, str]:
    """The memory the server's roles may use together on a CPU, and where the figure comes from: --cpu-memory-gb
    where given (dflash-serve gives it, read once before its roles start), else what this host offers now."""
    if cpu_memory_gb is not None:
        return int(cpu_memory_gb * GB), "--cpu-memory-gb, as given or as dflash-serve read the host"
    found = read_host_memory()
    return (found.available, found.source) if found else (None, "")


def request_from_settings(settings, device: str) -> PlanRequest:
    """The plan request of a verify worker's settings (shared.settings.commands.VerifyCommand) on `device`."""
    from shared.config_json import read_config

    model, engine = settings.model, settings.engine
    draft = read_config(model.draft) if settings.drafting else None
    on_cpu = not str(device).startswith("cuda")
    host, source = host_memory(engine.cpu_memory_gb) if on_cpu else (None, "")
    return PlanRequest(read_config(model.target), draft, settings.parallel.world_size, model.max_model_len,
                       engine.max_running, engine.max_prefill_tokens, model.block_size, model.dtype, str(device),
                       None if on_cpu else device_memory(device, engine.gpu_memory_gb),
                       settings.drafting and settings.speculation.draft_placement == "local", engine.cuda_graphs,
                       host_bytes=host, host_source=source)


@dataclass(frozen=True)
class StartDecision:
    """What a verify worker does with a plan at its start."""

    requests: int  # --max-running as the worker will run it (0: it refuses to start)
    why: str | None  # None: --max-running fits as asked; else what does not fit and what would


def start_decision(plan: MemoryPlan) -> StartDecision:
    """A refusal (0 requests) where what is counted exactly (the weights and their loading, the hosted drafter, one
    request) exceeds the device, or a paged cache's pool would not hold one request at the context; else
    --max-running lowered to the requests that fit with the activations' estimate (at least 1: the estimate is not
    a reason to refuse a slot a request)."""
    why = refusal(plan)
    if why is None:
        return StartDecision(plan.request.max_running, None)
    counted = plan.fixed - plan.activations - plan.graphs + plan.request_total
    if counted > plan.usable or plan.loading > plan.usable:
        return StartDecision(0, why)
    requests = max(1, plan.fitting_requests)
    if plan.paged and plan.pool_pages(requests) < plan.pages_per_request:  # the pool takes the estimate's room too
        return StartDecision(0, why)
    return StartDecision(requests, why)


def planned_requests(settings, device: str, log) -> int:
    """At a verify worker's start, before a tensor is read: the plan logged and the memory it asks announced to
    dflash-serve (shared.role.announce_memory); a DFlashError naming the fix where nothing fits; else --max-running,
    lowered to the requests that fit (with a warning)."""
    from shared.errors import DFlashError
    from shared.role import announce_memory

    plan = make_plan(request_from_settings(settings, device))
    for line in plan_lines(plan):
        log.info("%s", line)
    decision = start_decision(plan)
    if plan.usable is not None:
        announce_memory("verify", plan.asked(max(1, decision.requests)), plan.share)
    if not decision.requests:
        raise DFlashError(f"the model does not fit: {decision.why}")
    if decision.why is not None:
        log.warning("the memory plan fits %d requests: max running lowered from %d (%s)", decision.requests,
                    settings.engine.max_running, decision.why)
    return decision.requests


def planned_pool_pages(settings, device: str, requests: int) -> int | None:
    """A paged KV cache's pages for `requests` slots as the plan shares the memory out (None: the family's cache is
    not paged here, or the memory is unknown: the engine's default, every slot at the context)."""
    plan = make_plan(request_from_settings(settings, device))
    return plan.pool_pages(requests) if plan.paged and plan.usable is not None else None


def main(argv=None) -> int:
    """`dflash-serve --plan` (the launcher runs this with the verify worker's settings): the plan printed; exit 0
    when --max-running requests at the context fit, 1 when not (with what would), 2 on a bad setting."""
    from shared.errors import DFlashError
    from verify_worker.server import parse_args

    settings = parse_args(argv)
    device = settings.model.device
    try:
        plan = make_plan(request_from_settings(settings, device))
    except DFlashError as exc:
        print(f"dflash-serve --plan: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(plan_lines(plan)))
    decision = start_decision(plan)
    if decision.why is None:
        print("dflash-serve --plan: fits")
        return 0
    print(f"dflash-serve --plan: does not fit: {decision.why}")
    print("dflash-serve --plan: a server with these settings " + (
        "refuses to start" if not decision.requests else
        f"starts with --max-running lowered to {decision.requests}"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
