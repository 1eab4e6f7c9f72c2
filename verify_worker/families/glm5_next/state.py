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

from verify_worker.families.common.kda import delta_update
from verify_worker.families.common.latent_cache import LatentCache


@dataclass
class TokenInputs:
    """The recurrence inputs of some tokens of one slot in one KDA layer (n tokens)."""

    k: torch.Tensor  # [n, heads, dk] (normalised)
    v: torch.Tensor  # [n, heads, dv]
    decay: torch.Tensor  # [n, heads, dk]: exp(g)
    beta: torch.Tensor  # [n, heads]
    raw: torch.Tensor  # [n, conv channels]: the conv's inputs


class RecurrentState:
    """One KDA layer's states for every slot."""

    def __init__(self, num_slots: int, heads: int, dk: int, dv: int, channels: int, kernel: int, device):
        f32 = dict(dtype=torch.float32, device=device)
        self.committed = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.tip = torch.zeros(num_slots, heads, dk, dv, **f32)
        self.committed_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.tip_window = torch.zeros(num_slots, channels, kernel - 1, **f32)
        self.pending: dict[int, list[TokenInputs]] = {}

    def tensors(self) -> list[torch.Tensor]:
        return [self.committed, self.tip, self.committed_window, self.tip_window]

    def record(self, slot: int, inputs: TokenInputs) -> None:
        self.pending.setdefault(slot, []).append(inputs)

    def commit(self, slot: int, kept: int) -> None:
        records = self.pending.pop(slot, [])
        total = sum(r.k.shape[0] for r in records)
        if kept > total:
            raise ValueError(f"slot {slot} keeps {kept} tokens but {total} are pending")
        if kept == total:
            self.committed[slot], self.committed_window[slot] = self.tip[slot], self.tip_window[slot]
            return
        if kept:
            joined = TokenInputs(*(torch.cat([getattr(r, f) for r in records])[:kept] for f in
                                   ("k", "v", "decay", "beta", "raw")))
            state = self.committed[slot]
            for t in range(kept):  # the same step the forward ran, on this slot's heads alone
                state = delta_update(state, joined.k[t], joined.v[t], joined.decay[t], joined.beta[t])
            window = torch.cat([self.committed_window[slot], joined.raw.t().float()], -1)
            self.committed[slot] = state
            self.committed_window[slot] = window[:, -self.committed_window.shape[-1]:]
        self.tip[slot], self.tip_window[slot] = self.committed[slot], self.committed_window[slot]

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
