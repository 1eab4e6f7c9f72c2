"""The speculative engine: prefill, draft, verify, commit and roll back for a batch of requests.

One engine serves both placements: dflash-generate drives it with an in-process proposer, the verify worker
with a remote one. Without a proposer, with num_speculative_tokens 0, or while the proposer is unavailable,
a step is plain decoding: the same code path with zero drafts.

Continuous batching: requests may be added or aborted between steps. Each step prefills prompt chunks (at
most max_prefill_tokens in all, so a long prompt does not stall running streams) in one target forward, then
decodes every running request in one more.

Fault isolation: a step that raises is undone (`RequestSnapshot`) and its requests are stepped again in
halves, recursively, so that only a request that fails a step on its own is failed; every other request
advances by exactly one step, each half being an ordinary step for its requests.
"""

import contextlib
import heapq
import logging
import time

import torch

from shared.channel_gateway import MAX_TOP_LOGPROBS
from shared.cpu_kernels.library import WorkerPool, pool_awake
from shared.errors import ConfigError, RequestError, WorkerFault
from shared.kv_cache import consecutive_range
from shared.proposals import DraftItem, Proposer, ProposerUnavailable
from shared.request_limits import is_int64
from shared.sampling_params import SamplingParams
from verify_worker.families.interface import StepBatch, TargetFamily
from verify_worker.logprobs import TokenLogprob, token_logprobs
from verify_worker.request import GenerationRequest, GenerationResult, RequestState, Status, StepEvent, StepReport
from verify_worker.request_snapshot import RequestSnapshot
from verify_worker.scheduler import num_drafts, padding_groups, plan_prefill
from verify_worker.spec_policy import AdaptiveSpeculation
from verify_worker.step_buckets import StepBuckets
from verify_worker.verify_inputs import verify_block_rows


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetFamily,
        proposer: Proposer | None = None,
        max_requests: int = 16,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 2048,
        policy: AdaptiveSpeculation | None = None,
        step_buckets: str | None = None,
    ):
        """step_buckets: None runs each decode step at its own shape; "eager" pads it to a bucket
        (verify_worker/step_buckets.py), "cuda-graphs" too and replays one CUDA graph per bucket (a CUDA target
        whose family takes padded steps)."""
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
        self.tap_layers = tuple(proposer.target_layer_ids) if proposer else ()
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_requests = max_requests
        if step_buckets not in (None, "eager", "cuda-graphs"):
            raise ConfigError(f"step buckets must be None, 'eager' or 'cuda-graphs', got {step_buckets!r}")
        if step_buckets is not None and not getattr(target, "graphable_steps", False):
            raise ConfigError(f"{type(target).__name__} does not take padded steps (CUDA graphs): its state commits "
                              f"tokens, or its step is mirrored on other ranks")
        # a padded step's extra rows write into one more slot, which no request holds
        self.state = target.new_state(max_requests + (step_buckets is not None),
                                      self.max_model_len + max(self.block_size, 1))
        self.free_slots = list(range(max_requests))  # a heap (see _take_slot)
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
        self.shadow_drafts: dict[str, tuple[int, list[int]]] = {}  # request -> (output index, drafts) of a probe
        self.log = logging.getLogger("dflash.engine")

    def warm_up(self, progress=None) -> int:
        """Before any request: every decode step shape run once, or captured as a CUDA graph (step_buckets
        "cuda-graphs"), so no request waits for a capture. Returns the shapes done (0 without step buckets)."""
        if self.buckets is None:
            return 0
        if self.running or self.waiting or self.prefilling:
            raise RuntimeError("warm_up writes slots no request may hold: call it before the first request")
        return self.buckets.warm_up(self.max_requests, progress)

    # ------------------------------------------------------------------ admission
    def add(self, request: GenerationRequest) -> RequestState:
        self.validate(request)
        state = RequestState.create(request)
        self.waiting.append(state)
        return state

    def validate(self, request: GenerationRequest) -> None:
        vocab = self.target.config.vocab_size
        if not request.prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in request.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (size {vocab})")
        if not isinstance(request.max_tokens, int) or isinstance(request.max_tokens, bool) or request.max_tokens < 0:
            raise RequestError(f"max_tokens must be an integer >= 0 (0: prefill only, e.g. to score the prompt), "
                               f"got {request.max_tokens!r}")
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds the "
                f"maximum model length {self.max_model_len}"
            )
        spec = request.num_speculative_tokens
        if spec is not None and (not is_int64(spec) or spec < 0):
            raise RequestError(f"num_speculative_tokens must be an integer from 0 to 2**63 - 1, got {spec!r}")
        if not all(is_int64(t) for t in request.stop_token_ids):
            raise RequestError("stop token ids must be 64-bit integers")
        least = request.min_tokens
        if not is_int64(least) or not 0 <= least <= request.max_tokens:
            raise RequestError(f"min_tokens must be an integer from 0 to max_tokens ({request.max_tokens}), "
                               f"got {least!r}")
        if not isinstance(request.sampling, SamplingParams):
            raise RequestError("sampling must be SamplingParams")
        top = request.logprobs
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
        if request.prompt_logprobs and top is None:
            raise RequestError("prompt log-probabilities need logprobs (a count of alternatives, 0-20)")

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its cache slot and drafter context are freed at once."""
        state = self.running.pop(request_id, None)
        for queue in (self.waiting, self.prefilling):
            if state is None:
                state = next((s for s in queue if s.request_id == request_id), None)
                if state is not None:
                    queue.remove(state)
        if state is None:
            return False
        self._free(state, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit what fits, then one step of every admitted request. A step that raises is undone and retried in
        halves of its batch; a request that fails on its own ends with finish reason "error" (its event carries
        the error), and the others advance as if nothing had happened."""
        while self.waiting and self.free_slots:
            state = self.waiting.pop(0)
            state.slot, state.status = self._take_slot(), Status.PREFILLING
            self.target.reset(self.state, state.slot)
            self.prefilling.append(state)
        groups = [[s.request_id for s in self.prefilling] + list(self.running)]
        events, self.last_reports = [], []
        # its helpers spin between the step's calls (a gap of over 2 ms without one, as the bookkeeping of a large
        # batch can take, lets them sleep: the gateway needs the cores then)
        with pool_awake(self._target_pool()):
            self._step_groups(groups, events)
        return events

    def _target_pool(self):
        """The C++ kernels' worker pool the target computes on (an optional `pool` of the family), or None."""
        pool = getattr(self.target, "pool", None)
        return pool if isinstance(pool, WorkerPool) else None

    def _step_groups(self, groups: list[list[str]], events: list[StepEvent]) -> None:
        while groups:
            group = groups.pop()
            saved = self._save(group)
            try:
                events += self._step_group(set(group))
                self.last_reports.append(self.last_report)
            except WorkerFault:
                raise
            except Exception as exc:  # noqa: BLE001 - any fault of a step is looked for in its requests
                self._restore(saved)
                self._check_device(exc)
                self._drop_pending(saved)
                if len(group) == 1:
                    events.append(self._fail(group[0], exc))
                    continue
                self.log.warning("a step of %d requests failed (%s: %s): stepping them in halves to find the "
                                 "cause", len(group), type(exc).__name__, exc)
                half = len(group) // 2
                groups += [group[half:], group[:half]]

    def observe_loop(self, seconds: float) -> None:
        """The caller's loop took `seconds` around the last step() without waiting for work: what that step cost
        beyond its decode time goes to the policy (a step with a prefill chunk says nothing about decode steps)."""
        reports = self.last_reports
        if self.policy is None or not reports or any(r.prefill_tokens or not r.decode_requests for r in reports):
            return
        self.policy.observe_overhead(seconds - sum(r.decode_seconds() for r in reports))

    def _take_slot(self) -> int:
        """The lowest free cache slot: running requests then hold few, low slots, so that a batch sorted by slot
        is often a consecutive run, whose cache rows attention reads as a view (other batches gather a copy of
        every layer's keys and values: 39 MB per step for 16 demo requests at 300 positions)."""
        return heapq.heappop(self.free_slots)  # free_slots is a heap: an engine may hold thousands of slots

    def _step_group(self, group: set[str]) -> list[StepEvent]:
        """One ordinary step of the admitted requests in group: their next prompt chunks, then their decode."""
        report = StepReport(seconds={"draft": 0.0, "transfer": 0.0, "verify": 0.0, "prefill": 0.0, "cache": 0.0})
        started = time.perf_counter()
        events: dict[str, StepEvent] = {}
        kept: dict[int, int] = {}  # slot -> tokens of this step the target keeps (committed once the step is done)
        chunks = plan_prefill([s for s in self.prefilling if s.request_id in group], self.max_prefill_tokens)
        for similar in padding_groups(chunks):  # one forward per group of similar lengths (padding costs rows)
            self._prefill(similar, events, report, kept)
        decoding = sorted((s for s in self.running.values() if s.request_id in group), key=lambda s: s.slot)
        if decoding:
            self._decode(decoding, events, report, kept)
        if kept and self.target.commits_state:  # a positional cache needs no commit: nothing to build per step
            slots = torch.tensor(list(kept), device=self.device)
            self.target.commit(self.state, slots, torch.tensor(list(kept.values()), device=self.device))
        measured = sum(report.seconds.values())
        report.seconds["scheduling"] = max(0.0, time.perf_counter() - started - measured)
        self.last_report = report
        return list(events.values())

    def _save(self, group: list[str]) -> tuple[list[str], list[str], list[RequestSnapshot]]:
        states = {s.request_id: s for s in self.prefilling} | self.running
        return list(self.running), [s.request_id for s in self.prefilling], [RequestSnapshot.take(states[r])
                                                                             for r in group]

    def _restore(self, saved: tuple[list[str], list[str], list[RequestSnapshot]]) -> None:
        """Undo a failed step for its requests: their fields, their queue (in its old order) and their slot."""
        running_order, prefilling_order, snapshots = saved
        for snapshot in snapshots:
            state = snapshot.state
            self.running.pop(state.request_id, None)
            self.prefilling = [s for s in self.prefilling if s is not state]
            if state.slot < 0 <= snapshot.slot:  # it finished in the failed step: take its slot back
                self.free_slots.remove(snapshot.slot)
                heapq.heapify(self.free_slots)
            snapshot.restore()
            if state.status == Status.RUNNING:
                self.running[state.request_id] = state
            else:
                self.prefilling.append(state)
        rank = {r: i for i, r in enumerate(running_order)}
        self.running = dict(sorted(self.running.items(), key=lambda item: rank.get(item[0], len(rank))))
        rank = {r: i for i, r in enumerate(prefilling_order)}
        self.prefilling.sort(key=lambda state: rank.get(state.request_id, len(rank)))

    def _drop_pending(self, saved) -> None:
        """The undone step committed nothing: its slots keep none of its tokens (the family drops them)."""
        slots = [snapshot.state.slot for snapshot in saved[2] if snapshot.state.slot >= 0]
        if slots and self.target.commits_state:
            self.target.commit(self.state, torch.tensor(slots, device=self.device),
                               torch.zeros(len(slots), dtype=torch.long, device=self.device))

    def _check_device(self, exc: Exception) -> None:
        """A device error (a CUDA assert) is sticky: every later step would fail too, so it is the worker's
        fault, not the request's."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as device_error:
                raise WorkerFault(f"the device failed ({device_error}) after {type(exc).__name__}: {exc}") from exc

    def _fail(self, request_id: str, exc: Exception) -> StepEvent:
        """A request that fails a step on its own: logged with its parameters and dropped, its slot freed."""
        state = self.running.pop(request_id, None) or next(s for s in self.prefilling if s.request_id == request_id)
        self.prefilling = [s for s in self.prefilling if s is not state]
        request = state.request
        self.log.error("request %s fails the step on its own and is dropped (%s: %s); prompt of %d tokens, "
                       "max_tokens %d, %s, num_speculative_tokens %s, logprobs %s, at %d tokens generated",
                       request_id, type(exc).__name__, exc, len(request.prompt_ids), request.max_tokens,
                       request.sampling, request.num_speculative_tokens, request.logprobs, len(state.output_ids),
                       exc_info=exc)
        state.finish_reason, state.error = "error", f"{type(exc).__name__}: {exc}"
        self._free(state, "error")
        return StepEvent(request_id, [], "error", state.stats, error=state.error)

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
            ids[row, :n] = torch.tensor(state.request.prompt_ids[state.prefilled: state.prefilled + n])
        starts = torch.tensor([state.prefilled for state, _ in chunks])
        # [b, width]; padding sits past each chunk, never past the cache (real positions stay < max_model_len)
        positions = (starts[:, None] + torch.arange(width)).clamp(max=self.state.capacity - 1)
        out = self._forward(ids, positions, [state.slot for state, _ in chunks], [n for _, n in chunks])
        done = [row for row, (state, n) in enumerate(chunks) if state.prefilled + n == len(state.request.prompt_ids)]
        first = None
        if done:
            last = torch.tensor([chunks[row][1] - 1 for row in done], device=self.device)
            logits = self.target.logits(out.hidden[torch.tensor(done, device=self.device), last])  # [d, vocab]
            none = torch.zeros(len(done), 0, dtype=torch.long)  # the first token: a verify step with no drafts
            first = verify_block_rows([chunks[row][0] for row in done], none, [0] * len(done), [None] * len(done),
                                      logits[:, None], self.device)[1]
        report.prefill_tokens += sum(n for _, n in chunks)
        for row, (state, n) in enumerate(chunks):
            if state.request.prompt_logprobs:
                self._score_prompt(state, out.hidden[row, :n])
            if self.proposer is not None:
                state.feature_chunks.append(out.taps[row, :n].clone())  # a copy: a view would pin the batch
            state.cache_len += n
            kept[state.slot] = kept.get(state.slot, 0) + n
        report.seconds["prefill"] += time.perf_counter() - started
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
        pinned = [self._pins_drafts(s) for s in states]
        # the policy decides for the rows that leave it the choice (not pinned, not asking for 0 drafts); a
        # pinned row drafts whatever it says (without a policy every row is pinned, so `free` implies one)
        free = any(not pin and s.request.num_speculative_tokens != 0 for s, pin in zip(states, pinned))
        speculate = self.policy is None or (self.policy.speculate([s.request_id for s in states]) if free
                                            else any(pinned))
        report.policy_plain = free and not speculate
        asked = [num_drafts(s, self.block_size, self.proposer is not None and (speculate or pin))
                 for s, pin in zip(states, pinned)]
        scored = free and speculate and self.policy.probing is not None and all(
            s.request.sampling.greedy for s, pin in zip(states, pinned) if not pin)
        if scored:  # a probe of greedy requests: only the rows it measures draft (see AdaptiveSpeculation.probe_rows)
            measured = set(self.policy.probing)
            asked = [a if pin or s.request_id in measured else 0 for a, s, pin in zip(asked, states, pinned)]
        drafts, proposals, counts = self._draft(states, asked, report)  # drafts [b, n]
        if scored:  # the free rows' drafts are kept and scored later, not verified
            self._remember_shadow_drafts(states, drafts, [0 if pin else c for c, pin in zip(counts, pinned)])
            counts = [c if pin else 0 for c, pin in zip(counts, pinned)]
            drafts = drafts[:, : max(counts, default=0)]
            report.policy_plain = True
        started = time.perf_counter()
        n = drafts.shape[1]
        block = torch.cat([torch.tensor([[s.last_token] for s in states]), drafts], dim=1)  # [b, n+1]
        positions = torch.tensor([s.cache_len for s in states])[:, None] + torch.arange(n + 1)  # [b, n+1]
        if self.buckets is not None:
            out = self.buckets.step(block, positions, [s.slot for s in states], int(positions.max()) + 1)
        else:
            out = self._forward(block, positions, [s.slot for s in states], [c + 1 for c in counts])
        logits = self.target.logits(out.hidden)  # [b, n+1, vocab]
        accepted, next_tokens = verify_block_rows(states, drafts, counts, proposals, logits, self.device)
        report.seconds["verify"] += time.perf_counter() - started
        report.decode_requests = len(states)
        report.drafted_at, report.accepted_at = [0] * n, [0] * n
        committed_in_step = []
        started = time.perf_counter()  # cache work: lengths (rollback), drafter context features, commits, frees
        for row, state in enumerate(states):
            a = accepted[row]
            state.cache_len += a + 1  # the rest of the block is rolled back (by length, or by the family's commit)
            kept[state.slot] = kept.get(state.slot, 0) + a + 1  # after this step's prompt chunk, if any
            if self.proposer is not None:
                state.feature_chunks.append(out.taps[row, : a + 1].clone())
            tokens = drafts[row, :a].tolist() + [next_tokens[row]]
            committed = self._commit(state, tokens, events, self._logprobs(state, logits[row, : a + 1], tokens))
            committed_in_step.append(committed)
            state.stats.record(counts[row], min(a, committed), committed)
            report.draft_tokens += counts[row]
            report.accepted_tokens += min(a, committed)
            for i in range(counts[row]):
                report.drafted_at[i] += 1
                report.accepted_at[i] += i < min(a, committed)
        report.seconds["cache"] += time.perf_counter() - started
        if self.policy is not None:
            self._observe(states, speculate, asked, counts, committed_in_step, report)
            self._score_shadow_drafts(states)

    def _pins_drafts(self, state: RequestState) -> bool:
        """Whether this request drafts in every step, whatever the policy prefers for the others: it asks for
        drafts itself (num_speculative_tokens > 0: the gateway's readiness probe, dflash-bench's speculative
        waves), or it is a seeded sampled request and the policy pins those (its draws depend on its schedule).
        Only its own row drafts: before, one such request made the whole batch speculate, and the readiness
        probe (a 3-token request every 2 s) turned two steps of 16 plainly decoding streams into 8-token verify
        blocks each time."""
        if self.policy is None:
            return True
        request = state.request
        seeded = request.sampling.seed is not None and not request.sampling.greedy
        return (request.num_speculative_tokens or 0) > 0 or (seeded and self.policy.pin_seeded)

    def _remember_shadow_drafts(self, states: list[RequestState], drafts: torch.Tensor, counts: list[int]) -> None:
        """A probe while plain decoding is preferred, of greedy requests only, is a plain step: its drafts are
        kept, not verified, and scored against the tokens the plain steps then commit (_score_shadow_drafts).
        Greedy verification accepts exactly the drafts that match the target's own next tokens, so this
        measures each request's acceptance length as a speculative step would, at the cost of the draft call
        alone: no 9-token verify for every row, and the requests' lengths stay in step (a verified probe
        commits different counts per request, and a wave of them then ends in small batches)."""
        for row, state in enumerate(states):
            if counts[row]:
                self.shadow_drafts[state.request_id] = (len(state.output_ids), drafts[row, : counts[row]].tolist())

    def _score_shadow_drafts(self, states: list[RequestState]) -> None:
        """Each remembered draft whose positions are all committed now (or whose request finished): its matching
        prefix a gives the request's acceptance as a verify would, a + 1 tokens for the step."""
        for state in states:
            remembered = self.shadow_drafts.get(state.request_id)
            if remembered is None:
                continue
            start, drafted = remembered
            committed = state.output_ids[start: start + len(drafted)]
            if len(committed) < len(drafted) and state.finish_reason is None:
                continue
            del self.shadow_drafts[state.request_id]
            if state.finish_reason is None:
                accepted = next((i for i, (d, t) in enumerate(zip(drafted, committed)) if d != t), len(drafted))
                self.policy.record_acceptance(state.request_id, accepted + 1)

    def _observe(self, states: list[RequestState], chosen: bool, asked: list[int], counts: list[int],
                 committed: list[int], report: StepReport) -> None:
        """Feed the policy the step. Its time measures a mode only if the step is pure: every row drafted or
        none, as asked (no fallback, no resync), no prefill in it, no draft call catching up on a prompt or on
        plain steps; those say nothing about either mode's usual cost."""
        pure = (counts == asked and not (report.fallback or report.catch_up or report.prefill_tokens)
                and (all(counts) or not any(counts)))
        seconds = report.decode_seconds()
        self.policy.observe([s.request_id for s in states], chosen, any(counts) if pure else None, seconds,
                            committed, [c > 0 for c in counts])
        for state in states:
            if state.status == Status.FINISHED:
                self.policy.forget(state.request_id)  # again: the step's own measurement re-added it

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int], lengths: list[int]):
        batch = StepBatch(ids.to(self.device), positions.to(self.device), torch.tensor(slots, device=self.device),
                          torch.tensor(lengths, device=self.device), key_length=int(positions.max()) + 1,
                          slot_range=consecutive_range(slots))
        return self.target.step(batch, self.state, self.tap_layers)

    def _draft(self, states: list[RequestState], counts: list[int], report: StepReport):
        """Ask the proposer for drafts. Returns drafts [b, n] (zero-padded), per-row proposals for sampled rows
        ((q_probs, q_ids) on this device, q_ids None for a dense q; None for a point mass or a greedy row), and the
        draft counts actually obtained (0 for rows the proposer could not serve this step)."""
        q_rows: list[tuple | None] = [None] * len(states)
        rows = [r for r, k in enumerate(counts) if k > 0]
        if not rows:
            return torch.zeros(len(states), 0, dtype=torch.long), q_rows, counts
        items = []
        for r in rows:
            state = states[r]
            unsent = state.unsent_features()
            features = torch.cat(unsent) if unsent else self._no_features()
            items.append(DraftItem(
                request_id=state.request_id, context_start=state.drafter_context_len, context_features=features,
                anchor_token=state.last_token, num_draft=counts[r], sampling=state.request.sampling, seed=state.seed,
            ))
        report.catch_up = any(len(item.context_features) > self.block_size for item in items)
        started = time.perf_counter()
        try:
            # the target's helpers rest unless the drafter computes on them (a pool the proposer shares): a drafter
            # in another process, or on its own pool, needs these cores
            shares = getattr(self.proposer, "pool", None) is self._target_pool()
            with contextlib.nullcontext() if shares else pool_awake(self._target_pool(), on=False):
                results = self.proposer.propose(items)
        except ProposerUnavailable:
            for r in rows:  # whatever reached the proposer is unknown: send every request's context again
                states[r].resend_features()
            report.fallback = True
            report.seconds["transfer"] += time.perf_counter() - started
            return torch.zeros(len(states), 0, dtype=torch.long), q_rows, [0] * len(states)
        elapsed = time.perf_counter() - started
        timing = getattr(self.proposer, "last_timing", None) or {}
        report.seconds["draft"] += timing.get("draft", elapsed)
        report.seconds["transfer"] += max(0.0, elapsed - timing.get("draft", elapsed))
        counts = list(counts)
        drafts = torch.zeros(len(states), max(counts), dtype=torch.long)
        for r, result in zip(rows, results):
            state = states[r]
            if result.tokens is None:  # the proposer lost this context: resend it with the next call
                state.resend_features()
                counts[r] = 0
                continue
            state.mark_features_sent()
            counts[r] = k = min(counts[r], len(result.tokens))  # a proposer may draft fewer (none) for a request
            if not k:
                continue
            drafts[r, :k] = result.tokens[:k].cpu()
            if not state.request.sampling.greedy and result.q_probs is not None:
                q_rows[r] = tuple(None if t is None else t[:k].to(self.device) for t in (result.q_probs, result.q_ids))
        return drafts[:, : max(counts)], q_rows, counts

    def _no_features(self) -> torch.Tensor:
        width = len(self.tap_layers) * self.target.config.hidden_size
        return torch.zeros(0, width, dtype=self.target.embed_weight.dtype, device=self.device)

    def _score_prompt(self, state: RequestState, hidden: torch.Tensor, floats_at_once: int = 1 << 24) -> None:
        """Log-probabilities of the prompt tokens that this chunk's rows (hidden [n, H], from position
        state.prefilled) predict, in slices of [rows, vocab] float32 logits of at most 64 MB (110 rows of a
        152k vocabulary, 4096 of the demo's)."""
        rows_at_once = max(1, floats_at_once // self.target.config.vocab_size)
        start, prompt = state.prefilled, state.request.prompt_ids
        rows = min(len(hidden), len(prompt) - 1 - start)  # the last prompt row predicts the first output token
        for first in range(0, rows, rows_at_once):
            last = min(rows, first + rows_at_once)
            tokens = list(prompt[start + first + 1: start + last + 1])
            state.prompt_logprobs += token_logprobs(self.target.logits(hidden[first:last]), tokens,
                                                    state.request.logprobs)

    @staticmethod
    def _logprobs(state: RequestState, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """The tokens' log-probabilities from their target logits [len(tokens), vocab], if the request asked."""
        top = state.request.logprobs
        return None if top is None else token_logprobs(logits, tokens, top)

    # ------------------------------------------------------------------ bookkeeping
    def _commit(self, state: RequestState, tokens: list[int], events: dict,
                logprobs: list[TokenLogprob] | None = None) -> int:
        """Append tokens up to a stop token or max_tokens (and their log-probabilities, when asked for); finish
        the request if it ended. Returns the count kept."""
        kept = []
        for token in tokens[: state.remaining]:
            kept.append(token)
            if token in state.request.stop_token_ids:
                state.finish_reason = "stop"
                break
        state.output_ids.extend(kept)
        if state.finish_reason is None and state.remaining == 0:
            state.finish_reason = "length"
        event = events.setdefault(state.request_id, StepEvent(state.request_id, [], None))
        event.new_token_ids.extend(kept)
        event.stats = state.stats
        if logprobs is not None:
            state.logprobs.extend(logprobs[: len(kept)])
            event.logprobs = (event.logprobs or []) + logprobs[: len(kept)]
        if state.finish_reason is not None:
            event.finish_reason = state.finish_reason
            del self.running[state.request_id]
            self._free(state, state.finish_reason)
        return len(kept)

    def _free(self, state: RequestState, reason: str) -> None:
        state.status = Status.FINISHED
        state.finish_reason = state.finish_reason or reason
        state.feature_chunks = []
        if state.slot >= 0:
            heapq.heappush(self.free_slots, state.slot)
            state.slot = -1
        if self.policy is not None:
            self.policy.forget(state.request_id)
            self.shadow_drafts.pop(state.request_id, None)
        if self.proposer is not None:
            try:
                self.proposer.release(state.request_id)
            except ProposerUnavailable:
                pass  # a restarted drafter holds nothing for this request anyway
