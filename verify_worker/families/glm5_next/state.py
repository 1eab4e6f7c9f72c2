"""The per-slot state of a GLM-5.3-Flash target: the positional latent / indexer caches of its MLA layers, and the
recurrent state and conv window of each KDA layer, which cannot be rolled back by a length.

KDA rollback by replay. Per slot and KDA layer the state keeps the committed state S0 (and conv window W0), the
tip (S, W) after every pending token, and the recurrence inputs (k, v, decay, g, beta, the raw conv input) of the
first `block_tokens` pending tokens, written by the forward into buffers of their own at each slot's next places.
`commit(kept)` then ends at the state after the first kept pending tokens: the tip itself when all are kept, S0
when none are, else S0 with the kept prefix replayed through the same recurrent step, which gives plain decoding's
state bit for bit. So a request holds two states whatever the block size (vLLM keeps 1 + K: one per draft
position) plus one block's per-token inputs.

Everything a forward does to the state is a device operation at fixed addresses (the pending count is a device
tensor, read once per forward for the places and advanced once after it), so a step can be captured in a CUDA
graph; a commit reads the host once for its slots.
"""

from dataclasses import dataclass, fields

import torch

from verify_worker.families.common.kda_recurrence import TorchRecurrence
from verify_worker.families.common.latent_cache import LatentCache


@dataclass
class TokenInputs:
    """The recurrence inputs of tokens in one KDA layer ([rows, tokens, ...] in a forward; [places, ...] kept)."""

    k: torch.Tensor  # [..., heads, dk] (normalised)
    v: torch.Tensor  # [..., heads, dv]
    decay: torch.Tensor  # [..., heads, dk]: exp(g)
    g: torch.Tensor  # [..., heads, dk]: the log decay (fla's kernel takes it)
    beta: torch.Tensor  # [..., heads]
    raw: torch.Tensor  # [..., conv channels]: the conv's inputs


@dataclass(frozen=True)
class CommitPlan:
    """What a commit does, worked out once on the host for every KDA layer (their pending tokens are the same)."""

    taken: tuple[range, ...]  # slots that keep some tokens, in runs of consecutive slots: their tip (after any
    #                           replay) becomes the committed state
    restored: tuple[range, ...]  # slots that keep none, in runs: the tip goes back to the committed state
    partial: torch.Tensor  # [p] slots that keep some, not all: their tip is replayed from the committed state first
    partial_kept: torch.Tensor  # [p] how many
    longest: int  # the most kept by a replayed slot


def slot_runs(slots: list[int]) -> tuple[range, ...]:
    """Distinct slots as runs of consecutive ones: [4, 0, 1, 2, 7] -> (range(0, 3), range(4, 5), range(7, 8))."""
    runs: list[range] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1].stop == slot:
            runs[-1] = range(runs[-1].start, slot + 1)
        else:
            runs.append(range(slot, slot + 1))
    return tuple(runs)


class RecurrentState:
    """One KDA layer's states for every slot, and the kept inputs of each slot's first block_tokens pending tokens
    (flat [slots * block_tokens + 1, ...]: slot s's i-th at s * block_tokens + i; the last place takes the writes
    of tokens that are not kept: padding, and tokens past the first block_tokens)."""

    def __init__(self, num_slots: int, heads: int, dk: int, dv: int, channels: int, kernel: int, block_tokens: int,
                 raw_dtype: torch.dtype, device, recurrence=None):
        self.recurrence = recurrence or TorchRecurrence()  # the model's, so that a replay equals the forward
        self.block_tokens = block_tokens
        f32 = dict(dtype=torch.float32, device=device)
        self.committed = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.tip = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.committed_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.tip_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        places = num_slots * block_tokens + 1
        self.kept_inputs = TokenInputs(
            k=torch.zeros(places, heads, dk, **f32), v=torch.zeros(places, heads, dv, **f32),
            decay=torch.zeros(places, heads, dk, **f32), g=torch.zeros(places, heads, dk, **f32),
            beta=torch.zeros(places, heads, **f32), raw=torch.zeros(places, channels, dtype=raw_dtype, device=device))

    def tensors(self) -> list[torch.Tensor]:
        return [self.committed, self.tip, self.committed_window, self.tip_window]

    def input_tensors(self) -> list[torch.Tensor]:
        return [getattr(self.kept_inputs, f.name) for f in fields(TokenInputs)]

    def keep(self, slots: torch.Tensor, offsets: torch.Tensor, live: torch.Tensor, inputs: TokenInputs) -> None:
        """A forward's rows' inputs ([b, s, ...]) at their slots' next places: slots [b], offsets [b] (each row's
        pending tokens before this forward), live [b, s] (its real tokens). Device operations only."""
        batch, seq = live.shape
        places = offsets[:, None] + torch.arange(seq, device=live.device)  # [b, s]
        stored = live & (places < self.block_tokens)
        trash = self.kept_inputs.beta.shape[0] - 1
        index = torch.where(stored, slots[:, None] * self.block_tokens + places, trash).reshape(-1)  # [b * s]
        for f in fields(TokenInputs):
            value = getattr(inputs, f.name)
            getattr(self.kept_inputs, f.name)[index] = value.reshape(batch * seq, *value.shape[2:])

    def replay(self, plan: CommitPlan) -> None:
        """A commit's first half: the tips of the slots that keep part of their pending tokens become the committed
        state with the kept prefix replayed through the same update the forward ran (all such slots in one batched
        replay; each slot's heads are updated on their own, so the batch does not change a bit). Only tips change:
        where a layer's replay raises, a commit of 0 still restores every layer."""
        if not plan.partial.numel():
            return
        slots, kept, longest = plan.partial, plan.partial_kept, plan.longest
        steps = torch.arange(longest, device=slots.device)
        index = slots[:, None] * self.block_tokens + steps  # [P, longest]
        k, v, decay, g, beta, raw = (tensor[index] for tensor in self.input_tensors())  # [P, longest, ...]
        live = steps[None] < kept[:, None]  # [P, longest]
        self.tip[slots], _ = self.recurrence.run(self.committed[slots], None, k, v, decay, g, beta, live)
        window = self.committed_window[slots]  # [P, C, K-1]
        series = torch.cat([window, raw.transpose(1, 2).float()], -1)
        take = kept[:, None] + torch.arange(window.shape[-1], device=window.device)
        self.tip_window[slots] = series.gather(-1, take[:, None].expand(-1, series.shape[1], -1))

    def settle(self, plan: CommitPlan) -> None:
        """A commit's second half: the kept tips become the committed states, the others go back. Copies between
        views of runs of slots, which allocate nothing (so they cannot run out of memory after a replay did not)."""
        for run in plan.taken:
            self.committed[run.start:run.stop].copy_(self.tip[run.start:run.stop])
            self.committed_window[run.start:run.stop].copy_(self.tip_window[run.start:run.stop])
        for run in plan.restored:
            self.tip[run.start:run.stop].copy_(self.committed[run.start:run.stop])
            self.tip_window[run.start:run.stop].copy_(self.committed_window[run.start:run.stop])

    def reset(self, slot: int) -> None:
        for tensor in self.tensors():
            tensor[slot] = 0


class Glm5NextState:
    """The latent caches, each KDA layer's RecurrentState, and each slot's pending tokens [slots] (on the device:
    a forward reads them for its places and adds its real tokens)."""

    def __init__(self, latent: LatentCache, recurrent: dict[int, RecurrentState], block_tokens: int, device):
        self.latent, self.recurrent, self.block_tokens = latent, recurrent, block_tokens
        self.capacity, self.num_slots = latent.capacity, latent.num_slots
        self.pending_tokens = torch.zeros(self.num_slots, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        tensors = [t for r in self.recurrent.values() for t in r.tensors() + r.input_tensors()]
        if self.recurrent:
            tensors.append(self.pending_tokens)
        return self.latent.nbytes() + sum(t.numel() * t.element_size() for t in tensors)

    def begin(self, slots: torch.Tensor) -> torch.Tensor:
        """A forward's rows' pending tokens before it [b] (where each KDA layer keeps their inputs)."""
        return self.pending_tokens[slots]

    def advance(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """After a forward that reached its end: its rows' real tokens are pending too."""
        self.pending_tokens.index_add_(0, slots, lengths)

    def plan(self, slots: torch.Tensor, kept: torch.Tensor) -> CommitPlan:
        """Slot slots[i] keeps its first kept[i] pending tokens; a ValueError where more than are pending, or where
        a replay would need inputs that were not kept (past the first block_tokens: a long prompt chunk and what
        followed it, kept in part)."""
        device = self.pending_tokens.device
        slots, kept = slots.to(device, torch.long), kept.to(device, torch.long)
        slot_list, kept_list, totals = torch.stack([slots, kept, self.pending_tokens[slots]]).tolist()  # one read
        taken, restored, partial, partial_kept = [], [], [], []
        for slot, keep, total in zip(slot_list, kept_list, totals):
            if keep > total:
                raise ValueError(f"slot {slot} keeps {keep} tokens but {total} are pending")
            if 0 < keep < total and keep > self.block_tokens:
                raise ValueError(f"slot {slot} keeps {keep} of its {total} pending tokens: a KDA state rolls back "
                                 f"within its first {self.block_tokens} (the state's block_tokens)")
            (taken if keep > 0 else restored).append(slot)  # a commit of nothing always restores the tip (a layer
            if 0 < keep < total:  # may have written its tip before a failure stopped the forward)
                partial.append(slot)
                partial_kept.append(keep)
        index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return CommitPlan(slot_runs(taken), slot_runs(restored), index(partial), index(partial_kept),
                          max(partial_kept, default=0))

    def commit(self, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """Every layer's replays first (they may raise: then nothing is committed, and a commit of 0 restores every
        layer's tip), then the copies that commit."""
        plan = self.plan(slots, kept)
        for recurrent in self.recurrent.values():
            recurrent.replay(plan)
        for recurrent in self.recurrent.values():
            recurrent.settle(plan)
        self.pending_tokens[slots.to(self.pending_tokens.device)] = 0

    def reset(self, slot: int) -> None:
        for recurrent in self.recurrent.values():
            recurrent.reset(slot)
        self.pending_tokens[slot] = 0
