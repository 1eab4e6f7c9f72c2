"""Run by tests/test_glm_moe_dsa.py with TRITON_INTERPRET=1 (Triton's interpreter: our Triton kernels on CPU tensors),
and by benchmarks/gpu_session.sh on a GPU (DFLASH_GROUPED_DEVICE=cuda, the compiled kernels): the GLM families'
Triton kernels (kernel_set.TritonKernels: cuda_ext/grouped_rows, latent_attention, index_scores) against PyTorch's
(the CPU family), each row against the same row computed alone, and a GLM-5.2-family target on them. Prints one JSON
object of findings; the test asserts on them. (tests/kda_fla_interpreted.py runs the glm5_next family on its GPU
kernels, these included.)

    TRITON_INTERPRET=1 python tests/glm_kernels_interpreted.py GLM_FOLDER [MORE_GLM_FOLDERS...]
    DFLASH_GROUPED_DEVICE=cuda python tests/glm_kernels_interpreted.py GLM_FOLDER [MORE_GLM_FOLDERS...]
"""

import json
import os
import sys

import torch
from family_exactness import exactness_findings

from cuda_ext.grouped_rows import reference
from cuda_ext.grouped_rows.kernel import BLOCK_M, grouped_rows
from verify_worker.families.common.fp8_blocks import dequantize
from verify_worker.families.common.kernel_check import KernelCheckError, check_kernels
from verify_worker.families.common.kernel_set import TorchKernels, TritonKernels, use_kernels
from verify_worker.families.common.moe import RoutedExperts
from verify_worker.target_loader import load_target

DEVICE = os.environ.get("DFLASH_GROUPED_DEVICE", "cpu")


def kernel_findings() -> dict:
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, BLOCK_M + 5, 1, 0, 2])  # an empty group, one past a whole tile, one row alone
    n, k = 80, 72  # neither a whole column block nor a whole K block
    x = torch.randn(int(counts.sum()), k, generator=generator).to(torch.bfloat16).to(DEVICE)
    weights = torch.randn(len(counts), n, k, generator=generator).to(torch.bfloat16).to(DEVICE)
    counts = counts.to(DEVICE)
    full = grouped_rows(x, weights, counts, out_dtype=torch.float32)
    want = reference.grouped_rows(x, weights, counts)
    alone, start = [], 0  # each row in a call of its own
    for group, count in enumerate(counts.tolist()):
        for row in range(start, start + count):
            one = torch.zeros_like(counts)
            one[group] = 1
            alone.append(grouped_rows(x[row:row + 1], weights, one, out_dtype=torch.float32))
        start += count
    # group 2's rows after dropping group 0's: each sits at another place in its tiles
    later = grouped_rows(x[3:], weights, torch.cat([counts[:1] * 0, counts[1:]]), out_dtype=torch.float32)
    return {
        "kernel_vs_float32": float((full - want).abs().max() / want.abs().max()),
        "rows_equal_alone": bool(torch.equal(full, torch.cat(alone))),
        "rows_equal_shifted": bool(torch.equal(full[3:], later)),
        # on a GPU the kernel rounds to bfloat16 itself (under the interpreter torch does: kernel.py)
        "bfloat16_output_is_rounded_float32": bool(torch.equal(grouped_rows(x, weights, counts),
                                                               full.to(torch.bfloat16))),
    }


def float32_rows_findings() -> dict:
    """What TritonKernels.rows runs on a GPU for a float32 product the row GEMM does not take (the mHC mixing, the
    router): grouped_rows with one group, float32 weights and activations (no TF32), against float64, and each row
    the same alone."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(19, 72, generator=generator).to(DEVICE)  # one full tile of 16 and a partial one
    weight = torch.randn(24, 72, generator=generator).to(DEVICE)  # N = 24: a partial column block
    counts = torch.tensor([19], device=DEVICE)
    full = grouped_rows(x, weight[None], counts)
    want = x.double() @ weight.double().t()
    one = torch.ones(1, dtype=torch.int64, device=DEVICE)
    alone = torch.cat([grouped_rows(x[r:r + 1], weight[None], one) for r in range(x.shape[0])])
    return {"float32_rows_vs_float64": float((full.double() - want).abs().max() / want.abs().max()),
            "float32_rows_equal_alone": bool(torch.equal(full, alone))}


def fp8_findings() -> dict:
    """FP8 block weights (blocks of 128 x 64, partial edge blocks) multiplied in the kernel against the same weights
    dequantized as the loader dequantizes them, for bfloat16 and float32 activations; a projection kept FP8
    (fp8_rows: one group) against its dequantized twin, PyTorch's product and its rows alone."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 19, 2])
    n, k, block = 136, 104, (128, 64)  # a 2 x 2 grid of blocks, the last row and column of them partial
    weights = (torch.randn(len(counts), n, k, generator=generator) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(len(counts), 2, 2, generator=generator) * 0.01 + 0.001
    found, triton_kernels = {}, TritonKernels()
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).split(".")[-1]
        twin = torch.stack([dequantize(w, s, block) for w, s in zip(weights, scales)]).to(dtype)  # at load
        x = torch.randn(int(counts.sum()), k, generator=generator).to(dtype)
        args = [t.to(DEVICE) for t in (x, weights, counts, scales)]
        kept = grouped_rows(args[0], args[1], args[2], out_dtype=torch.float32, scales=args[3], scale_block=block)
        dequantized = grouped_rows(args[0], twin.to(DEVICE), args[2], out_dtype=torch.float32)
        found[f"fp8_{name}_equals_dequantized"] = bool(torch.equal(kept, dequantized))
        rows = args[0][:7].view(1, 7, k)  # a projection's input [b, s, K]
        projected = triton_kernels.fp8_rows(rows, args[1][2], args[3][2], block)  # [1, 7, N]
        one_group = torch.tensor([7], device=DEVICE)
        twin_product = grouped_rows(rows[0], twin[2:3].to(DEVICE), one_group).view_as(projected)
        oracle = TorchKernels().fp8_rows(rows, args[1][2], args[3][2], block)
        alone = torch.cat([triton_kernels.fp8_rows(rows[:, i:i + 1], args[1][2], args[3][2], block)
                           for i in range(7)], 1)
        found[f"fp8_rows_{name}_equal_dequantized"] = bool(torch.equal(projected, twin_product))
        found[f"fp8_rows_{name}_vs_torch"] = float((projected.float() - oracle.float()).abs().max()
                                                   / oracle.float().abs().max())
        found[f"fp8_rows_{name}_rows_equal_alone"] = bool(torch.equal(projected, alone))
        w8a8, w8a8_torch = TritonKernels(fp8_activations=True), TorchKernels(fp8_activations=True)
        quantized = w8a8.grouped(args[0], args[1], args[2], args[3], block).float()  # W8A8: activations FP8 too
        found[f"w8a8_{name}_vs_torch"] = float((quantized - w8a8_torch.grouped(args[0], args[1], args[2], args[3],
                                                                               block).float()).abs().max()
                                               / quantized.abs().max())
        found[f"w8a8_{name}_vs_w8a16"] = float((quantized - kept).abs().max() / kept.abs().max())
        alone = torch.cat([w8a8.fp8_rows(rows[:, i:i + 1], args[1][2], args[3][2], block) for i in range(7)], 1)
        found[f"w8a8_{name}_rows_equal_alone"] = bool(torch.equal(w8a8.fp8_rows(rows, args[1][2], args[3][2], block),
                                                                  alone))
    return found


def experts_findings() -> dict:
    generator = torch.Generator().manual_seed(1)
    experts = RoutedExperts(experts=6, hidden=64, inner=48, limit=7.0)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    experts = experts.to(torch.bfloat16).to(DEVICE)
    x = torch.randn(9, 64, generator=generator).to(torch.bfloat16).to(DEVICE)
    ids = torch.stack([torch.randperm(6, generator=generator)[:3] for _ in range(9)]).to(DEVICE)  # top 3 of 6
    weights = torch.rand(9, 3, generator=generator).to(DEVICE)
    with torch.no_grad():
        loop = experts(x, ids, weights)
        experts.glm_kernels = TritonKernels()
        grouped = experts(x, ids, weights)
        alone = torch.cat([experts(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(9)])
    return {
        "experts_triton_vs_torch": float((grouped.float() - loop.float()).abs().max() / loop.float().abs().max()),
        "experts_rows_equal_alone": bool(torch.equal(grouped, alone)),
    }


def attention_findings() -> dict:
    """Latent attention and index scores, in float32 (the tiny checkpoints') and bfloat16, with GLM-5.2's rope part;
    the second batch entry's rows see only some keys, and none of the first chunk."""
    generator = torch.Generator().manual_seed(2)
    batch, seq, heads, latent_dim, rope, keys = 2, 3, 5, 48, 8, 150

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    found, triton_kernels, torch_kernels = {}, TritonKernels(), TorchKernels()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        q, q_rope = randn(batch, seq, heads, latent_dim, dtype=dtype), randn(batch, seq, heads, rope, dtype=dtype)
        latent, key_rope = randn(batch, keys, latent_dim, dtype=dtype), randn(batch, keys, rope, dtype=dtype)
        visible = torch.rand(batch, seq, keys, generator=generator) < 0.5
        visible[1, :, :80] = False  # no key of the first chunk (64 keys) and more
        visible[:, :, 130:] = False  # keys past the rows' own: a longer call must not change a bit
        visible[:, :, 0 if dtype == torch.float32 else 100] = True
        visible = visible.to(DEVICE)
        got = triton_kernels.latent_attention(q, q_rope, latent, key_rope, visible, 0.3)
        want = torch_kernels.latent_attention(q, q_rope, latent, key_rope, visible, 0.3)
        alone = torch.cat([triton_kernels.latent_attention(q[b:b + 1, i:i + 1], q_rope[b:b + 1, i:i + 1],
                                                           latent[b:b + 1], key_rope[b:b + 1],
                                                           visible[b:b + 1, i:i + 1], 0.3)
                           for b in range(batch) for i in range(seq)]).view_as(got)
        shorter = triton_kernels.latent_attention(q, q_rope, latent[:, :131], key_rope[:, :131], visible[..., :131],
                                                  0.3)
        found[f"attention_{name}_vs_torch"] = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        found[f"attention_{name}_rows_equal_alone"] = bool(torch.equal(got, alone))
        found[f"attention_{name}_equal_with_fewer_keys"] = bool(torch.equal(got, shorter))
        # the selected keys alone (width: a bound on any row's selection, as the indexer's top-k is)
        width = int(visible.sum(-1).max()) + 3
        picked = triton_kernels.latent_attention(q, q_rope, latent, key_rope, visible, 0.3, width)
        picked_alone = torch.cat([triton_kernels.latent_attention(q[b:b + 1, i:i + 1], q_rope[b:b + 1, i:i + 1],
                                                                  latent[b:b + 1], key_rope[b:b + 1],
                                                                  visible[b:b + 1, i:i + 1], 0.3, width)
                                  for b in range(batch) for i in range(seq)]).view_as(got)
        picked_shorter = triton_kernels.latent_attention(q, q_rope, latent[:, :131], key_rope[:, :131],
                                                         visible[..., :131], 0.3, width)
        found[f"selected_{name}_vs_torch"] = float((picked.float() - want.float()).abs().max()
                                                   / want.float().abs().max())
        found[f"selected_{name}_rows_equal_alone"] = bool(torch.equal(picked, picked_alone))
        found[f"selected_{name}_equal_with_fewer_keys"] = bool(torch.equal(picked, picked_shorter))
        try:
            triton_kernels.latent_attention(q, q_rope, latent, key_rope, visible, 0.3, width - 4)
            found[f"selected_{name}_too_narrow"] = "not raised"
        except RuntimeError as exc:
            found[f"selected_{name}_too_narrow"] = str(exc)
        index_q, index_keys = randn(batch, seq, 6, 32, dtype=dtype), randn(batch, keys, 32, dtype=dtype)
        head_weights = randn(batch, seq, 6, dtype=torch.float32)
        scores = triton_kernels.index_scores(index_q, index_keys, head_weights, 0.2)
        oracle = torch_kernels.index_scores(index_q, index_keys, head_weights, 0.2)
        one = triton_kernels.index_scores(index_q[1:, 2:], index_keys[1:, :33], head_weights[1:, 2:], 0.2)
        found[f"index_{name}_vs_torch"] = float((scores - oracle).abs().max() / oracle.abs().max())
        found[f"index_{name}_rows_equal_alone"] = bool(torch.equal(scores[1:, 2:, :33], one))
    return found


def pack_check_findings() -> dict:
    """The check kernels_for runs at pack on a GPU (kernel_check.py), here on the interpreted kernels; and what it says
    of a kernel that cannot launch."""
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        check_kernels(TritonKernels(), TorchKernels(), DEVICE, dtype)  # raises on a failure
        found[f"pack_check_{str(dtype).split('.')[-1]}_passes"] = True
    broken = TritonKernels()

    def no_launch(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    broken._attend = no_launch
    try:
        check_kernels(broken, TorchKernels(), DEVICE, torch.bfloat16)
        found["pack_check_names_a_failed_kernel"] = "not raised"
    except KernelCheckError as exc:
        found["pack_check_names_a_failed_kernel"] = str(exc)
    return found


def model_findings(folder: str) -> dict:
    oracle = load_target(folder)  # packed for the CPU: PyTorch's products
    target = load_target(folder, device=DEVICE)
    use_kernels(target, TritonKernels())
    return exactness_findings(target, oracle)


if __name__ == "__main__":
    folders = sys.argv[1:]  # the first one's findings unprefixed, the others' prefixed "model{i}_"
    models = {f"model{i}_{k}" if i else k: v for i, folder in enumerate(folders)
              for k, v in model_findings(folder).items()}
    print(json.dumps({"device": DEVICE, **kernel_findings(), **float32_rows_findings(), **fp8_findings(),
                      **experts_findings(), **attention_findings(), **pack_check_findings(), **models}))
