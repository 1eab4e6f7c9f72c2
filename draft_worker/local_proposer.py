"""The in-process proposer: a DFlash drafter with a per-request context cache, all requests drafted in one
batched forward. Used by dflash-generate and tests; the draft worker process serves the same logic remotely."""

import heapq
import time
from enum import Enum

import torch

from draft_worker.dflash2_model import DFlash2DraftModel
from draft_worker.draft_model import DFlashDraftModel
from draft_worker.grammar_drafting import DraftGrammars, masked_drafts, token_chooser, walk_chooser
from shared.cpu_kernels.library import WorkerPool, pool_awake
from shared.errors import ConfigError
from shared.kv_cache import consecutive_range
from shared.packed_linear import PackedLinear, packed_head
from shared.proposals import DraftItem, DraftResult
from shared.sampling import batch_sampling_probs, request_generator, sample_from

DRAFT_STREAM = 1  # random stream ids of the drafter's draws are odd (the verifier uses 0)


def draft_stream(item: DraftItem) -> int:
    """The random stream of a request's drafts from this call on: one per context length it starts at."""
    return DRAFT_STREAM + 2 * (item.context_start + len(item.context_features))


SAMPLE_GROUP_ELEMENTS = 2**22  # probabilities drawn from in one batched call (float64 sums: 32 MiB)


class DraftSampling(Enum):
    DENSE = "dense"  # sample from the full processed drafter distribution q; report q
    SPARSE = "sparse"  # sample from q restricted to its top-K tokens; report that sparse q
    GREEDY = "greedy"  # argmax drafts; the verifier treats them as point masses


class LocalProposer:
    available = True  # in the caller's process it always answers (RemoteProposer's flag, for the same reports)

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        block_size: int | None = None,
        max_requests: int = 64,
        max_model_len: int = 4096,
        draft_sampling: DraftSampling = DraftSampling.DENSE,
        sparse_top_k: int = 16,
        layout: str | None = "auto",
        grammar_vocabulary=None,
    ):
        """layout: how the drafter and the head pack their projections (shared.packed_linear.kernel_layout:
        "amx" for bfloat16 products; "auto" for the device's default). grammar_vocabulary: the target's tokenizer
        as grammars see it (shared.grammar.grammar_vocabulary): constrained requests are drafted under their
        grammar (draft_worker/grammar_drafting.py); None: drafted as any other."""
        cfg = drafter.config
        if embed_weight.shape[1] != cfg.hidden_size:
            raise ConfigError(
                f"target hidden size {embed_weight.shape[1]} does not match the drafter's hidden_size {cfg.hidden_size}"
            )
        if embed_weight.shape[0] != cfg.vocab_size or lm_head_weight.shape[0] != cfg.vocab_size:
            raise ConfigError(
                f"target vocabulary {embed_weight.shape[0]} does not match the drafter's vocab_size {cfg.vocab_size}"
            )
        self.block_size = block_size or cfg.block_size
        if self.block_size < 2:
            raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        self.drafter = drafter.pack(layout)  # the proposer owns it from here: packed for inference
        self.target_layer_ids = cfg.target_layer_ids
        self.num_target_layers = cfg.num_target_layers
        dtype = next(drafter.parameters()).dtype  # the target's head may be shared in another dtype
        self.embed_weight = embed_weight.to(dtype)
        self.lm_head_weight = self.embed_weight if lm_head_weight is embed_weight else lm_head_weight.to(dtype)
        self.lm_head = packed_head(self.lm_head_weight, layout)  # the drafter's logits: the target's head
        # DFlash 2's greedy drafts from the block's hidden states in one call, where the kernels take them
        self.native_walk = (self.drafter.native_walk(self.lm_head) if isinstance(self.drafter, DFlash2DraftModel)
                            else None)
        self.draft_sampling = draft_sampling
        self.sparse_top_k = sparse_top_k
        self.cache = drafter.new_cache(max_requests, max_model_len + self.block_size)
        self.free_slots = list(range(max_requests))  # a heap
        self.slots: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.last_timing: dict[str, float] = {}
        self.ingest_seconds = 0.0  # of the last call
        self.last_used: dict[str, int] = {}  # request id -> call counter of its last draft
        self.clock = 0
        self.pool = None  # the threads the drafter's C++ projections and the head share (share_kernel_threads)
        self.owns_pool = False
        self.grammars = None if grammar_vocabulary is None else DraftGrammars(grammar_vocabulary)

    @property
    def masks_grammars(self) -> bool:
        """Whether constrained requests' drafts obey their grammars (the engine then drafts them, forced
        continuations included, rather than proposing the grammar's forced tokens alone)."""
        return self.grammars is not None

    def share_kernel_threads(self, threads: int, pool: WorkerPool | None = None) -> None:
        """Run the drafter's C++ projections and the lm_head on `threads` threads (the caller's included; 1: its
        alone), the same bits whatever the count. pool: run them on this pool instead (the target's, whose calls
        alternate with the drafter's: one set of helper threads, kept awake across a step). Nothing where the
        drafter is not on the C++ kernels."""
        if self.pool is not None and self.owns_pool:
            self.pool.close()
        kernels = self.drafter.kernels
        self.owns_pool = pool is None and kernels is not None and threads > 1
        self.pool = None if kernels is None else pool if pool is not None else (
            kernels.worker_pool(threads) if threads > 1 else None)
        self.drafter.pool = self.pool  # its one-call block (draft_block.cpp)
        for module in [*self.drafter.modules(), self.lm_head]:
            if isinstance(module, PackedLinear) and module.kernels is not None:
                module.pool = self.pool

    @property
    def kind(self) -> str:
        """"dflash" or "dflash2", as the draft worker's pong reports it."""
        return self.drafter.config.kind

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self.free_slots, slot)
        self.lengths.pop(request_id, None)
        self.generators.pop(request_id, None)
        self.last_used.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def _evict_least_recent(self, protect: set[str]) -> None:
        """Free the slot of the request drafted longest ago (its release may have been lost while this
        worker was unreachable); should it come back, it resends its context."""
        candidates = [r for r in self.slots if r not in protect]
        if not candidates:
            raise RuntimeError(f"drafter cache is full: one call drafts more than {len(self.slots)} requests")
        self.release(min(candidates, key=lambda r: self.last_used.get(r, 0)))

    def _in_sync(self, item: DraftItem, protect: set[str]) -> bool:
        """Claim a slot for a new request; False when the item's context does not continue the cache (the
        drafter restarted, or lost the request): the verifier must resend the context from position 0."""
        if item.request_id not in self.slots:
            if item.context_start != 0:
                return False
            if not self.free_slots:
                self._evict_least_recent(protect)
            self.slots[item.request_id] = heapq.heappop(self.free_slots)  # low slots first: see propose
            self.lengths[item.request_id] = 0
            # a stream of its own for every start: a request whose context is rebuilt after a restart or an
            # eviction must not draw again the numbers that drew its earlier drafts
            self.generators[item.request_id] = request_generator(item.seed, draft_stream(item))
        # A context that restarts earlier simply rewrites those positions (the cache is positional).
        return item.context_start <= self.lengths[item.request_id]

    @torch.inference_mode()
    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        with pool_awake(self.pool):
            return self._propose(items)

    def _propose(self, items: list[DraftItem]) -> list[DraftResult]:
        started = time.perf_counter()
        protect = {item.request_id for item in items}
        synced = [item for item in items if self._in_sync(item, protect)]
        self.clock += 1
        for item in synced:
            self.last_used[item.request_id] = self.clock
        results = {item.request_id: DraftResult(tokens=None) for item in items}
        self.ingest_seconds = 0.0
        matchers = {}
        if self.grammars is not None:
            for item in list(synced):
                sync = self.grammars.sync(item)
                if sync.resync:  # its grammar copy is lost: it resends its context and grammar from the start
                    self.release(item.request_id)
                    synced.remove(item)
                elif sync.matcher is not None:
                    matchers[item.request_id] = sync.matcher
        if synced:
            # in slot order: consecutive slots are read from the cache as a view, other sets as a gathered copy
            synced.sort(key=lambda item: self.slots[item.request_id])
            results.update(zip((i.request_id for i in synced), self._draft(synced, matchers)))
        # ingest: of the draft time, writing the context rows into the cache (what a large call adds to a steady one)
        self.last_timing = {"draft": time.perf_counter() - started, "transfer": 0.0, "ingest": self.ingest_seconds}
        return [results[item.request_id] for item in items]

    def _draft(self, items: list[DraftItem], matchers: dict) -> list[DraftResult]:
        """Every item's drafts from one forward of their blocks; matchers: the grammar state of the constrained
        items, by request id."""
        device = self.embed_weight.device
        slot_list = [self.slots[item.request_id] for item in items]
        slots = torch.tensor(slot_list, device=device)
        started = time.perf_counter()
        self._ingest(items, slots)
        self.ingest_seconds = time.perf_counter() - started
        start_list = [self.lengths[item.request_id] for item in items]
        starts = torch.tensor(start_list, device=device)  # [b]
        anchors = torch.tensor([item.anchor_token for item in items], device=device)
        # The block only needs as many rows as the longest draft asked for (a request capped by
        # num_speculative_tokens or near its max_tokens drafts a shorter block, and cheaper).
        block = min(self.block_size, max(item.num_draft for item in items) + 1)
        block_ids = torch.full((len(items), block), self.drafter.config.mask_token_id, device=device)
        block_ids[:, 0] = anchors  # [b, block]: anchor then masks
        embeds = self.embed_weight[block_ids]  # [b, block, hidden]
        if self.drafter.config.input_embedding_scale != 1.0:
            embeds = embeds * self.drafter.config.input_embedding_scale
        hidden = self.drafter.block_hidden(  # [b, B, hidden]; the host's facts: nothing read back from a GPU
            self.cache, slots, starts, embeds, key_length=max(start_list) + block,
            slot_range=consecutive_range(slot_list))
        if not matchers:
            return self._choose_all(items, hidden, anchors)
        constrained = [r for r, item in enumerate(items) if item.request_id in matchers]
        free = [r for r in range(len(items)) if r not in constrained]
        results: list[DraftResult | None] = [None] * len(items)
        if free:
            rows = torch.tensor(free, device=device)
            for r, result in zip(free, self._choose_all([items[r] for r in free], hidden[rows], anchors[rows])):
                results[r] = result
        rows = torch.tensor(constrained, device=device)
        logits = self.drafter.logits(hidden[rows, 1:], self.lm_head)  # [c, B-1, vocab]
        for i, r in enumerate(constrained):
            results[r] = self._grammar_draft(items[r], matchers[items[r].request_id], hidden[r, 1:], logits[i])
        return results

    def _grammar_draft(self, item: DraftItem, matcher, hidden: torch.Tensor, logits: torch.Tensor) -> DraftResult:
        """One constrained request's drafts, each position chosen under its grammar's mask (grammar_drafting):
        hidden [B-1, H] and logits [B-1, vocab] of its drafted rows."""
        uniforms = None
        if self._samples(item):
            uniforms = torch.rand(item.num_draft, generator=self.generators[item.request_id], dtype=torch.float64)
        if isinstance(self.drafter, DFlash2DraftModel):
            k = self.drafter.sample_top_k if uniforms is not None else self.drafter.top_k
            projected = self.drafter.candidate_selector.hidden_projection(hidden)  # [B-1, r]
            choose = walk_chooser(self.drafter, projected, logits, item.sampling.temperature, uniforms, k)
        else:
            sparse = self.sparse_top_k if self.draft_sampling == DraftSampling.SPARSE else None
            choose = token_chooser(item.sampling, uniforms, sparse)
        return masked_drafts(matcher, logits, item.num_draft, item.anchor_token, choose)

    def _choose_all(self, items: list[DraftItem], hidden: torch.Tensor, anchors: torch.Tensor) -> list[DraftResult]:
        """Drafts of unconstrained items from hidden [b, B, H] of their blocks and their anchors [b]."""
        if self.native_walk is not None and not any(self._samples(item) for item in items):
            tokens = self.drafter.greedy_walk(self.native_walk, hidden, anchors)  # [b, B-1], or None
            if tokens is not None:
                return [DraftResult(tokens=tokens[i, : item.num_draft].clone()) for i, item in enumerate(items)]
        logits = self.drafter.logits(hidden[:, 1:], self.lm_head)  # [b, B-1, vocab]
        if isinstance(self.drafter, DFlash2DraftModel):
            return self._walk(items, hidden[:, 1:], logits, anchors)
        return self._choose(items, logits)

    def _samples(self, item: DraftItem) -> bool:
        """Whether this request's drafts are drawn from q (else they are greedy point masses)."""
        return self.draft_sampling != DraftSampling.GREEDY and not item.sampling.greedy

    def _walk(self, items: list[DraftItem], hidden: torch.Tensor, logits: torch.Tensor,
              anchors: torch.Tensor) -> list[DraftResult]:
        """DFlash 2: the selector walks one path through each row's candidates (the top selector_top_k for
        greedy rows, the top sample_top_k for sampled ones); sampled requests get the sparse q over those
        candidates that each token was drawn from."""
        sampled = [self._samples(item) for item in items]
        results: list[DraftResult | None] = [None] * len(items)
        greedy_rows = [r for r, s in enumerate(sampled) if not s]
        if greedy_rows:
            rows = _rows(greedy_rows, len(items), logits.device)  # every row: no copy of [b, n, vocab] logits
            tokens, _, _ = self.drafter.walk(hidden[rows], logits[rows], anchors[rows],
                                             torch.zeros(len(greedy_rows), device=logits.device), None)
            for i, row in enumerate(greedy_rows):
                results[row] = DraftResult(tokens=tokens[i, : items[row].num_draft].clone())
        sampled_rows = [r for r, s in enumerate(sampled) if s]
        if sampled_rows:
            index = _rows(sampled_rows, len(items), logits.device)
            uniforms = torch.full((len(sampled_rows), logits.shape[1]), 0.5, dtype=torch.float64)
            for i, row in enumerate(sampled_rows):
                item = items[row]
                uniforms[i, : item.num_draft] = torch.rand(item.num_draft, generator=self.generators[item.request_id],
                                                           dtype=torch.float64)
            # Only the temperature shapes the selector's q (any q is lossless): also cutting it with the
            # request's top-p measured lower acceptance on the demo pair (1.37 against 1.51, temperature 1).
            temperatures = torch.tensor([items[r].sampling.temperature for r in sampled_rows], device=logits.device)
            tokens, q, candidates = self.drafter.walk(hidden[index], logits[index], anchors[index], temperatures,
                                                      uniforms.to(logits.device), k=self.drafter.sample_top_k)
            for i, row in enumerate(sampled_rows):
                n = items[row].num_draft
                results[row] = DraftResult(tokens=tokens[i, :n].clone(), q_probs=q[i, :n], q_ids=candidates[i, :n])
        return results

    def _ingest(self, items: list[DraftItem], slots: torch.Tensor) -> None:
        rows = [item.context_features for item in items if len(item.context_features)]
        if len(items) == 1 and rows:  # one request (every step at concurrency 1): its rows are consecutive
            start, count = items[0].context_start, len(rows[0])
            row_slots = torch.full((count,), self.slots[items[0].request_id], device=slots.device)
            positions = torch.arange(start, start + count, device=slots.device)  # [rows]
        elif rows:
            counts = torch.tensor([len(item.context_features) for item in items], device=slots.device)
            starts = torch.tensor([item.context_start for item in items], device=slots.device)
            row_slots = slots.repeat_interleave(counts)
            offsets = torch.arange(int(counts.sum()), device=slots.device) - (counts.cumsum(0) - counts).repeat_interleave(counts)
            positions = starts.repeat_interleave(counts) + offsets  # [rows]
        if rows:
            # the target may compute in another dtype; frames (and a gloo pair) arrive in host memory
            features = torch.cat(rows).to(self.embed_weight.device, self.embed_weight.dtype)
            self.drafter.ingest_context(self.cache, row_slots, positions, features)
        for item in items:
            self.lengths[item.request_id] = item.context_start + len(item.context_features)

    def _choose(self, items: list[DraftItem], logits: torch.Tensor) -> list[DraftResult]:
        """Greedy rows take the argmax; sampled rows draw each position from the processed q (batched over the
        rows, in groups that keep a dense q's float64 sums bounded; each row's uniforms from its own stream)."""
        greedy_tokens = logits.argmax(-1)  # [b, B-1]
        results: list[DraftResult | None] = [None] * len(items)
        sampled = [i for i, item in enumerate(items) if self._samples(item)]
        if sampled:
            probs = batch_sampling_probs(logits[sampled], [items[i].sampling for i in sampled])  # [s, B-1, vocab]
            width, vocab = probs.shape[1:]
            uniforms = torch.zeros(len(sampled), width, dtype=torch.float64)  # positions past a row's drafts: unused
            for j, row in enumerate(sampled):
                n = items[row].num_draft
                uniforms[j, :n] = torch.rand(n, generator=self.generators[items[row].request_id], dtype=torch.float64)
            uniforms = uniforms.to(probs.device)
            group = max(1, SAMPLE_GROUP_ELEMENTS // (width * vocab))
            for start in range(0, len(sampled), group):
                for j, result in enumerate(self._draw(probs[start:start + group], uniforms[start:start + group]),
                                           start):
                    row = sampled[j]
                    n = items[row].num_draft
                    results[row] = DraftResult(*(part[:n] for part in result))
        for row, item in enumerate(items):
            if results[row] is None:
                results[row] = DraftResult(tokens=greedy_tokens[row, : item.num_draft].clone())
        return results

    def _draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """probs [g, B-1, vocab], uniforms [g, B-1] -> per row (tokens, q_probs[, q_ids]) over all B-1 positions."""
        if self.draft_sampling == DraftSampling.SPARSE:
            top_probs, top_ids = probs.topk(min(self.sparse_top_k, probs.shape[-1]), dim=-1)  # [g, B-1, K]
            top_probs = top_probs / top_probs.sum(-1, keepdim=True)
            choice = sample_from(top_probs, uniforms)  # [g, B-1]
            tokens = top_ids.gather(-1, choice[..., None])[..., 0]
            return list(zip(tokens, top_probs, top_ids))
        return list(zip(sample_from(probs, uniforms), probs))


def _rows(rows: list[int], batch: int, device) -> "slice | torch.Tensor":
    """An index of these batch rows: a slice where they are all of them (a view), else a tensor (a copy)."""
    return slice(None) if rows == list(range(batch)) else torch.tensor(rows, device=device)
