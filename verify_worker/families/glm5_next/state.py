"""The per-slot state of a GLM-5.3-Flash target: the positional latent / indexer caches of its MLA layers, and the
recurrent state and conv window of each KDA layer, which cannot be rolled back by a length.

KDA rollback by replay. Per slot and KDA layer the state keeps the committed state S0 (and conv window W0) and
the tip (S, W) after every pending token; a step starts from the tip and records each real token's recurrence
inputs (k, v, decay, beta, and the raw conv input). `commit(kept)` then ends at the state after the first kept
pending tokens: the tip itself when all are kept, S0 when none are, else S0 with the kept prefix replayed through
the same recurrent step, which gives plain decoding's state bit for bit. So a request holds two states whatever
the block size (vLLM keeps 1 + K: one per draft position) plus the block's small per-token inputs.
"""

from dataclasses import dataclass

import torch

from verify_worker.families.common.kda_recurrence import TorchRecurrence
from verify_worker.families.common.latent_cache import LatentCache


@dataclass
class TokenInputs:
    """The recurrence inputs of a step's rows in one KDA layer ([b, s, ...]; row r's first n tokens are real)."""

    k: torch.Tensor  # [b, s, heads, dk] (normalised)
    v: torch.Tensor  # [b, s, heads, dv]
    decay: torch.Tensor  # [b, s, heads, dk]: exp(g)
    g: torch.Tensor  # [b, s, heads, dk]: the log decay (fla's kernel takes it)
    beta: torch.Tensor  # [b, s, heads]
    raw: torch.Tensor  # [b, s, conv channels]: the conv's inputs


@dataclass
class PendingStep:
    """One forward's recorded rows in a KDA layer: their inputs, slots [b] and real tokens [b] (device tensors), and
    which rows are still pending (not yet committed or reset) [b] bool."""

    inputs: TokenInputs
    slots: torch.Tensor
    lengths: torch.Tensor
    live: torch.Tensor
    source: torch.Tensor  # the forward's slots tensor as given: the same object in every layer of one forward


@dataclass
class CommitPlan:
    """What a commit does, worked out once for every KDA layer (their pending tokens are the same)."""

    slots: torch.Tensor  # [n] the committed slots
    kept: torch.Tensor  # [n] how many of their pending tokens each keeps
    sources: list[torch.Tensor]  # the pending forwards it was worked out from (PendingStep.source)
    adopted: torch.Tensor  # slots that keep every pending token: the tip becomes the committed state
    dropped: torch.Tensor  # the others: the tip goes back to the committed state (after any replay)
    partial: torch.Tensor  # [P] slots that keep some, not all: replayed
    partial_kept: torch.Tensor  # [P] how many
    longest: int  # the most kept by a replayed slot
    last_rows: torch.Tensor | None  # [P] their rows in the last forward, where that forward holds all they keep
    step_rows: list[torch.Tensor]  # [P] per pending forward: their rows there (-1: none)
    live: list[torch.Tensor]  # per pending forward: its rows still pending after the commit
    kept_steps: list[bool]  # per pending forward: whether it still holds a pending row


class RecurrentState:
    """One KDA layer's states for every slot. The count of pending tokens is a device tensor shared by the
    layers (the first, its owner, keeps it), so a step records its rows without reading the host, and a commit
    is worked out once for the batch and every layer (plan), reading the host a few times, not per row or layer."""

    def __init__(self, num_slots: int, heads: int, dk: int, dv: int, channels: int, kernel: int, device,
                 recurrence=None, pending_tokens: torch.Tensor | None = None):
        self.recurrence = recurrence or TorchRecurrence()  # the model's, so that a replay equals the forward
        f32 = dict(dtype=torch.float32, device=device)
        self.committed = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.tip = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.committed_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.tip_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.owner = pending_tokens is None
        self.pending_tokens = torch.zeros(num_slots, dtype=torch.long, device=device) if self.owner else \
            pending_tokens  # [slots]
        self.steps: list[PendingStep] = []  # in order

    def tensors(self) -> list[torch.Tensor]:
        return [self.committed, self.tip, self.committed_window, self.tip_window]

    def record(self, slots: torch.Tensor, lengths: torch.Tensor, inputs: TokenInputs) -> None:
        """A forward's rows: slots [b] (each slot once), lengths [b] (each row's real tokens, the first of its s);
        copied, so a caller may reuse its buffers."""
        source = slots
        slots = slots.to(device=self.tip.device, dtype=torch.long, copy=True)
        lengths = lengths.to(device=self.tip.device, dtype=torch.long, copy=True)
        self.steps.append(PendingStep(inputs, slots, lengths, torch.ones_like(slots, dtype=torch.bool), source))
        if self.owner:
            self.pending_tokens.index_add_(0, slots, lengths)

    def plan(self, slots: torch.Tensor, kept: torch.Tensor, own: bool = False) -> CommitPlan:
        """Each slot keeps its first kept pending tokens (a ValueError where more than are pending). own: count
        this layer's pending tokens from its own forwards, not the shared count (a layer whose forwards differ from
        the owner's: a forward that raised before reaching it)."""
        slots = slots.to(device=self.tip.device, dtype=torch.long)
        kept = kept.to(device=self.tip.device, dtype=torch.long)
        counts = self.pending_tokens
        if own:
            counts = torch.zeros_like(self.pending_tokens)
            for step in self.steps:
                counts.index_add_(0, step.slots[step.live], step.lengths[step.live])
        total = counts[slots]  # [n]
        over = kept > total
        if bool(over.any()):
            index = int(over.nonzero()[0, 0])
            raise ValueError(f"slot {int(slots[index])} keeps {int(kept[index])} tokens but {int(total[index])} are "
                             "pending")
        adopt = (kept == total) & (kept > 0)  # a commit of nothing always restores the tip (a layer may have
        partial = ~adopt & (kept > 0)  # written its tip before a failure kept it from recording its rows)
        replayed, replayed_kept = slots[partial], kept[partial]
        step_rows = [self._rows_in(step, replayed) for step in self.steps]
        longest, last_rows = 0, None
        if replayed.numel():
            longest = int(replayed_kept.max())
            rows = step_rows[-1]
            if bool((rows >= 0).all()) and bool((self.steps[-1].lengths[rows.clamp(min=0)] ==
                                                 total[partial]).all()):
                last_rows = rows  # a decode block's rows: one gather
        live = [step.live & ~torch.isin(step.slots, slots) for step in self.steps]
        kept_steps = torch.stack([mask.any() for mask in live]).tolist() if live else []
        return CommitPlan(slots, kept, [step.source for step in self.steps], slots[adopt], slots[~adopt], replayed,
                          replayed_kept, longest, last_rows, step_rows, live, kept_steps)

    def apply(self, plan: CommitPlan) -> None:
        """The commit: the tip when all are kept, the committed state when none are, else the committed state with
        the kept prefix replayed through the same update the forward ran (all such slots in one batched replay).
        A layer whose pending forwards are not the plan's works out its own."""
        if len(self.steps) != len(plan.sources) or any(step.source is not source
                                                       for step, source in zip(self.steps, plan.sources)):
            plan = self.plan(plan.slots, plan.kept, own=True)
        if plan.partial.numel():
            self._replay(plan)
        if plan.adopted.numel():
            adopted = plan.adopted
            self.committed[adopted], self.committed_window[adopted] = self.tip[adopted], self.tip_window[adopted]
        if plan.dropped.numel():
            dropped = plan.dropped
            self.tip[dropped], self.tip_window[dropped] = self.committed[dropped], self.committed_window[dropped]
        for step, live in zip(self.steps, plan.live):
            step.live = live
        self.steps = [step for step, keep in zip(self.steps, plan.kept_steps) if keep]
        if self.owner:
            self.pending_tokens[plan.slots] = 0

    def commit(self, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """plan and apply, for this layer alone (a layer that does not own the shared count counts its own)."""
        self.apply(self.plan(slots, kept, own=not self.owner))

    def _replay(self, plan: CommitPlan) -> None:
        """The committed states of the replayed slots advanced through their kept tokens, batched over the slots
        (each slot's heads are updated on their own, so the batch does not change a bit)."""
        slots, kept, longest = plan.partial, plan.partial_kept, plan.longest
        names = ("k", "v", "decay", "g", "beta", "raw")
        if plan.last_rows is not None:  # every slot's pending tokens are one forward's row (a decode block)
            inputs = self.steps[-1].inputs
            k, v, decay, g, beta, raw = (getattr(inputs, f)[plan.last_rows, :longest] for f in names)
        else:  # a slot's pending tokens span forwards (a prompt chunk, then a decode block): laid end to end
            k, v, decay, g, beta, raw = self._joined(plan, names)  # [P, longest, ...]
        live = torch.arange(longest, device=kept.device)[None] < kept[:, None]  # [P, longest]
        self.committed[slots], _ = self.recurrence.run(self.committed[slots], None, k, v, decay, g, beta, live)
        window = self.committed_window[slots]  # [P, C, K-1]
        series = torch.cat([window, raw.transpose(1, 2).float()], -1)
        take = kept[:, None] + torch.arange(window.shape[-1], device=window.device)
        self.committed_window[slots] = series.gather(-1, take[:, None].expand(-1, series.shape[1], -1))

    def _joined(self, plan: CommitPlan, names) -> list[torch.Tensor]:
        """Each replayed slot's first kept pending tokens' inputs, its forwards' rows laid end to end: per name
        [P, longest, ...] (zeros past a slot's kept tokens)."""
        kept, longest = plan.partial_kept, plan.longest
        first = self.steps[0].inputs
        fields = [getattr(first, f).new_zeros(len(kept), longest, *getattr(first, f).shape[2:]) for f in names]
        before = torch.zeros_like(kept)  # [P] tokens laid so far
        for step, rows in zip(self.steps, plan.step_rows):
            counts = torch.where(rows >= 0, step.lengths[rows.clamp(min=0)], 0)  # [P]
            offsets = torch.arange(step.inputs.k.shape[1], device=kept.device)  # [s]
            places = before[:, None] + offsets[None]  # [P, s]
            valid = (offsets[None] < counts[:, None]) & (places < kept[:, None])
            slot_index, token = valid.nonzero(as_tuple=True)
            for field, name in zip(fields, names):
                field[slot_index, places[slot_index, token]] = getattr(step.inputs, name)[rows[slot_index], token]
            before += counts
        return fields

    def _rows_in(self, step: PendingStep, slots: torch.Tensor) -> torch.Tensor:
        """Each slot's pending row in step [P] (-1 where the slot has none there; a step holds a slot once)."""
        row_of = torch.full_like(self.pending_tokens, -1)  # [slots]
        rows = torch.arange(step.slots.shape[0], device=slots.device)
        row_of[step.slots[step.live]] = rows[step.live]
        return row_of[slots]

    def reset(self, slot: int) -> None:
        for tensor in self.tensors():
            tensor[slot] = 0
        index = torch.tensor([slot], device=self.tip.device)
        for step in self.steps:
            step.live = step.live & (step.slots != slot)
        self.steps = [step for step in self.steps if bool(step.live.any())]
        if self.owner:
            self.pending_tokens[index] = 0


class Glm5NextState:
    def __init__(self, latent: LatentCache, recurrent: dict[int, RecurrentState]):
        self.latent, self.recurrent = latent, recurrent
        self.capacity, self.num_slots = latent.capacity, latent.num_slots

    def nbytes(self) -> int:
        return self.latent.nbytes() + sum(t.numel() * t.element_size() for r in self.recurrent.values()
                                          for t in r.tensors())
