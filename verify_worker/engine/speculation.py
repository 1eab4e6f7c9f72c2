"""Speculation in a step: the policy's plan (asked once), the draft call (features, anchors, counts) and its
proposals, a scored probe's drafts set aside, and the step's outcome (told once)."""

import contextlib
import time

import torch

from shared.cpu_kernels.library import pool_awake
from shared.proposals import DraftItem, ProposerUnavailable
from verify_worker.engine.grammar_masks import UNDER_GRAMMAR
from verify_worker.request import RequestState, Status, StepReport
from verify_worker.scheduler import num_drafts
from verify_worker.spec_step import RowNeed, StepOutcome, StepPlan


class Speculation:
    """The engine's drafting, and its one question and one report to the policy per decode step (a part of
    SpeculativeEngine)."""

    def _plan(self, states: list[RequestState], report: StepReport) -> tuple[StepPlan, list[int]]:
        """The step's plan, the policy asked once (without a policy every row drafts), and the drafts each row
        asks for."""
        if self.policy is None:
            plan = StepPlan.every_row(len(states))
        else:
            plan = self.policy.plan([RowNeed(
                request_id=s.request_id, asks_drafts=(s.request.num_speculative_tokens or 0) > 0,
                refuses_drafts=s.request.num_speculative_tokens == 0, greedy=s.request.sampling.greedy,
                seeded_sampled=s.request.sampling.seed is not None and not s.request.sampling.greedy,
            ) for s in states])
        report.policy_plain = plan.policy_plain
        asked = [num_drafts(s, self.block_size, self.proposer is not None and drafts)
                 for s, drafts in zip(states, plan.drafting)]
        if plan.drafts is not None:  # the policy's narrower width, for the rows that leave it the choice
            asked = [n if pin else min(n, plan.drafts) for n, pin in zip(asked, plan.pinned)]
        return plan, asked

    def _keep_probe_drafts(self, plan: StepPlan, states: list[RequestState], drafts: torch.Tensor,
                           counts: list[int], report: StepReport) -> tuple[torch.Tensor, list[int], dict]:
        """A scored probe's free rows keep their drafts to be scored later, not verified: (the drafts and counts
        left to verify, the pinned rows'; the kept drafts by request). Greedy verification accepts exactly the
        drafts that match the target's own next tokens, so scoring them against what the plain steps commit
        measures a request's acceptance as a verify would, at the cost of the draft call alone."""
        if not plan.scored:
            return drafts, counts, {}
        kept = {s.request_id: drafts[row, :c].tolist() for row, (s, c, pin) in
                enumerate(zip(states, counts, plan.pinned)) if c and not pin}
        counts = [c if pin else 0 for c, pin in zip(counts, plan.pinned)]
        report.policy_plain = True
        return drafts[:, : max(counts, default=0)], counts, kept

    def _record(self, plan: StepPlan, states: list[RequestState], asked: list[int], counts: list[int],
                committed: list[int], probe_drafts: dict, report: StepReport) -> None:
        """What the step did, told to the policy once. Its time measures a mode only if the step is pure: every
        row drafted or none, as asked (no fallback, no resync), no prefill in it, no draft call catching up on a
        prompt or on plain steps; those say nothing about either mode's usual cost."""
        if self.policy is None:
            return
        pure = (counts == asked and not (report.fallback or report.catch_up or report.prefill_tokens
                                         or report.forced_tokens)
                and (all(counts) or not any(counts)))
        self.policy.record(plan, StepOutcome(
            request_ids=[s.request_id for s in states], counts=counts, committed=committed,
            new_tokens=[s.output_ids[len(s.output_ids) - n:] if n else [] for s, n in zip(states, committed)],
            finished=[s.status == Status.FINISHED for s in states], seconds=report.decode_seconds(),
            timed=any(counts) if pure else None, probe_drafts=probe_drafts))

    def _draft(self, states: list[RequestState], counts: list[int], report: StepReport):
        """Ask the proposer for drafts. Returns drafts [b, n] (zero-padded), per-row proposals for sampled rows
        ((q_probs, q_ids) on this device, q_ids None for a dense q; None for a point mass or a greedy row), and the
        draft counts actually obtained (0 for rows the proposer could not serve this step)."""
        q_rows: list[tuple | None] = [None] * len(states)
        rows = [r for r, k in enumerate(counts) if k > 0]
        if not rows:
            return torch.zeros(len(states), 0, dtype=torch.long), q_rows, counts
        items = []
        masks = self.grammar_drafts in UNDER_GRAMMAR and getattr(self.proposer, "masks_grammars", False)
        for r in rows:
            state = states[r]
            unsent = state.unsent_features()
            features = torch.cat(unsent) if unsent else self._no_features()
            item = DraftItem(
                request_id=state.request_id, context_start=state.drafter_context_len, context_features=features,
                anchor_token=state.last_token, num_draft=counts[r], sampling=state.request.sampling, seed=state.seed,
            )
            if masks and state.grammar is not None:  # the drafter's copy of its grammar: anew, or the tokens since
                item.grammar = state.request.grammar if state.grammar_sent == 0 else None
                item.grammar_start = state.grammar_sent
                item.grammar_tokens = tuple(state.output_ids[state.grammar_sent:])
            items.append(item)
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
