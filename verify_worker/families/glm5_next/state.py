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


class RecurrentState:
    """One KDA layer's states for every slot. The bookkeeping of pending tokens is device tensors: a step records
    its rows with no read of the host, and a commit looks at the host once for the whole batch, not per row."""

    def __init__(self, num_slots: int, heads: int, dk: int, dv: int, channels: int, kernel: int, device,
                 recurrence=None):
        self.recurrence = recurrence or TorchRecurrence()  # the model's, so that a replay equals the forward
        f32 = dict(dtype=torch.float32, device=device)
        self.committed = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.tip = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.committed_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.tip_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.pending_tokens = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.steps: list[PendingStep] = []  # in order

    def tensors(self) -> list[torch.Tensor]:
        return [self.committed, self.tip, self.committed_window, self.tip_window]

    def record(self, slots: torch.Tensor, lengths: torch.Tensor, inputs: TokenInputs) -> None:
        """A forward's rows: slots [b], lengths [b] (each row's real tokens, the first of its s)."""
        slots, lengths = slots.to(torch.long), lengths.to(torch.long)
        self.steps.append(PendingStep(inputs, slots, lengths, torch.ones_like(slots, dtype=torch.bool)))
        self.pending_tokens.index_add_(0, slots, lengths)

    def commit(self, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """Each slot keeps its first kept pending tokens: the tip when all are kept, the committed state when none
        are, else the committed state with the kept prefix replayed through the same update the forward ran
        (all such slots in one batched replay)."""
        slots = slots.to(device=self.tip.device, dtype=torch.long)
        kept = kept.to(device=self.tip.device, dtype=torch.long)
        total = self.pending_tokens[slots]  # [n]
        over = kept > total
        if bool(over.any()):
            index = int(over.nonzero()[0, 0])
            raise ValueError(f"slot {int(slots[index])} keeps {int(kept[index])} tokens but {int(total[index])} are "
                             "pending")
        adopt = kept == total
        partial = ~adopt & (kept > 0)
        if bool(partial.any()):
            self._replay(slots[partial], kept[partial])
        adopted, dropped = slots[adopt], slots[~adopt]
        self.committed[adopted], self.committed_window[adopted] = self.tip[adopted], self.tip_window[adopted]
        self.tip[dropped], self.tip_window[dropped] = self.committed[dropped], self.committed_window[dropped]
        self._forget(slots)

    def _forget(self, slots: torch.Tensor) -> None:
        """These slots have nothing pending any more; steps with no pending row are dropped."""
        self.pending_tokens[slots] = 0
        for step in self.steps:
            step.live &= ~torch.isin(step.slots, slots)
        self.steps = [step for step in self.steps if bool(step.live.any())]

    def _replay(self, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """The committed states of these slots advanced through their kept tokens, batched over the slots (each
        slot's heads are updated on their own, so the batch does not change a bit)."""
        longest = int(kept.max())
        names = ("k", "v", "decay", "g", "beta", "raw")
        last = self.steps[-1]
        rows = self._rows_in(last, slots)  # [P]: each slot's row in the last step, -1 where none
        found = rows >= 0
        within = bool(found.all()) and bool((last.lengths[rows.clamp(min=0)] == self.pending_tokens[slots]).all())
        if within:  # every slot's pending tokens are one forward's row (a decode block): gathered at once
            k, v, decay, g, beta, raw = (getattr(last.inputs, f)[rows, :longest] for f in names)  # [P, longest, ...]
        else:  # a slot's pending tokens span forwards (a prompt chunk, then a decode block): laid end to end
            k, v, decay, g, beta, raw = self._joined(slots, kept, longest, names)  # [P, longest, ...]
        live = torch.arange(longest, device=kept.device)[None] < kept[:, None]  # [P, longest]
        self.committed[slots], _ = self.recurrence.run(self.committed[slots], None, k, v, decay, g, beta, live)
        window = self.committed_window[slots]  # [P, C, K-1]
        series = torch.cat([window, raw.transpose(1, 2).float()], -1)
        take = kept[:, None] + torch.arange(window.shape[-1], device=window.device)
        self.committed_window[slots] = series.gather(-1, take[:, None].expand(-1, series.shape[1], -1))

    def _joined(self, slots: torch.Tensor, kept: torch.Tensor, longest: int, names) -> list[torch.Tensor]:
        """Each slot's first kept pending tokens' inputs, its steps' rows laid end to end: per name [P, longest, ...]
        (zeros past a slot's kept tokens)."""
        first = self.steps[0].inputs
        fields = [getattr(first, f).new_zeros(len(slots), longest, *getattr(first, f).shape[2:]) for f in names]
        before = torch.zeros_like(kept)  # [P] tokens laid so far
        for step in self.steps:
            rows = self._rows_in(step, slots)  # [P]
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
        self._forget(torch.tensor([slot], device=self.tip.device))


class Glm5NextState:
    def __init__(self, latent: LatentCache, recurrent: dict[int, RecurrentState]):
        self.latent, self.recurrent = latent, recurrent
        self.capacity, self.num_slots = latent.capacity, latent.num_slots

    def nbytes(self) -> int:
        return self.latent.nbytes() + sum(t.numel() * t.element_size() for r in self.recurrent.values()
                                          for t in r.tensors())
