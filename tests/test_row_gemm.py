"""The row GEMM of cuda_ext (row_gemm/) and --batch-invariant, which serves through it on a GPU. Here (no GPU) the
parts that run on CPU: how K is sliced (never by the row count), the rows layout's wiring and refusals. On a GPU
(benchmarks/gpu_session.sh): the kernel against the float32 product, every row equal to the row computed alone at
any row count, a CUDA graph replay, and a Qwen3 target packed for --batch-invariant whose verify block gives the
rows of one-token steps bit for bit, so that greedy speculative decoding equals plain decoding exactly."""

import json

import pytest
import torch
from conftest import tiny_draft_config, write_hf_checkpoint

from cuda_ext import build
from cuda_ext.row_gemm import op, reference
from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import LocalProposer
from shared.dtype_choice import native_cpu_bfloat16
from shared.errors import ConfigError
from shared.generation_request import GenerationRequest
from shared.packed_linear import PackedLinear
from verify_worker.engine import SpeculativeEngine
from verify_worker.parallel.group import TensorParallel
from verify_worker.target_loader import load_target

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or build.cuda_library() is None,
                               reason="no GPU, or the CUDA build is off (benchmarks/gpu_session.sh runs these)")


@pytest.mark.parametrize("n,k", [(4096, 12288), (4096, 4096), (24576, 4096), (151936, 4096), (64, 128), (16, 16),
                                 (4096, 4112)])
@pytest.mark.parametrize("multiprocessors", [1, 48, 132])
def test_k_slices_cover_k_in_whole_tiles_and_depend_on_the_shape_alone(n, k, multiprocessors):
    length = op.slice_length(n, k, multiprocessors)
    slices = -(-k // length)
    assert length % op.TILE == 0 and length >= op.TILE
    assert (slices - 1) * length < k <= slices * length  # what kernel.cu accepts: no empty slice
    assert slices == 1 or length >= op.MIN_SLICE - op.TILE
    warps = n // op.TILE * slices
    assert slices == max(1, k // op.MIN_SLICE) or slices == 1 or warps >= op.WARPS_PER_MULTIPROCESSOR * multiprocessors


def test_slices_on_an_h200_give_the_narrow_layers_enough_warps():
    assert -(-12288 // op.slice_length(4096, 12288, 132)) == 9  # down_proj: 256 column tiles x 9 slices
    assert op.slice_length(151936, 4096, 132) == 4096  # the lm_head: one slice, 9496 column tiles


def test_the_rows_layout_takes_a_multiply_function_and_only_it_does():
    weight = torch.randn(32, 16)
    with pytest.raises(ValueError, match="rows layout"):
        PackedLinear(weight, None, "rows")
    with pytest.raises(ValueError, match="rows layout"):
        PackedLinear(weight, None, "fused", multiply=lambda x, w: x @ w.t())
    calls = []
    packed = PackedLinear(weight, torch.ones(32), "rows", multiply=lambda x, w: calls.append(x.shape) or x @ w.t())
    x = torch.randn(3, 16)
    assert torch.allclose(packed(x), x @ weight.t() + 1) and calls == [(3, 16)]


def test_row_gemm_does_not_take_cpu_tensors_or_float32_or_ragged_widths():
    assert not op.usable(torch.randn(2, 32), torch.randn(16, 32))
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert not op.usable(torch.randn(2, 32, device=cuda), torch.randn(16, 32, device=cuda))
        assert not op.usable(torch.randn(2, 40, device=cuda).bfloat16(), torch.randn(16, 40, device=cuda).bfloat16())


def test_batch_invariant_loading_is_refused_where_it_cannot_hold(tmp_path):
    glm = tmp_path / "glm"
    glm.mkdir()
    (glm / "config.json").write_text(json.dumps({"architectures": ["GlmMoeDsaForCausalLM"]}))
    with pytest.raises(ConfigError, match="not offered for glm_moe_dsa targets"):
        load_target(glm, batch_invariant=True)
    qwen = tmp_path / "qwen"
    write_hf_checkpoint(qwen, "qwen3")
    with pytest.raises(ConfigError, match="tensor parallelism 1"):
        load_target(qwen, tp=TensorParallel(rank=0, world_size=2), batch_invariant=True)


def test_a_float32_target_on_a_gpu_is_refused_by_name(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    write_hf_checkpoint(tmp_path, "qwen3")
    with pytest.raises(ConfigError, match="needs a bfloat16 model and cache"):
        load_target(tmp_path, device="cuda", dtype="float32", batch_invariant=True)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(64, 128), (4096, 12288), (1024, 4096), (48, 1040)])
def test_the_kernel_is_the_float32_product_and_its_rows_never_depend_on_the_others(dtype, n, k):
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, generator=generator, device="cuda") / k**0.5).to(dtype)
    x = torch.randn(300, k, generator=generator, device="cuda").to(dtype)
    assert op.usable(x, weight)
    full = op.row_gemm(x, weight)
    expected = reference.row_gemm(x, weight)
    assert full.dtype == dtype and full.shape == (300, n)
    assert (full.float() - expected.float()).abs().max().item() <= 0.02 * max(1.0, expected.float().abs().max().item())
    for rows in (1, 2, 9, 15, 16, 17, 64, 65, 144, 288):
        assert torch.equal(op.row_gemm(x[:rows], weight), full[:rows]), f"{rows} rows"
    assert torch.equal(op.row_gemm(x[7:16], weight), full[7:16])  # a row's place in its tile does not matter either
    shifted = torch.empty(300 * k + 8, dtype=dtype, device="cuda")[8:].view(300, k)  # 16 bytes off a 32-byte start
    shifted.copy_(x)
    assert shifted.data_ptr() % 32 and torch.equal(op.row_gemm(shifted[:16], weight), full[:16])  # copied to tiles
    assert torch.equal(op.row_gemm(x.t().contiguous().t()[:16], weight), full[:16])  # a strided view: copied too
    batched = op.row_gemm(x[:18].view(2, 9, k), weight)  # [..., K] inputs keep their leading shape
    assert batched.shape == (2, 9, n) and torch.equal(batched.view(18, n), full[:18])


@needs_gpu
def test_a_cuda_graph_replays_the_kernel():
    weight = torch.randn(256, 512, device="cuda").bfloat16()
    x = torch.randn(9, 512, device="cuda").bfloat16()
    eager = op.row_gemm(x, weight)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op.row_gemm(x, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op.row_gemm(x, weight)
    x.copy_(torch.randn(9, 512, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, op.row_gemm(x, weight)) and not torch.equal(captured, eager)


DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not native_cpu_bfloat16() or build.host_library() is None,
                                                        reason="no native bfloat16, or no C++ compiler")),
           pytest.param("cuda", marks=needs_gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def rows_target(tmp_path_factory, request):
    """A bfloat16 Qwen3 target as --batch-invariant loads it, on each device (on CPU: the rows layout's batched
    matmul, a check of these tests themselves; on a GPU: the row GEMM)."""
    folder = tmp_path_factory.mktemp("rows")
    write_hf_checkpoint(folder, "qwen3", seed=3, dtype=torch.bfloat16, max_position_embeddings=1024)
    target = load_target(folder, device=request.param, dtype="bfloat16", batch_invariant=True)
    assert target.rows_layout
    return target, torch.device(request.param)


@pytest.mark.parametrize("context", [37, 250, 700])
def test_a_verify_block_computes_the_rows_of_one_token_steps_bit_for_bit(rows_target, context):
    target, device = rows_target
    ids = torch.randint(0, 128, (context + 8,), generator=torch.Generator().manual_seed(context)).to(device)
    cache = target.new_cache(2, 1024)
    for slot in range(2):
        target(ids[None, :context], torch.arange(context, device=device)[None], cache,
               torch.tensor([slot], device=device))
    slot0, slot1 = torch.tensor([0], device=device), torch.tensor([1], device=device)
    steps = [target(ids[None, context + i: context + i + 1], torch.tensor([[context + i]], device=device), cache,
                    slot0, (1, 3)) for i in range(8)]
    block = target(ids[None, context:], torch.arange(context, context + 8, device=device)[None], cache, slot1, (1, 3))
    for i, step in enumerate(steps):
        assert torch.equal(step.taps[0, 0], block.taps[0, i]), f"row {i}: tapped features differ"
        assert torch.equal(target.logits(step.hidden[0, 0]), target.logits(block.hidden[0, i])), f"row {i}"


def test_greedy_speculative_decoding_is_plain_decoding_exactly(rows_target):
    """Batched or alone, speculative or plain: the same tokens, with no near-tie allowance."""
    target, device = rows_target
    drafter = random_drafter(tiny_draft_config(block_size=8), seed=1, std=0.2).to(device, target.embed_weight.dtype)
    prompts = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66, 67, 68], [100, 2]]

    def generate(with_drafts: bool, one_at_a_time: bool):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=4,
                                 max_model_len=256) if with_drafts else None
        engine = SpeculativeEngine(target, proposer, max_requests=1 if one_at_a_time else 4, max_model_len=256)
        results = engine.generate([GenerationRequest(tuple(p), 48) for p in prompts])
        assert not with_drafts or sum(r.stats.accepted_tokens for r in results) > 0  # drafts were verified
        return [r.token_ids for r in results]

    plain_alone = generate(False, True)
    assert generate(False, False) == plain_alone  # batched plain decoding: the same tokens as one at a time
    assert generate(True, False) == plain_alone  # and speculative, with no near-tie allowance


@needs_gpu
def test_the_row_gemm_op_has_a_consistent_fake_implementation():
    weight = torch.randn(64, 128, device="cuda").bfloat16()
    torch.library.opcheck(op.row_gemm_kernel, (torch.randn(5, 128, device="cuda").bfloat16(), weight),
                          test_utils=("test_schema", "test_faketensor"))
