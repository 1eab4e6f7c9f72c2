"""The cached, batched DFlash drafter equals a direct uncached implementation of the published maths."""

import copy

import pytest
import torch
from conftest import tiny_draft_config
from torch.nn import functional as F

from draft_worker.draft_checkpoint import random_drafter
from shared.cpu_kernels.library import cpu_kernels


def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta=10000.0):
    """x [heads, seq, dim] rotated at positions [seq] (rotate-half convention)."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv[None]  # [seq, dim/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(model, embed, lm_head, features, anchor):
    """Section 2 of dflash-reference.md, for one request: context rows are fed to k/v projections in every
    layer, queries come from the block, attention is bidirectional over [context ; block]."""
    cfg = model.config
    ctx_len, block = features.shape[0], cfg.block_size
    c = rms(features @ model.fc.weight.T, model.hidden_norm.weight)  # [ctx, hidden]
    x = embed[torch.tensor([anchor] + [cfg.mask_token_id] * (block - 1))]  # [B, hidden]
    positions = torch.arange(ctx_len + block)
    for layer in model.layers:
        attn = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        rows = torch.cat([c, h])  # [ctx + B, hidden]
        q = (h @ attn.q_proj.weight.T).view(block, cfg.num_heads, cfg.head_dim)
        k = (rows @ attn.k_proj.weight.T).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = (rows @ attn.v_proj.weight.T).view(-1, cfg.num_kv_heads, cfg.head_dim)
        q = rope(rms(q, attn.q_norm.weight).transpose(0, 1), positions[ctx_len:])  # [heads, B, dim]
        k = rope(rms(k, attn.k_norm.weight).transpose(0, 1), positions)  # [kv_heads, ctx+B, dim]
        v = v.transpose(0, 1)
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        weights = torch.softmax(q @ k.transpose(1, 2) / cfg.head_dim**0.5, -1)  # [heads, B, ctx+B]
        out = (weights @ v).transpose(0, 1).reshape(block, -1)
        x = x + out @ attn.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(x, model.norm.weight)[1:] @ lm_head.T  # [B-1, vocab]


@pytest.mark.parametrize("layout", [None, "transposed", "bf16"])
def test_cached_batched_drafter_matches_reference(layout):
    """Unpacked, packed for PyTorch's GEMM, and packed for the C++ CPU kernels (bfloat16 weights, fused norms,
    rotary, cache writes and attention)."""
    if layout == "bf16" and cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels do not build here")
    cfg = tiny_draft_config(layers=2, block_size=6)
    reference = random_drafter(cfg, seed=3, std=0.2)
    with torch.no_grad():  # weights a bfloat16 checkpoint could hold, so that the "bf16" layout applies
        for param in reference.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model = copy.deepcopy(reference).pack(layout) if layout else reference
    if layout == "bf16":
        assert model.kernels is not None and model.layers[0].self_attn.kv_proj.layout == "bf16"
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    lengths = [5, 11, 1]
    features = [torch.randn(n, cfg.num_taps * cfg.hidden_size, generator=gen) for n in lengths]
    anchors = [7, 3, 90]
    cache = model.new_cache(4, 64)
    slots = torch.tensor([3, 0, 2])
    # ingest context in two uneven pieces per request, as verify steps would deliver it
    for piece in range(2):
        rows, row_slots, positions = [], [], []
        for slot, f in zip(slots.tolist(), features):
            cut = len(f) // 2
            part = f[:cut] if piece == 0 else f[cut:]
            start = 0 if piece == 0 else cut
            rows.append(part)
            row_slots += [slot] * len(part)
            positions += list(range(start, start + len(part)))
        model.ingest_context(cache, torch.tensor(row_slots), torch.tensor(positions), torch.cat(rows))
    ids = torch.full((3, cfg.block_size), cfg.mask_token_id)
    ids[:, 0] = torch.tensor(anchors)
    hidden = model.block_hidden(cache, slots, torch.tensor(lengths), embed[ids])
    logits = model.logits(hidden[:, 1:], lm_head)
    for row in range(3):
        want = reference_block_logits(reference, embed, lm_head, features[row], anchors[row])
        assert (logits[row] - want).abs().max() < 1e-4
    # a second draft from the same context gives the same answer: block rows never stay in the cache
    again = model.logits(model.block_hidden(cache, slots, torch.tensor(lengths), embed[ids])[:, 1:], lm_head)
    assert torch.equal(again, logits)


def test_sliding_window_layers_are_causal_in_the_block_unless_is_causal_is_false():
    base = tiny_draft_config(layers=1, block_size=4)
    sliding = tiny_draft_config(layers=1, block_size=4, layer_types=("sliding_attention",), sliding_window=64)
    explicit = tiny_draft_config(layers=1, block_size=4, layer_types=("sliding_attention",), sliding_window=64,
                                 is_causal=False)
    assert not base.layer_is_causal(0) and sliding.layer_is_causal(0) and not explicit.layer_is_causal(0)
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(base.vocab_size, base.hidden_size, generator=gen)
    feats = torch.randn(6, base.num_taps * base.hidden_size, generator=gen)
    outputs = []
    for cfg in (base, sliding, explicit):
        model = random_drafter(cfg, seed=4, std=0.2)
        cache = model.new_cache(1, 32)
        model.ingest_context(cache, torch.zeros(6, dtype=torch.long), torch.arange(6), feats)
        ids = torch.tensor([[5, cfg.mask_token_id, cfg.mask_token_id, cfg.mask_token_id]])
        outputs.append(model.block_hidden(cache, torch.tensor([0]), torch.tensor([6]), embed[ids]))
    assert torch.allclose(outputs[0], outputs[2])  # window 64 covers everything: same as full attention
    assert torch.allclose(outputs[0][:, -1], outputs[1][:, -1], atol=1e-5)  # the last row sees all in both
    assert not torch.allclose(outputs[0][:, 0], outputs[1][:, 0])  # the anchor row no longer sees the masks
