"""Grouped products: the tiles of the Triton kernel, and the PyTorch path of the MoE experts and of MLA's per-head
products against the copies of weights they replaced (bit for bit). The Triton kernel itself runs under Triton's interpreter in test_glm_moe_dsa.py
(tests/glm_kernels_interpreted.py) and, for the glm5_next family, in test_glm5_next.py (kda_fla_interpreted.py)."""

import pytest
import torch
from torch.nn import functional as F

from cuda_ext.grouped_rows.tiles import group_tiles, max_tiles
from verify_worker.families.common.dense import clamp_gate_up
from verify_worker.families.common.kernel_set import TorchKernels
from verify_worker.families.common.mla import per_head
from verify_worker.families.common.moe import RoutedExperts
from verify_worker.families.common.row_invariant import elementwise_rows


@pytest.mark.parametrize("counts", [[0, 0, 5], [16, 1, 0, 33, 2], [1] * 9, [40], [0] * 4])
def test_tiles_cover_each_row_once_within_one_group(counts):
    block = 16
    counts = torch.tensor(counts)
    rows = int(counts.sum())
    tiles = max_tiles(rows, len(counts), block)
    group, first, end = group_tiles(counts, block, tiles)
    assert group.shape == first.shape == end.shape == (tiles,)
    starts = torch.cumsum(counts, 0) - counts
    covered = torch.zeros(rows, dtype=torch.int64)
    for g, a, b in zip(group.tolist(), first.tolist(), end.tolist()):
        if a == b:
            continue
        assert 0 < b - a <= block and starts[g] <= a and b <= starts[g] + counts[g]  # one group's rows
        covered[a:b] += 1
    assert torch.equal(covered, torch.ones(rows, dtype=torch.int64))


def gathered(experts: RoutedExperts, x, ids, weights):
    """The products as they were computed before: each token-expert pair's weights gathered, one bmm entry each."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    rows = x[:, None].expand(tokens, top_k, x.shape[-1]).reshape(tokens * top_k, 1, -1)
    gate, up = torch.bmm(rows, experts.gate_up_proj[flat].transpose(1, 2)).chunk(2, -1)
    gate, up = clamp_gate_up(gate, up, experts.limit)
    out = torch.bmm(elementwise_rows(F.silu, gate) * up, experts.down_proj[flat].transpose(1, 2))
    out = out.view(tokens, top_k, -1) * weights[..., None].to(out.dtype)
    total = out[:, 0]
    for slot in range(1, top_k):
        total = total + out[:, slot]
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_grouped_by_expert_equal_the_gathered_products_and_their_rows_alone(dtype):
    generator = torch.Generator().manual_seed(0)
    experts = RoutedExperts(experts=8, hidden=64, inner=40, limit=7.0)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    experts = experts.to(dtype)
    x = torch.randn(13, 64, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(13)])  # top 4 of 8
    weights = torch.rand(13, 4, generator=generator)
    with torch.no_grad():
        grouped = experts(x, ids, weights)
        assert torch.equal(grouped, gathered(experts, x, ids, weights))
        alone = torch.cat([experts(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(13)])
    assert torch.equal(grouped, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_products_equal_the_per_row_copies_and_their_rows_alone(dtype):
    """MLA's absorbed per-head products grouped by head against what they replaced: each row times a copy of its
    head's weight, one batched-matmul entry per row."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4, 24, generator=generator).to(dtype)  # [b, s, heads, i]
    w = torch.randn(4, 24, 40, generator=generator).to(dtype)  # [heads, i, o]
    grouped = per_head(x, w, TorchKernels())
    copies = torch.bmm(x.reshape(-1, 1, 24), w[None].expand(15, -1, -1, -1).reshape(60, 24, 40)).view(3, 5, 4, 40)
    assert torch.equal(grouped, copies)
    alone = per_head(x[1:2, 3:4], w, TorchKernels())
    assert torch.equal(grouped[1:2, 3:4], alone)


def test_the_torch_attention_holds_the_selection_bound_the_triton_kernel_relies_on():
    """A width (the indexer's bound on a selection) is checked on the PyTorch path too: within it the result is the
    masked attention's, past it an error, never a silent cut (the Triton kernel reads that many keys alone)."""
    generator = torch.Generator().manual_seed(0)
    q, latent = torch.randn(1, 2, 3, 8, generator=generator), torch.randn(1, 10, 8, generator=generator)
    no_rope = (q[..., :0], latent[..., :0])
    visible = torch.zeros(1, 2, 10, dtype=torch.bool)
    visible[..., :6] = True
    kernels = TorchKernels()
    masked = kernels.latent_attention(q, no_rope[0], latent, no_rope[1], visible, 0.3)
    assert torch.equal(kernels.latent_attention(q, no_rope[0], latent, no_rope[1], visible, 0.3, 6), masked)
    with pytest.raises(RuntimeError, match="more keys than the selection's width"):
        kernels.latent_attention(q, no_rope[0], latent, no_rope[1], visible, 0.3, 5)
