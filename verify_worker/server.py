"""dflash-verify-worker: its settings, and the worker assembled from them (target, drafter link, policy, engine,
metrics, the loop of serve_loop.py), rank 0 or a tensor-parallel follower."""

import sys

import torch
from prometheus_client import start_http_server

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import DraftSampling, LocalProposer
from shared.config_json import read_config
from shared.draft_config import DraftConfig
from shared.errors import DFlashError
from shared.feature_transport import make_transport
from shared.grammar import target_grammar_vocabulary
from shared.packed_linear import kernel_layout
from shared.role import configure_process, run_worker, usable_cores
from shared.settings.commands import VerifyCommand
from shared.settings.options import build_parser, parse_command
from shared.settings.topics import ModelSettings
from shared.target_facts import TargetFacts
from verify_worker.draft_deadline import DraftDeadline
from verify_worker.engine import SpeculativeEngine
from verify_worker.engine.page_tables import PAGE_SIZE
from verify_worker.families.interface import DEFAULT_BLOCK_TOKENS
from verify_worker.memory_plan import planned_pool_pages, planned_requests
from verify_worker.parallel.driver import TargetLeader
from verify_worker.parallel.group import GroupSettings, join_group
from verify_worker.remote_proposer import RemoteProposer
from verify_worker.serve_loop import FollowerServer, VerifyServer
from verify_worker.spec_policy import AdaptiveSpeculation
from verify_worker.target_loader import batch_invariant_refusal, load_target
from verify_worker.worker_metrics import VerifyMetrics


def parse_args(argv) -> VerifyCommand:
    """The verify worker's settings (shared.settings: VerifyCommand), from flags, $DFLASH_* or the launcher."""
    parser = build_parser(VerifyCommand, "dflash-verify-worker", "The DFlash verify worker role.")
    return parse_command(VerifyCommand, parser, argv)[0]


def rank_device(device: str, rank: int, world_size: int) -> str:
    """A bare "cuda" at TP > 1 means one GPU per rank: rank R takes cuda:(R mod the GPUs of this host)."""
    if device == "cuda" and world_size > 1:
        import torch

        return f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return device


def served_max_len(model: ModelSettings, cfg) -> int:
    """Tokens a request may reach: --max-model-len, at most the target's max_position_embeddings."""
    return min(model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def request_bytes(target, capacity: int, num_taps: int, block: int = DEFAULT_BLOCK_TOKENS) -> int:
    """The memory one request holds in this worker at `capacity` positions: the target's state (its KV cache, and
    a recurrent family's kept inputs of a verify block of `block` tokens) and, where a drafter is fed, the tapped
    feature rows the engine keeps for it (num_taps x hidden per committed token, in the activations' dtype, kept
    for the request's life so that a restarted drafter can be resynchronised)."""
    feature_row = num_taps * target.config.hidden_size * target.embed_weight.element_size()
    return target.state_bytes_per_slot(capacity, block) + capacity * feature_row


def local_proposer(settings: VerifyCommand, device: str, target, max_running: int, vocabulary) -> LocalProposer:
    """The drafter in the verify worker's own process, sharing the target's embedding and lm_head (and the
    grammar vocabulary: it drafts constrained requests under their grammars)."""
    model = settings.model
    drafter = load_drafter(model.draft, dtype=target.embed_weight.dtype, device=device)
    checkpoint_dtype = TargetFacts.from_config(read_config(model.target)).checkpoint_dtype
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=model.block_size,
                             max_requests=max_running, max_model_len=served_max_len(model, target.config),
                             draft_sampling=DraftSampling(settings.speculation.draft_sampling),
                             layout=kernel_layout(model.dtype, checkpoint_dtype, device), grammar_vocabulary=vocabulary)
    # its calls and the target's alternate: on the target's pool where it has one
    proposer.share_kernel_threads(settings.threads.kernel_threads or usable_cores(), getattr(target, "pool", None))
    return proposer


def budget_pages(settings: VerifyCommand, target, planned: int | None, draft_cfg: DraftConfig | None) -> int | None:
    """A paged cache's pool: the plan's pages, at most what --kv-cache-budget-mb holds (None: the engine's default,
    every slot at the context)."""
    budget = settings.engine.kv_cache_budget_mb
    if budget is None:
        return planned
    block = (settings.model.block_size or draft_cfg.block_size) if draft_cfg else 1
    pages = int(budget * 2**20 // target.state_bytes_per_slot(PAGE_SIZE, block))
    max_len = served_max_len(settings.model, target.config)
    needed = -(-(max_len + block) // PAGE_SIZE)
    if pages < needed:
        raise DFlashError(f"--kv-cache-budget-mb {budget} holds no request of {max_len} tokens ({pages} KV pages of "
                          f"{PAGE_SIZE} positions; one request takes {needed}): raise it or lower --max-model-len")
    return pages if planned is None else min(pages, planned)


def fitting_requests(settings: VerifyCommand, target, draft_cfg: DraftConfig | None, log) -> int:
    """--max-running, lowered to the requests --kv-cache-budget-mb holds (KV cache and drafter feature rows) where
    the cache is a slot a request (a paged cache's pool takes the budget instead: budget_pages)."""
    engine, max_running = settings.engine, settings.engine.max_running
    if engine.kv_cache_budget_mb is None or getattr(target, "takes_pages", False):
        return max_running
    max_len = served_max_len(settings.model, target.config)
    block = (settings.model.block_size or draft_cfg.block_size) if draft_cfg else 1
    slot_bytes = request_bytes(target, max_len + block, len(draft_cfg.target_layer_ids) if draft_cfg else 0, block)
    fit = int(engine.kv_cache_budget_mb * 2**20 // slot_bytes)
    if fit < 1:
        raise DFlashError(f"--kv-cache-budget-mb {engine.kv_cache_budget_mb} holds no request of {max_len} tokens "
                          f"({slot_bytes / 2**20:.1f} MiB each: KV cache and the drafter's feature rows): raise it or "
                          f"lower --max-model-len")
    if fit < max_running:
        log.warning("KV-cache budget (KV cache and drafter feature rows) fits %d requests: max running lowered "
                    "from %d", fit, max_running)
    return min(fit, max_running)


def build_server(settings: VerifyCommand, log) -> VerifyServer:
    model, engine_settings, speculation, parallel = (settings.model, settings.engine, settings.speculation,
                                                     settings.parallel)
    if not model.target:
        raise DFlashError("--target is required")
    if engine_settings.batch_invariant and batch_invariant_refusal(model.device):
        raise DFlashError(batch_invariant_refusal(model.device))
    device = rank_device(model.device, parallel.rank, parallel.world_size)
    planned = planned_requests(settings, device, log)  # before a tensor is read: refused here if nothing fits
    tp = join_group(GroupSettings(parallel.rank, parallel.world_size, parallel.master_addr, parallel.master_port,
                                  parallel.tp_backend, parallel.collective_timeout), device)
    target = load_target(model.target, device=device, dtype=model.dtype, tp=tp,
                         kernel_threads=settings.threads.kernel_threads or usable_cores(),
                         batch_invariant=engine_settings.batch_invariant)
    if model.dtype == "bfloat16" and target.embed_weight.dtype != torch.bfloat16:  # shared.dtype_choice.as_served
        log.info("--dtype bfloat16 runs as --dtype auto on this CPU: the C++ kernels over the checkpoint's bfloat16 "
                 "weights (float32 sums; bfloat16 products on AMX) with a bfloat16 KV cache, where PyTorch's own "
                 "bfloat16 ops run several times slower")
    if tp.rank > 0:
        log.info("tensor-parallel rank %d of %d: following rank 0", tp.rank, tp.world_size)
        return FollowerServer(target, log)
    if tp.parallel:
        target = TargetLeader(target)
    draft_cfg = DraftConfig.from_dict(read_config(model.draft)) if settings.drafting else None
    max_running = min(fitting_requests(settings, target, draft_cfg, log), planned)
    vocabulary = target_grammar_vocabulary(model.target, target.config.vocab_size, log)
    proposer = None
    if settings.drafting and speculation.draft_placement == "local":
        proposer = local_proposer(settings, device, target, max_running, vocabulary)
        log.info("drafter %s runs in this process (%s, block size %d)", model.draft, proposer.kind,
                 proposer.block_size)
    elif settings.drafting:
        wire = settings.transport
        transport = make_transport(wire.feature_transport, wire.feature_pair_addr, sender=True, device=device,
                                   backend=wire.feature_pair_backend, timeout_s=wire.feature_pair_timeout)
        deadline = DraftDeadline(cap_s=speculation.draft_timeout, floor_s=speculation.draft_deadline_floor)
        proposer = RemoteProposer(settings.channels.draft_addr, draft_cfg, model.block_size, log=log,
                                  transport=transport, deadline=deadline)
    policy = AdaptiveSpeculation() if speculation.spec_policy == "adaptive" else None
    kv_pages = budget_pages(settings, target, planned_pool_pages(settings, device, max_running), draft_cfg) \
        if getattr(target, "takes_pages", False) else None
    engine = SpeculativeEngine(target, proposer, max_requests=max_running, max_model_len=model.max_model_len,
                               max_prefill_tokens=engine_settings.max_prefill_tokens, policy=policy,
                               step_buckets="cuda-graphs" if engine_settings.cuda_graphs else None,
                               grammar_vocabulary=vocabulary, grammar_drafts=speculation.grammar_drafts,
                               prefix_caching=not engine_settings.no_prefix_caching, kv_pages=kv_pages)
    log_cache(log, model.target, target, engine, max_running, engine_settings.no_prefix_caching)
    if engine_settings.cuda_graphs:  # every decode step shape captured now, so that no request waits for a capture
        engine.warm_up(progress=log.info)
    metrics = VerifyMetrics(proposer.kind if proposer else "none")
    server = VerifyServer(engine, settings.channels.requests_addr, settings.channels.events_addr, metrics,
                          engine_settings.max_waiting, log, keep_alive=target.keep_alive if tp.parallel else None,
                          stall_s=engine_settings.stall_timeout)
    if settings.metrics.metrics_port:
        start_http_server(settings.metrics.metrics_port, addr=settings.metrics.metrics_host, registry=metrics.registry)
    return server


def log_cache(log, path: str, target, engine: SpeculativeEngine, max_running: int, no_caching: bool) -> None:
    """The start-up lines on the target's cache: its pool (paged) or slots, and prefix caching."""
    capacity, block = engine.state.capacity, max(engine.block_size, 1)
    per_request = target.state_bytes_per_slot(capacity, block)
    features = request_bytes(target, capacity, len(engine.tap_layers), block) - per_request
    state = engine.state
    if engine.pages is not None:
        log.info("target %s: %d layers, KV cache paged: %d pages of %d positions (%.1f MiB each, %.2f GiB, taken as "
                 "first used: %d tokens at once) shared by up to %d requests of %d positions; drafter feature rows up "
                 "to %.1f MiB per request", path, target.config.num_layers, state.num_pages, state.page_size,
                 state.page_bytes() / 2**20, state.num_pages * state.page_bytes() / 2**30,
                 state.num_pages * state.page_size, max_running, capacity, features / 2**20)
    else:
        log.info("target %s: %d layers, cache %d slots x %d positions (%.1f MiB: %.1f MiB per request, %.1f KiB per "
                 "token); drafter feature rows up to %.1f MiB per request", path, target.config.num_layers,
                 max_running, capacity, state.nbytes() / 2**20, per_request / 2**20, per_request / capacity / 2**10,
                 features / 2**20)
    if engine.pages is not None and engine.pages.caching:
        caching = (f"on (pages of {state.page_size} committed tokens indexed for later prompts: full ones as they "
                   f"fill, an ended request's last one too)")
    elif engine.prefix_cache is not None:
        caching = "on (finished requests' slots keep their prefixes for later prompts)"
    elif no_caching:
        caching = "off (--no-prefix-caching)"
    else:
        caching = f"off ({type(target).__name__} keeps a recurrent state, not a positional cache)"
    log.info("prefix caching: %s", caching)


def main(argv=None) -> int:
    settings = parse_args(argv)
    log = configure_process("verify", settings.threads.threads)
    return run_worker("verify", "dflash-verify-worker", lambda: build_server(settings, log), _ready_detail)


def _ready_detail(server) -> str:
    if isinstance(server, FollowerServer):
        return f"rank={server.target.tp.rank}"
    return f"max_model_len={server.engine.max_model_len}"


if __name__ == "__main__":
    sys.exit(main())
