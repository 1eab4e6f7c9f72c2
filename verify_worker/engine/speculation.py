"""Speculation in a step: which rows must draft, the draft call (features, anchors, counts) and its proposals,
the shadow drafts of a greedy probe scored against what was committed, and what the policy is told."""

import contextlib
import time
from dataclasses import dataclass

import torch

from shared.cpu_kernels.library import pool_awake
from shared.proposals import DraftItem, ProposerUnavailable
from verify_worker.request import RequestState, Status, StepReport
from verify_worker.scheduler import num_drafts


@dataclass(frozen=True)
class StepPlan:
    """What a decode step does, as planned before drafting: whether it speculates, which rows are pinned to
    drafting, the drafts each row asks for, and whether it is a scored probe (drafts kept, not verified)."""

    speculate: bool
    pinned: list[bool]
    asked: list[int]
    scored: bool


class Speculation:
    """The engine's drafting and its policy's measurements (a part of SpeculativeEngine)."""

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

    def _plan(self, states: list[RequestState], report: StepReport) -> StepPlan:
        """The policy asked once for the step: whether it speculates, and how many drafts each row asks for. It
        decides for the rows that leave it the choice (not pinned, not asking for 0 drafts); a pinned row drafts
        whatever it says (without a policy every row is pinned, so `free` implies one). A probe of greedy
        requests drafts only the rows it measures (see AdaptiveSpeculation.probe_rows)."""
        pinned = [self._pins_drafts(s) for s in states]
        free = any(not pin and s.request.num_speculative_tokens != 0 for s, pin in zip(states, pinned))
        speculate = self.policy is None or (self.policy.speculate([s.request_id for s in states]) if free
                                            else any(pinned))
        report.policy_plain = free and not speculate
        asked = [num_drafts(s, self.block_size, self.proposer is not None and (speculate or pin))
                 for s, pin in zip(states, pinned)]
        scored = free and speculate and self.policy.probing is not None and all(
            s.request.sampling.greedy for s, pin in zip(states, pinned) if not pin)
        if scored:
            measured = set(self.policy.probing)
            asked = [a if pin or s.request_id in measured else 0 for a, s, pin in zip(asked, states, pinned)]
        return StepPlan(speculate, pinned, asked, scored)

    def _keep_probe_drafts(self, plan: StepPlan, states: list[RequestState], drafts: torch.Tensor,
                           counts: list[int], report: StepReport) -> tuple[torch.Tensor, list[int]]:
        """A scored probe's free rows keep their drafts to be scored later, not verified: (the drafts and counts
        left to verify, the pinned rows')."""
        if not plan.scored:
            return drafts, counts
        self._remember_shadow_drafts(states, drafts, [0 if pin else c for c, pin in zip(counts, plan.pinned)])
        counts = [c if pin else 0 for c, pin in zip(counts, plan.pinned)]
        report.policy_plain = True
        return drafts[:, : max(counts, default=0)], counts

    def _record(self, plan: StepPlan, states: list[RequestState], counts: list[int], committed: list[int],
                report: StepReport) -> None:
        """What the step did, told to the policy once: its time and commits, and the acceptance of the probes'
        drafts whose positions are now committed."""
        if self.policy is not None:
            self._observe(states, plan.speculate, plan.asked, counts, committed, report)
            self._score_shadow_drafts(states)

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
