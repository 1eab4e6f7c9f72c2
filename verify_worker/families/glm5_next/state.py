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


class RecurrentState:
    """One KDA layer's states for every slot."""

    def __init__(self, num_slots: int, heads: int, dk: int, dv: int, channels: int, kernel: int, device,
                 recurrence=None):
        self.recurrence = recurrence or TorchRecurrence()  # the model's, so that a replay equals the forward
        f32 = dict(dtype=torch.float32, device=device)
        self.committed = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.tip = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.committed_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.tip_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.pending: dict[int, list[tuple[TokenInputs, int, int]]] = {}  # slot -> (inputs, row, real tokens)

    def tensors(self) -> list[torch.Tensor]:
        return [self.committed, self.tip, self.committed_window, self.tip_window]

    def record(self, slots: list[int], lengths: list[int], inputs: TokenInputs) -> None:
        for row, (slot, n) in enumerate(zip(slots, lengths)):
            self.pending.setdefault(slot, []).append((inputs, row, n))

    def commit(self, slots: list[int], kept: list[int]) -> None:
        """Each slot keeps its first kept pending tokens: the tip when all are kept, the committed state when none
        are, else the committed state with the kept prefix replayed through the same update the forward ran
        (all such slots in one batched replay)."""
        adopt, drop, partial = [], [], []
        for slot, n in zip(slots, kept):
            records = self.pending.pop(slot, [])
            total = sum(count for _, _, count in records)
            if n > total:
                raise ValueError(f"slot {slot} keeps {n} tokens but {total} are pending")
            if n == total:
                adopt.append(slot)
            else:
                drop.append(slot)
                if n:
                    partial.append((slot, records, n))
        if partial:
            self._replay(partial)
        if adopt:
            index = torch.tensor(adopt, device=self.tip.device)
            self.committed[index], self.committed_window[index] = self.tip[index], self.tip_window[index]
        if drop:
            index = torch.tensor(drop, device=self.tip.device)
            self.tip[index], self.tip_window[index] = self.committed[index], self.committed_window[index]

    def _replay(self, partial: list[tuple[int, list[tuple[TokenInputs, int, int]], int]]) -> None:
        """The committed states of these slots advanced through their kept tokens, batched over the slots (each
        slot's heads are updated on their own, so the batch does not change a bit)."""
        longest = max(n for _, _, n in partial)
        names = ("k", "v", "decay", "g", "beta", "raw")
        first = partial[0][1][0][0]
        if all(len(records) == 1 and records[0][0] is first for _, records, _ in partial):  # one forward's rows
            rows = torch.tensor([records[0][1] for _, records, _ in partial], device=self.tip.device)
            k, v, decay, g, beta, raw = (getattr(first, f)[rows, :longest] for f in names)  # [P, longest, ...]
        else:  # a slot's pending tokens span forwards (a prompt chunk, then a decode block)
            fields = {f: [] for f in names}
            for _, records, n in partial:
                for f in names:
                    joined = torch.cat([getattr(inputs, f)[row, :count] for inputs, row, count in records])[:n]
                    pad = [0] * (2 * (joined.dim() - 1)) + [0, longest - n]
                    fields[f].append(torch.nn.functional.pad(joined, pad))
            k, v, decay, g, beta, raw = (torch.stack(fields[f]) for f in names)  # [P, longest, ...]
        index = torch.tensor([slot for slot, _, _ in partial], device=self.tip.device)
        kept = torch.tensor([n for _, _, n in partial], device=self.tip.device)
        live = torch.arange(longest, device=kept.device)[None] < kept[:, None]  # [P, longest]
        self.committed[index], _ = self.recurrence.run(self.committed[index], None, k, v, decay, g, beta, live)
        window = self.committed_window[index]  # [P, C, K-1]
        series = torch.cat([window, raw.transpose(1, 2).float()], -1)
        take = kept[:, None] + torch.arange(window.shape[-1], device=window.device)
        self.committed_window[index] = series.gather(-1, take[:, None].expand(-1, series.shape[1], -1))

    def reset(self, slot: int) -> None:
        for tensor in self.tensors():
            tensor[slot] = 0
        self.pending.pop(slot, None)


class Glm5NextState:
    def __init__(self, latent: LatentCache, recurrent: dict[int, RecurrentState]):
        self.latent, self.recurrent = latent, recurrent
        self.capacity, self.num_slots = latent.capacity, latent.num_slots

    def nbytes(self) -> int:
        return self.latent.nbytes() + sum(t.numel() * t.element_size() for r in self.recurrent.values()
                                          for t in r.tensors())
