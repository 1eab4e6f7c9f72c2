"""The row-invariant setups on CPU: a verify block's rows are bitwise the rows one-token decoding computes, so
speculative greedy output is exactly plain greedy output (no near-tie allowance), and the attention is still
attention. The setups:
- float32 on a bfloat16 checkpoint with the C++ CPU kernels (the "bf16" layout: row-invariant GEMM and
  attention), the demo's default where bfloat16 is not native; with a bfloat16 cache; bfloat16 products on AMX;
- the rows layout of --batch-invariant (made for GPUs: linear_rows for every product, cuda_ext's row norm and row
  attention, exact by construction; here linear_rows is oneDNN's batched matmul of one row per entry, whose bits
  did not depend on the entry count in any check); tests/test_row_gemm.py runs its GPU path;
- bfloat16 where the CPU has native bfloat16 (oneDNN GEMMs, batch_invariant_attention): these checks pass on their
  data, but oneDNN's products are row-invariant only in the common case (rare rows round differently between a
  one-row and a two-row product, or between batch counts: docs/decisions/0001-bfloat16-on-cpu-bit-for-bit.md), so
  this setup's greedy identity holds up to rare near-ties; the C++ kernels' setups are exact by construction."""

import json

import pytest
import torch
from conftest import write_hf_checkpoint
from torch.nn import functional as F

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from shared.attention import batch_invariant_attention, visibility_mask
from shared.cpu_kernels.library import cpu_kernels
from shared.demo_models import DEMO_DIR
from shared.dtype_choice import kv_cache_dtype, native_cpu_bfloat16, resolve_dtype
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPTS = DEMO_DIR.parent.parent / "benchmarks" / "prompts_heldout.json"
needs_native_bf16 = pytest.mark.skipif(not native_cpu_bfloat16(), reason="this CPU has no native bfloat16 matmul")
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")
needs_amx = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().amx, reason="no AMX here")
SETUPS = [pytest.param("bfloat16", marks=needs_native_bf16), pytest.param("float32 kernels", marks=needs_kernels),
          pytest.param("float32 kernels, bfloat16 cache", marks=needs_kernels),
          pytest.param("amx kernels, bfloat16 cache", marks=needs_amx),
          pytest.param("rows layout, bfloat16", marks=[needs_native_bf16, needs_kernels])]  # (the host builds: a compiler)


def _invariant_target(folder, setup: str):
    """The target as the setup runs it."""
    if setup == "bfloat16":
        return load_target(folder, dtype="bfloat16")
    if setup == "rows layout, bfloat16":  # what --batch-invariant loads (on CPU: linear_rows' batched matmul)
        target = load_target(folder, dtype="bfloat16", batch_invariant=True)
        assert target.rows_layout and target.model.layers[0].mlp.down_proj.layout == "rows"
        return target
    if setup == "float32 kernels, bfloat16 cache":  # what --dtype auto runs where the kernels run (one thread)
        target = load_target(folder, dtype="float32", pack=False).pack("bf16")
        target.kv_dtype = kv_cache_dtype("auto", "bfloat16", torch.float32, float32_kernels=True)
        assert target.whole_layers is not None and target.kv_dtype == torch.bfloat16
        return target
    if setup == "amx kernels, bfloat16 cache":  # what --dtype auto runs where the kernels run on AMX
        target = load_target(folder, dtype="float32", pack=False).pack("amx")
        target.kv_dtype = kv_cache_dtype("auto", "bfloat16", torch.float32, float32_kernels=True)
        assert target.whole_layers is not None and target.whole_layers.c_shape.amx == 1
        return target
    target = load_target(folder, dtype="float32", pack=False).pack("bf16")
    assert target.kernels is not None and target.model.layers[0].mlp.gate_up_proj.layout == "bf16"
    return target


@pytest.fixture(scope="module", params=SETUPS)
def bf16_target(tmp_path_factory, request):
    """A bfloat16 checkpoint in one of the row-invariant setups."""
    folder = tmp_path_factory.mktemp("bf16")
    write_hf_checkpoint(folder, "qwen3", seed=3, dtype=torch.bfloat16, max_position_embeddings=1024)
    return _invariant_target(folder, request.param)


def _prefilled(target, ids: torch.Tensor, slots: int = 1):
    cache = target.new_cache(slots, 1024)
    for slot in range(slots):
        target(ids[None], torch.arange(len(ids))[None], cache, torch.tensor([slot]))
    return cache


@pytest.mark.parametrize("context", [37, 64, 250])
def test_a_verify_block_computes_the_rows_of_one_token_steps_bit_for_bit(bf16_target, context):
    target, taps = bf16_target, (1, 3)
    ids = torch.randint(0, 128, (context + 8,), generator=torch.Generator().manual_seed(context))
    cache = _prefilled(target, ids[:context], slots=2)
    slot0, slot1 = torch.tensor([0]), torch.tensor([1])
    steps = [target(ids[None, context + i: context + i + 1], torch.tensor([[context + i]]), cache, slot0, taps)
             for i in range(8)]
    block = target(ids[None, context:], torch.arange(context, context + 8)[None], cache, slot1, taps)
    for i, step in enumerate(steps):
        assert torch.equal(step.taps[0, 0], block.taps[0, i]), f"row {i}: tapped features differ"
        assert torch.equal(target.logits(step.hidden[0, 0]), target.logits(block.hidden[0, i])), f"row {i}"


def test_a_requests_rows_do_not_depend_on_its_batch_neighbours(bf16_target):
    """A block verified next to a longer request (more keys, other positions) equals the block verified alone."""
    target = bf16_target
    gen = torch.Generator().manual_seed(9)
    short, long = torch.randint(0, 128, (30 + 8,), generator=gen), torch.randint(0, 128, (190 + 8,), generator=gen)
    cache = target.new_cache(3, 1024)
    for slot, ids in ((0, short), (1, long), (2, short)):
        target(ids[None, :-8], torch.arange(len(ids) - 8)[None], cache, torch.tensor([slot]))
    alone = target(short[None, -8:], torch.arange(30, 38)[None], cache, torch.tensor([0]))
    both = target(torch.stack([short[-8:], long[-8:]]), torch.stack([torch.arange(30, 38), torch.arange(190, 198)]),
                  cache, torch.tensor([2, 1]))
    assert torch.equal(target.logits(alone.hidden[0]), target.logits(both.hidden[0]))


@pytest.mark.parametrize("setup", SETUPS)
def test_the_demo_pair_speculates_exactly_the_plain_tokens(setup):
    target_dir = DEMO_DIR / "target"
    from tokenizers import Tokenizer

    target = _invariant_target(target_dir, setup)
    drafter = load_drafter(DEMO_DIR / "draft2", dtype=target.embed_weight.dtype)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    prompts = [p["prompt"] for p in json.loads(PROMPTS.read_text())[3:7]]
    requests = [GenerationRequest(tuple(tokenizer.encode(p).ids), 64) for p in prompts]
    plain = SpeculativeEngine(target, None, max_requests=4, max_model_len=1024).generate(requests)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=4,
                             max_model_len=1024, layout="amx" if setup.startswith("amx") else "auto")
    spec = SpeculativeEngine(target, proposer, max_requests=4, max_model_len=1024).generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.stats.committed_tokens for r in spec) / sum(r.stats.verify_steps for r in spec) > 1.5


@pytest.mark.parametrize("queries,keys", [(1, 5), (8, 70), (3, 128), (300, 320)])
def test_batch_invariant_attention_is_grouped_query_attention(queries, keys):
    """Same as torch's fused kernel in float32 (GQA: query head j reads KV head j // group), causal by position."""
    gen = torch.Generator().manual_seed(queries * keys)
    q = torch.randn(2, 4, queries, 16, generator=gen)
    k, v = torch.randn(2, 2, keys, 16, generator=gen), torch.randn(2, 2, keys, 16, generator=gen)
    positions = torch.arange(keys - queries, keys)[None].expand(2, -1)
    mask = visibility_mask(positions, keys)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    got = batch_invariant_attention(q, k, v, mask, 0.25)  # [b, queries, heads * dim]
    assert (got - want.transpose(1, 2).reshape(2, queries, 64)).abs().max() < 1e-5


def test_auto_dtype_is_bfloat16_on_cpu_only_where_it_is_native():
    native = native_cpu_bfloat16()
    assert resolve_dtype("auto", "bfloat16", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", "float16", "cpu") == torch.float32
    assert resolve_dtype("auto", "float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "bfloat16", "cuda:0") == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16", "cpu") == torch.float32


def test_auto_dtype_is_float32_where_the_cpu_kernels_run():
    """A model that runs float32 through the C++ kernels computes float32 on CPU, native bfloat16 or not (they
    beat oneDNN's bfloat16 at serving batch sizes); on an accelerator the flag changes nothing."""
    assert resolve_dtype("auto", "bfloat16", "cpu", float32_kernels=True) == torch.float32
    assert resolve_dtype("auto", "bfloat16", "cuda:0", float32_kernels=True) == torch.bfloat16
    # --dtype bfloat16 runs as auto where the kernels run (shared.dtype_choice.as_served), as asked elsewhere
    assert resolve_dtype("bfloat16", "bfloat16", "cpu", float32_kernels=True) == torch.float32
    assert resolve_dtype("bfloat16", "bfloat16", "cpu", float32_kernels=False) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", "bfloat16", torch.float32, float32_kernels=True) == torch.bfloat16
    # the cache: bfloat16 under float32 kernel maths for --dtype auto only, else the compute dtype
    assert kv_cache_dtype("auto", "bfloat16", torch.float32, float32_kernels=True) == torch.bfloat16
    assert kv_cache_dtype("float32", "bfloat16", torch.float32, float32_kernels=True) == torch.float32
    assert kv_cache_dtype("auto", "bfloat16", torch.float32, float32_kernels=False) == torch.float32
    assert kv_cache_dtype("auto", "float32", torch.float32, float32_kernels=True) == torch.float32
    assert kv_cache_dtype("auto", "bfloat16", torch.bfloat16, float32_kernels=False) == torch.bfloat16


def test_the_demo_target_loads_float32_on_the_kernels_where_they_run():
    from shared.demo_models import default_pair
    from shared.packed_linear import float32_kernels_run
    from verify_worker.target_loader import load_target

    target = load_target(default_pair().target)  # dtype auto, packed
    kernels = float32_kernels_run("cpu")
    want = torch.float32 if kernels or not native_cpu_bfloat16() else torch.bfloat16
    assert target.embed_weight.dtype == want
    assert (getattr(target, "whole_layers", None) is not None) == kernels
    assert target.new_cache(1, 8).keys[0].dtype == (torch.bfloat16 if kernels else want)  # (kernel maths: bf16)
    if kernels:  # bfloat16 products on AMX where it runs, float32 ones otherwise; --dtype float32: float32 always
        assert target.head.layout == ("amx" if cpu_kernels().amx else "bf16")
        assert target.whole_layers.c_shape.amx == (target.head.layout == "amx")
        assert load_target(default_pair().target, dtype="float32").head.layout == "bf16"
