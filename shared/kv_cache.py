"""A key/value cache written by absolute position, a page of positions at a time.

Each request owns one slot: a row of the page table. Entries at positions >= the owner's committed length are
garbage that the attention mask never shows, so rolling back rejected tokens is only a change of the owner's
length.
"""

from dataclasses import dataclass

import torch

from shared.attention import KEY_CHUNK


class PositionalKVCache:
    """Each layer's keys and values [pages, kv_heads, page_size, dim]; a slot's position p lies at row p % page_size
    of page page_table[slot, p // page_size].

    Without page_size, a page a slot: page_size is the capacity and page_table the identity, so the layers' tensors
    are [num_slots, kv_heads, capacity, dim] (what kernels that index by slot read). With it, num_pages pages of
    page_size positions (a multiple of the attention kernels' key block, KEY_CHUNK) shared by every slot, plus a
    scratch page that every position without a page of its own names: a padded row's writes land there, and a
    masked key read there is never seen. The engine gives slots their pages (set_pages; engine/page_tables.py)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        num_pages: int | None = None,
    ):
        self.num_slots = num_slots
        self.paged = page_size is not None
        if self.paged:
            if page_size % KEY_CHUNK or num_pages is None or num_pages < 1:
                raise ValueError(f"a paged cache takes pages of a multiple of {KEY_CHUNK} positions and at least one "
                                 f"page, got {page_size} and {num_pages}")
            capacity = -(-capacity // page_size) * page_size
            self.page_size, self.num_pages = page_size, num_pages
            self.scratch_page = num_pages
            shape = (num_pages + 1, num_kv_heads, page_size, head_dim)
            table = torch.full((num_slots, capacity // page_size), self.scratch_page, dtype=torch.long)
            make = torch.empty  # a page is zeroed when first given out (fresh): memory follows the pages in use
        else:
            self.page_size, self.num_pages, self.scratch_page = capacity, num_slots, None
            shape = (num_slots, num_kv_heads, capacity, head_dim)
            table = torch.arange(num_slots, dtype=torch.long).view(-1, 1)
            make = torch.zeros
        self.capacity = capacity
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_table = table.to(device)  # [num_slots, capacity // page_size]
        if self.paged:
            self.clear_pages([self.scratch_page])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def page_bytes(self) -> int:
        """Bytes one page takes over every layer, keys and values."""
        return self.nbytes() // self.keys[0].shape[0]

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [batch, seq, kv_heads, head_dim] at slots [batch] and positions [batch, seq] (rounded to the
        cache's dtype)."""
        if self.paged:
            index = (self.page_table[slots[:, None], positions // self.page_size], slice(None),
                     positions % self.page_size)  # pages [batch, seq]
        else:  # a page a slot: the slot is the page (no table read in every layer's write)
            index = (slots[:, None], slice(None), positions)
        self.keys[layer][index] = k.to(self.keys[layer].dtype)
        self.values[layer][index] = v.to(self.values[layer].dtype)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions 0..length-1 of slot source into slot target, every layer (a kept prefix given to a request
        that starts in another slot; a cache of a page a slot)."""
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]

    def set_pages(self, slot: int, pages: list[int]) -> None:
        """The slot's first len(pages) pages of positions are these; the rest name the scratch page."""
        row = torch.full((self.page_table.shape[1],), self.scratch_page, dtype=torch.long)
        row[:len(pages)] = torch.tensor(pages, dtype=torch.long)
        self.page_table[slot] = row.to(self.page_table.device)

    def clear_pages(self, pages: list[int]) -> None:
        """Zero these pages (given out for the first time: an unwritten row a masked key still multiplies by 0)."""
        index = torch.tensor(pages, device=self.keys[0].device)
        for keys, values in zip(self.keys, self.values):
            keys.index_fill_(0, index, 0)
            values.index_fill_(0, index, 0)

    def copy_page(self, source: int, target: int, rows: int) -> None:
        """The first `rows` positions of page source into page target, every layer."""
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :rows] = keys[source, :, :rows]
            values[target, :, :rows] = values[source, :, :rows]

    def read(self, layer: int, slots: torch.Tensor | slice, length: int):
        """Keys and values [batch, kv_heads, length, head_dim] of the given slots, positions 0..length-1 (views of
        consecutive slots where a page is a slot; else gathered page by page)."""
        if not self.paged:
            return self.keys[layer][slots, :, :length], self.values[layer][slots, :, :length]
        pages = self.page_table[slots, : -(-length // self.page_size)]  # [batch, n]
        return self._gather(self.keys[layer], pages, length), self._gather(self.values[layer], pages, length)

    @staticmethod
    def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
        batch, n = pages.shape
        _, kv_heads, page_size, dim = cache.shape
        rows = cache[pages.reshape(-1)].view(batch, n, kv_heads, page_size, dim).transpose(1, 2)
        return rows.reshape(batch, kv_heads, n * page_size, dim)[:, :, :length]


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
