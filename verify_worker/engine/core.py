"""The speculative engine: prefill, draft, verify, commit and roll back for a batch of requests.

One engine serves both placements: dflash-generate drives it with an in-process proposer, the verify worker
with a remote one. Without a proposer, with num_speculative_tokens 0, or while the proposer is unavailable,
a step is plain decoding: the same code path with zero drafts.

Continuous batching: requests may be added or aborted between steps. Each step prefills prompt chunks (at
most max_prefill_tokens in all, so a long prompt does not stall running streams) in one target forward, then
decodes every running request in one more.

Its parts, one job each: admission.py (validation, queues, slots), paging.py (the KV pool's pages: admission
that waits for them, preemption where they run out; page_tables.py owns the pool and the prefix index),
isolation.py (undoing a failed step and bisecting its batch), speculation.py (drafting and the policy's
measurements), verify_inputs.py (the verify call), early_stops.py (min_tokens), output.py (commits,
log-probabilities, freeing).
"""

import logging
import time

import torch

from shared.cpu_kernels.library import WorkerPool, pool_awake
from shared.errors import ConfigError
from shared.generation_request import GenerationRequest
from shared.grammar_matcher import CompiledGrammars
from shared.kv_cache import consecutive_range
from shared.proposals import Proposer
from verify_worker.engine.admission import Admission
from verify_worker.engine.grammar_masks import GRAMMAR_DRAFTS, forced_drafts, grammar_drafts
from verify_worker.engine.isolation import Isolation
from verify_worker.engine.output import Output
from verify_worker.engine.page_tables import PAGE_SIZE, PageTables
from verify_worker.engine.paging import Paging
from verify_worker.engine.prefix_cache import PrefixCache
from verify_worker.engine.speculation import Speculation
from verify_worker.engine.verify_inputs import verify_block_rows
from verify_worker.families.interface import StepBatch, TargetFamily
from verify_worker.request import GenerationResult, RequestState, Status, StepEvent, StepReport
from verify_worker.scheduler import padding_groups, plan_prefill
from verify_worker.spec_policy import AdaptiveSpeculation
from verify_worker.step_buckets import StepBuckets


class SpeculativeEngine(Admission, Paging, Isolation, Speculation, Output):
    """A batch of requests stepped together; the step, prefill and decode are here, each part's methods in its
    own file (the parts share the engine's fields: the queues, the slots, the target's state, the policy)."""

    def __init__(
        self,
        target: TargetFamily,
        proposer: Proposer | None = None,
        max_requests: int = 16,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 2048,
        policy: AdaptiveSpeculation | None = None,
        step_buckets: str | None = None,
        grammar_vocabulary=None,
        grammar_drafts: str = "forced",
        prefix_caching: bool = True,
        page_size: int | None = PAGE_SIZE,
        kv_pages: int | None = None,
    ):
        """step_buckets: None runs each decode step at its own shape; "eager" pads it to a bucket
        (verify_worker/step_buckets.py), "cuda-graphs" too and replays one CUDA graph per bucket (a CUDA target
        whose family takes padded steps). grammar_vocabulary: the target's tokenizer as grammars see it
        (shared.grammar.grammar_vocabulary; None: requests with a grammar are refused); grammar_drafts: how a
        constrained request's drafts obey its grammar (engine/grammar_masks.py: "target", "cut", "forced",
        "masked", "drafted"). prefix_caching: prompts reuse the KV of prefixes computed before (paged: full pages
        indexed by their tokens, engine/page_tables.py; else a finished request's slot keeps its prefix,
        engine/prefix_cache.py; families whose cache is positional). page_size: positions a page of the KV cache
        holds, where the family takes pages (`takes_pages`; None: a slot of max_model_len positions a request);
        kv_pages: the pool's pages (None: enough for every request at max_model_len)."""
        cfg = target.config
        self.target = target
        self.proposer = proposer
        self.block_size = proposer.block_size if proposer else 1
        if proposer is not None:
            if proposer.num_target_layers != cfg.num_layers:
                raise ConfigError(
                    f"the drafter was built for a target of {proposer.num_target_layers} layers; "
                    f"this target has {cfg.num_layers}"
                )
            if self.block_size < 2:
                raise ConfigError(f"block size must be >= 2, got {self.block_size}")
        if max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.prefill_align = getattr(target, "prefill_align", 1)  # prompt chunks start at its multiples
        if max_prefill_tokens < self.prefill_align:
            raise ConfigError(f"max_prefill_tokens must be >= {self.prefill_align} for this target (its prompt chunks "
                              f"start at multiples of {self.prefill_align} tokens), got {max_prefill_tokens}")
        self.tap_layers = tuple(proposer.target_layer_ids) if proposer else ()
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_requests = max_requests
        if grammar_drafts not in GRAMMAR_DRAFTS:
            raise ConfigError(f"grammar drafts must be one of {GRAMMAR_DRAFTS}, got {grammar_drafts!r}")
        self.grammar_vocabulary, self.grammar_drafts = grammar_vocabulary, grammar_drafts
        self.compiled_grammars = None if grammar_vocabulary is None else CompiledGrammars(grammar_vocabulary)
        if step_buckets not in (None, "eager", "cuda-graphs"):
            raise ConfigError(f"step buckets must be None, 'eager' or 'cuda-graphs', got {step_buckets!r}")
        if step_buckets is not None and not getattr(target, "graphable_steps", False):
            raise ConfigError(f"{type(target).__name__} does not take padded steps (CUDA graphs): padding could reach "
                              f"its committed state, or its step reads the host or is mirrored on other ranks")
        # a padded step's extra rows write into one more slot, which no request holds
        slots, capacity = max_requests + (step_buckets is not None), self.max_model_len + max(self.block_size, 1)
        self.pages = None  # the page pool's owner where the cache is paged
        if page_size is not None and getattr(target, "takes_pages", False):
            per_slot = -(-capacity // page_size)
            if kv_pages is not None and kv_pages < per_slot:
                raise ConfigError(f"a KV pool of {kv_pages} pages of {page_size} positions cannot hold one request "
                                  f"of {capacity} positions ({per_slot} pages)")
            self.state = target.new_paged_state(slots, capacity, page_size, kv_pages or max_requests * per_slot)
            self.pages = PageTables(self.state, caching=prefix_caching)
        else:
            self.state = target.new_state(slots, capacity, max(self.block_size, 1))
        self.free_slots = list(range(max_requests))  # a heap (see _take_slot)
        self.prefix_cache = PrefixCache(self.prefill_align) if (prefix_caching and self.pages is None
                                                                and not target.commits_state) else None
        self.admissions = self.preemptions = 0  # requests given a slot, and taken out of the batch, since start
        self.prefix_query_tokens = self.prefix_hit_tokens = 0  # prompt tokens looked up, and found, since start
        self.buckets = None if step_buckets is None else StepBuckets(
            target, self.state, max_requests, max(self.block_size, 1), self.tap_layers,
            graphs=step_buckets == "cuda-graphs")
        self.waiting: list[RequestState] = []
        self.prefilling: list[RequestState] = []
        self.running: dict[str, RequestState] = {}  # request id -> decoding state, in admission order
        self.device = target.embed_weight.device
        self.last_report = StepReport()
        self.last_reports: list[StepReport] = []  # one per ordinary step of the last step() (more after a fault)
        self.policy = policy if proposer is not None else None  # None: every step drafts what it may
        if self.policy is not None:
            self.policy.set_block(self.block_size)
        self.log = logging.getLogger("dflash.engine")

    def warm_up(self, progress=None) -> int:
        """Before any request: every decode step shape run once, or captured as a CUDA graph (step_buckets
        "cuda-graphs"), so no request waits for a capture. Returns the shapes done (0 without step buckets)."""
        if self.buckets is None:
            return 0
        if self.running or self.waiting or self.prefilling:
            raise RuntimeError("warm_up is for start-up (a capture stalls every request): call it before the first "
                               "request")
        return self.buckets.warm_up(self.max_requests, progress)

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit what fits, then one step of every admitted request. A step that raises is undone and retried in
        halves of its batch; a request that fails on its own ends with finish reason "error" (its event carries
        the error), and the others advance as if nothing had happened."""
        while self.waiting and self.free_slots and self._fits_pages(self.waiting[0]):
            self._admit(self.waiting.pop(0))
        if self.pages is not None:
            self._reserve_pages()
        groups = [[s.request_id for s in self.prefilling] + list(self.running)]
        events, self.last_reports = [], []
        # its helpers spin between the step's calls (a gap of over 2 ms without one, as the bookkeeping of a large
        # batch can take, lets them sleep: the gateway needs the cores then)
        with pool_awake(self._target_pool()):
            self._step_groups(groups, events)
        if self.pages is not None:
            self._index_step()
        return events

    def _target_pool(self):
        """The C++ kernels' worker pool the target computes on (an optional `pool` of the family), or None."""
        pool = getattr(self.target, "pool", None)
        return pool if isinstance(pool, WorkerPool) else None

    def observe_loop(self, seconds: float) -> None:
        """The caller's loop took `seconds` around the last step() without waiting for work: what that step cost
        beyond its decode time goes to the policy (a step with a prefill chunk says nothing about decode steps)."""
        reports = self.last_reports
        if self.policy is None or not reports or any(r.prefill_tokens or not r.decode_requests for r in reports):
            return
        self.policy.observe_overhead(seconds - sum(r.decode_seconds() for r in reports))

    def _step_group(self, group: set[str]) -> list[StepEvent]:
        """One ordinary step of the admitted requests in group: their next prompt chunks, then their decode."""
        report = StepReport(seconds={"draft": 0.0, "transfer": 0.0, "verify": 0.0, "prefill": 0.0, "cache": 0.0})
        started = time.perf_counter()
        events: dict[str, StepEvent] = {}
        kept: dict[int, int] = {}  # slot -> tokens of this step the target keeps (committed once the step is done)
        chunks = plan_prefill([s for s in self.prefilling if s.request_id in group], self.max_prefill_tokens,
                              self.prefill_align)
        for similar in padding_groups(chunks):  # one forward per group of similar lengths (padding costs rows)
            self._prefill(similar, events, report, kept)
        # a state that commits tokens rolls back within one verify block: a request whose prompt ended in this
        # step's prefill decodes from the next step (its prompt chunk is committed first)
        decoding = sorted((s for s in self.running.values() if s.request_id in group
                           and not (self.target.commits_state and s.slot in kept)), key=lambda s: s.slot)
        if decoding:
            self._decode(decoding, events, report, kept)
        if kept and self.target.commits_state:  # a positional cache needs no commit: nothing to build per step
            slots = torch.tensor(list(kept), device=self.device)
            self.target.commit(self.state, slots, torch.tensor(list(kept.values()), device=self.device))
        measured = sum(report.seconds.values())
        report.seconds["scheduling"] = max(0.0, time.perf_counter() - started - measured)
        self.last_report = report
        return list(events.values())

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        states = [self.add(r) for r in requests]
        while self.has_work():
            self.step()
        failed = next((s for s in states if s.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
        return [GenerationResult(s.request_id, s.output_ids, s.finish_reason, s.stats,
                                 s.logprobs if s.request.logprobs is not None else None,
                                 s.prompt_logprobs if s.request.prompt_logprobs else None) for s in states]

    def _prefill(self, chunks: list[tuple[RequestState, int]], events: dict, report: StepReport,
                 kept: dict[int, int]) -> None:
        """One forward over the next prompt chunk of each prefilling request; requests whose prompt is now
        complete sample their first token and start decoding."""
        started = time.perf_counter()
        width = max(n for _, n in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.long)
        for row, (state, n) in enumerate(chunks):
            ids[row, :n] = torch.tensor(state.prefill_ids[state.prefilled: state.prefilled + n])
        starts = torch.tensor([state.prefilled for state, _ in chunks])
        # [b, width]; padding sits past each chunk, never past the cache (real positions stay < max_model_len)
        positions = (starts[:, None] + torch.arange(width)).clamp(max=self.state.capacity - 1)
        self._cover_pages([state.slot for state, _ in chunks], [state.prefilled + n for state, n in chunks])
        out = self._forward(ids, positions, [state.slot for state, _ in chunks], [n for _, n in chunks], prefill=True)
        ended = [row for row, (state, n) in enumerate(chunks) if state.prefilled + n == len(state.prefill_ids)]
        rebuilt = [chunks[row][0] for row in ended if chunks[row][0].rebuild is not None]  # they decode on
        done = [row for row in ended if chunks[row][0].rebuild is None]
        first = None
        if done:
            last = torch.tensor([chunks[row][1] - 1 for row in done], device=self.device)
            logits = self.target.logits(out.hidden[torch.tensor(done, device=self.device), last])  # [d, vocab]
            none = torch.zeros(len(done), 0, dtype=torch.long)  # the first token: a verify step with no drafts
            first = verify_block_rows([chunks[row][0] for row in done], none, [0] * len(done), [None] * len(done),
                                      logits[:, None], self.device)[1]
        report.prefill_tokens += sum(n for _, n in chunks)
        for row, (state, n) in enumerate(chunks):
            if state.rebuild is None:  # (a rebuild's features and scores were kept)
                if state.request.prompt_logprobs:
                    self._score_prompt(state, out.hidden[row, :n])
                if self.proposer is not None:
                    state.feature_chunks.append(out.taps[row, :n].clone())  # a copy: a view would pin the batch
            state.cache_len += n
            kept[state.slot] = kept.get(state.slot, 0) + n
        report.seconds["prefill"] += time.perf_counter() - started
        for state in rebuilt:
            self.prefilling.remove(state)
            state.rebuild, state.status = None, Status.RUNNING
            self.running[state.request_id] = state
        for i, row in enumerate(done):
            state = chunks[row][0]
            self.prefilling.remove(state)
            state.status = Status.RUNNING
            self.running[state.request_id] = state
            token = int(first[i])
            self._commit(state, [token], events, self._logprobs(state, logits[i, None], [token]))
            if state.request.prompt_logprobs:
                events[state.request_id].prompt_logprobs = state.prompt_logprobs

    def _decode(self, states: list[RequestState], events: dict, report: StepReport, kept: dict[int, int]) -> None:
        """One decode step of the running batch: plan (the policy asked once), draft, forward the block, verify,
        commit, and tell the policy what the step did."""
        plan, asked = self._plan(states, report)
        # a constrained row its grammar forces is proposed the forced tokens alone, whatever the policy said; in
        # "drafted" mode a drafter that masks grammars drafts it instead (its drafts take the forced tokens and go
        # on past them), and only the rows it did not draft are proposed their forced tokens
        drafted = self.grammar_drafts == "drafted" and getattr(self.proposer, "masks_grammars", False)
        forced = {} if drafted else forced_drafts(states, self.block_size, self.grammar_drafts)
        drafts, proposals, counts = self._draft(states, [0 if r in forced else a for r, a in enumerate(asked)],
                                                report)  # drafts [b, n]
        drafts, counts, probe_drafts = self._keep_probe_drafts(plan, states, drafts, counts, report)
        if drafted:
            undrafted = [r for r, c in enumerate(counts) if not c]
            forced = forced_drafts(states, self.block_size, self.grammar_drafts, undrafted)
        drafts, counts = grammar_drafts(states, drafts, counts, forced, self.grammar_drafts)
        report.forced_tokens = sum(counts[r] for r in forced)
        started = time.perf_counter()
        out, logits = self._forward_block(states, drafts, counts)  # logits [b, n+1, vocab]
        accepted, next_tokens = verify_block_rows(states, drafts, counts, proposals, logits, self.device)
        report.seconds["verify"] += time.perf_counter() - started
        committed = self._commit_block(states, drafts, counts, out, logits, accepted, next_tokens, events, report,
                                       kept)
        # the policy measures the drafter: a forced row counts as a plain one (and its step is not timed)
        self._record(plan, states, asked, [0 if r in forced else c for r, c in enumerate(counts)], committed,
                     probe_drafts, report)

    def _forward_block(self, states: list[RequestState], drafts: torch.Tensor, counts: list[int]):
        """The target over [last token, drafts] of every row, at each row's next positions: (output, logits)."""
        n = drafts.shape[1]
        block = torch.cat([torch.tensor([[s.last_token] for s in states]), drafts], dim=1)  # [b, n+1]
        positions = torch.tensor([s.cache_len for s in states])[:, None] + torch.arange(n + 1)  # [b, n+1]
        self._cover_pages([s.slot for s in states], [s.cache_len + c + 1 for s, c in zip(states, counts)])
        if self.buckets is not None:
            out = self.buckets.step(block, positions, [s.slot for s in states], int(positions.max()) + 1,
                                    [c + 1 for c in counts])
        else:
            out = self._forward(block, positions, [s.slot for s in states], [c + 1 for c in counts])
        return out, self.target.logits(out.hidden)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int], lengths: list[int],
                 prefill: bool = False):
        batch = StepBatch(ids.to(self.device), positions.to(self.device), torch.tensor(slots, device=self.device),
                          torch.tensor(lengths, device=self.device), key_length=int(positions.max()) + 1,
                          slot_range=consecutive_range(slots), prefill=prefill)
        return self.target.step(batch, self.state, self.tap_layers)






