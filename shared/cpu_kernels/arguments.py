"""What the C++ CPU kernels take: the weight-tile layout, the cache dtypes they read, argument checks and the
buffers and pointer arrays their calls are given. Pure helpers, apart from the bindings (library.py), so that
the step modules (layer_step.py, draft_step.py, draft_walk.py) and the bindings import them one way."""

import ctypes

import torch

TILE = 16  # output columns per weight tile (kTile in the source)
KV_DTYPES = (torch.float32, torch.bfloat16)  # the KV cache element types the attention kernels read


class CachePages(ctypes.Structure):
    """cache_pages.h's struct: where a slot's positions lie in a cache [pages, kv_heads, page_size, dim]."""

    _fields_ = [("table", ctypes.c_void_p), ("num_slots", ctypes.c_int64), ("pages_per_slot", ctypes.c_int64),
                ("page_size", ctypes.c_int64), ("num_pages", ctypes.c_int64)]


def cache_pages(keys: torch.Tensor, table: torch.Tensor | None) -> tuple[CachePages, torch.Tensor]:
    """The C struct of a cache keys [pages, kv_heads, page_size, dim] read through table [slots, pages_per_slot]
    (None: one page per slot, page = slot), and the int64 table it points into (the caller keeps it alive). The
    kernels check every page they touch against the cache's."""
    if table is None:
        table = torch.arange(keys.shape[0], dtype=torch.int64).view(-1, 1)
    table = table.to(torch.int64).contiguous()
    check_arguments(table.dim() == 2 and table.device.type == "cpu", "cache pages", table)
    return CachePages(table.data_ptr(), table.shape[0], table.shape[1], keys.shape[2], keys.shape[0]), table


def caches_fit(keys: list[torch.Tensor], values: list[torch.Tensor], kv_heads: int, dim: int) -> bool:
    """Each layer's caches [pages, kv_heads, page_size, dim] alike, contiguous, of a dtype the kernels read."""
    first = keys[0]
    return first.dtype in KV_DTYPES and all(
        k.dtype == v.dtype == first.dtype and k.shape == v.shape == first.shape and k.is_contiguous()
        and v.is_contiguous() and k.dim() == 4 and k.shape[1] == kv_heads and k.shape[3] == dim
        for k, v in zip(keys, values))


def pointer_array(pointers) -> ctypes.Array:
    """A C array of these addresses (tensors: their data pointers; the caller keeps them alive)."""
    pointers = [p if isinstance(p, int) else p.data_ptr() for p in pointers]
    return (ctypes.c_void_p * len(pointers))(*pointers)


def carve(rows: int, widths: list[int]) -> tuple[list[int], torch.Tensor]:
    """Float32 buffers of [rows, width] for each width, carved from one allocation: (their addresses, it)."""
    buffer = torch.empty(rows * sum(widths), dtype=torch.float32)
    pointers, offset = [], buffer.data_ptr()
    for width in widths:
        pointers.append(offset)
        offset += rows * width * 4  # bytes
    return pointers, buffer


def check_arguments(ok: bool, kernel: str, *tensors: torch.Tensor) -> None:
    """The kernels trust their arguments' shapes: a mismatch is a bug, refused before any memory is touched."""
    if not ok:
        described = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise ValueError(f"{kernel}: unexpected arguments ({described})")


def tiles_of(tiles: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether tiles is a [in, out] weight in bf16_tiles' layout."""
    return tiles.dim() == 3 and tiles.shape == (-(-out_features // TILE), in_features, TILE)


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 tensor survives a round trip through bfloat16 unchanged."""
    return bool(torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight))
