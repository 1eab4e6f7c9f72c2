"""Row tiles of a grouped product, computed on the device (no host synchronisation, a fixed count for a given row
count, so a step that uses them can be captured in a CUDA graph). Pure functions on tensors."""

import torch


def max_tiles(rows: int, groups: int, block_m: int) -> int:
    """An upper bound on the tiles of `rows` rows split among `groups` groups: each non-empty group wastes at most
    one partial tile, and at most min(groups, rows) groups are non-empty."""
    return -(-rows // block_m) + min(groups, rows)


def group_tiles(counts: torch.Tensor, block_m: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """counts [groups] (rows per group, the rows sorted by group) -> (group, first row, end row) per tile, each
    int32 [tiles]. Tile t covers rows [first, end) of one group, at most block_m of them; the tiles past the last
    one are empty (first = end = 0)."""
    counts = counts.to(torch.int64)
    groups = counts.shape[0]
    per_group = (counts + block_m - 1) // block_m  # [groups] tiles per group
    tile_ends = per_group.cumsum(0)  # [groups]
    group_rows = counts.cumsum(0) - counts  # [groups] each group's first row
    index = torch.arange(tiles, device=counts.device)  # [tiles]
    group = torch.searchsorted(tile_ends, index, right=True)  # [tiles]; groups past the last tile
    real = group < groups
    group = group.clamp(max=groups - 1)
    first = group_rows[group] + (index - (tile_ends - per_group)[group]) * block_m
    end = torch.minimum(first + block_m, group_rows[group] + counts[group])
    zero = torch.zeros_like(first)
    return (group.to(torch.int32), torch.where(real, first, zero).to(torch.int32),
            torch.where(real, end, zero).to(torch.int32))
