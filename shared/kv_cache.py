"""A key/value cache written by absolute position.

Each request owns one slot. Entries at positions >= the owner's committed length are garbage that the
attention mask never shows, so rolling back rejected tokens is only a change of the owner's length.
"""

from dataclasses import dataclass

import torch


class PositionalKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_slots = num_slots
        self.capacity = capacity
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [batch, seq, kv_heads, head_dim] at slots [batch] and positions [batch, seq] (rounded to the
        cache's dtype)."""
        index = (slots[:, None], slice(None), positions)
        self.keys[layer][index] = k.to(self.keys[layer].dtype)
        self.values[layer][index] = v.to(self.values[layer].dtype)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions 0..length-1 of slot source into slot target, every layer (a kept prefix given to a request
        that starts in another slot)."""
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]

    def read(self, layer: int, slots: torch.Tensor | slice, length: int):
        """Keys and values [batch, kv_heads, length, head_dim] of the given slots, positions 0..length-1."""
        return self.keys[layer][slots, :, :length], self.values[layer][slots, :, :length]


def slot_selector(slots: torch.Tensor) -> torch.Tensor | slice:
    """A slice when slots are consecutive (reads become views, no copy), else the index tensor itself."""
    first = int(slots[0])
    if torch.equal(slots.cpu(), torch.arange(first, first + len(slots))):
        return slice(first, first + len(slots))
    return slots


def consecutive_range(slots: list[int]) -> tuple[int, int] | None:
    """(start, end) where the slots (on the host) are start..end-1 in order, else None: slot_selector's test
    without reading a device tensor."""
    first = slots[0]
    return (first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None


@dataclass(frozen=True)
class CacheReads:
    """What every layer of one step reads from a positional cache, decided once: key positions 0..length-1 of
    `slots` (a slice where they are consecutive: views; else the index tensor: a gathered copy)."""

    length: int
    slots: torch.Tensor | slice

    @classmethod
    def of(cls, slots: torch.Tensor, length: int | None, slot_range: tuple[int, int] | None,
           positions: torch.Tensor) -> "CacheReads":
        """From the host's facts where the caller has them (length; slot_range: the slots are start..end-1 in
        order), else from the device: length max(positions) + 1 and slot_selector(slots) (two reads back)."""
        if length is None:
            return cls(int(positions.max()) + 1, slot_selector(slots))
        return cls(length, slice(*slot_range) if slot_range is not None else slots)
