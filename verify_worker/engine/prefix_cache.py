"""Prefixes computed once: a finished request's cache slot keeps its KV (and the drafter's feature rows of the same
positions), indexed by the tokens it holds, until the slot is needed; a new request whose prompt begins with some
of those tokens prefills only the rest: in a slot of its own that the prefix is copied into, where the family copies
and a slot holding nothing is free (the prefix stays kept for other requests), else in the kept slot itself (the
slot moves to it). Pure bookkeeping: no tensors are read or written here.

Only families whose cache is written by absolute position serve hits (a recurrent state holds its last position
alone). A kept slot is free: no request writes it, and a request writes only its own slot, past its hit.
"""

from dataclasses import dataclass

import torch

COMPARE_CHUNK = 256  # tokens compared at once while measuring a common prefix
KEEP_AT_LEAST = 16  # a shorter prefix is not kept: it is recomputed in no time, and holding it would let every
# short request (the readiness probe's, every 2 s) push a long prefix out of the cache


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the longest common prefix of two token tuples (slices compared in C, chunk by chunk)."""
    n, at = min(len(a), len(b)), 0
    while at < n:
        step = min(COMPARE_CHUNK, n - at)
        if a[at:at + step] == b[at:at + step]:
            at += step
            continue
        while a[at] == b[at]:
            at += 1
        return at
    return n


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]  # the tokens whose KV positions 0..len-1 of the slot hold
    features: torch.Tensor | None  # [len, taps * hidden] the drafter's rows of those positions (None: no drafter)
    last_used: int  # the cache's clock when it was stored or hit


@dataclass(frozen=True)
class PrefixHit:
    slot: int
    tokens: int  # positions of the slot the request reuses
    features: torch.Tensor | None  # their feature rows [tokens, width] (None: no drafter)
    kept: bool = True  # a free slot's kept prefix (else a running request's committed prompt: copied, never taken)


class PrefixCache:
    """The free slots that hold a finished request's prefix, by slot."""

    def __init__(self, align: int = 1, keep_at_least: int = KEEP_AT_LEAST):
        """align: a hit is a multiple of it (a family whose prompt chunks start at its multiples); keep_at_least:
        the shortest prefix kept."""
        self.align, self.keep_at_least = max(1, align), keep_at_least
        self.entries: dict[int, CachedPrefix] = {}
        self.clock = 0

    def store(self, slot: int, tokens: tuple[int, ...], features: torch.Tensor | None) -> None:
        """The slot's positions 0..len(tokens)-1 hold these tokens' values (kept from keep_at_least tokens on)."""
        self.clock += 1
        if len(tokens) >= self.keep_at_least:
            self.entries[slot] = CachedPrefix(tokens, features, self.clock)
        else:
            self.entries.pop(slot, None)

    def forget(self, slot: int) -> None:
        """The slot is taken, or its positions are no longer what its entry says."""
        self.entries.pop(slot, None)

    def reusable(self, tokens: tuple[int, ...], prompt: tuple[int, ...]) -> int:
        """How many of tokens' positions a request of prompt may reuse: their common prefix, up to the prompt's
        last token (whose logits the request needs from its own prefill), aligned down."""
        return common_prefix(tokens, prompt[:-1]) // self.align * self.align

    def lookup(self, prompt: tuple[int, ...]) -> PrefixHit | None:
        """The slot (every entry's is free) whose cached tokens the prompt may reuse most of (reusable), or None.
        The caller takes the slot (forget) or copies its prefix elsewhere (touch)."""
        best, best_len = None, 0
        for slot, entry in self.entries.items():
            length = self.reusable(entry.tokens, prompt)
            if length > best_len:
                best, best_len = slot, length
        if best is None:
            return None
        entry = self.entries[best]
        features = None if entry.features is None else entry.features[:best_len]
        return PrefixHit(best, best_len, features)

    def touch(self, slot: int) -> None:
        """The slot's prefix was just reused (copied): it is the most recently used."""
        self.clock += 1
        self.entries[slot].last_used = self.clock

    def empty_slot(self, free: list[int]) -> int | None:
        """The lowest free slot holding no prefix, or None."""
        return min((slot for slot in free if slot not in self.entries), default=None)

    def evictable(self, free: list[int]) -> int:
        """The free slot to give a request that hit nothing: one holding no prefix (the lowest), else the least
        recently used prefix's."""
        empty = self.empty_slot(free)
        if empty is not None:
            return empty
        return min(free, key=lambda slot: self.entries[slot].last_used)

    @property
    def cached_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self.entries.values())
