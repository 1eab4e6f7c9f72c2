"""GLM-5.2 (glm_moe_dsa) against transformers, the oracle, on a tiny random config it writes itself
(../shared/docs/glm-targets.md section 5): MLA with RoPE, the DSA indexer (full and shared layers, top-k
smaller than the context), sigmoid-routed group-limited MoE with a correction bias, dense first layers,
bf16 and FP8 block checkpoints.

transformers breaks top-k ties in no specified order (torch.topk); ours prefers the earlier key / expert, the
same way in decode and verify. ReLU index scores tie exactly at 0, so the oracle runs with torch.topk made
stable (`stable_topk`): what it then computes is transformers' model with our tie rule.
"""

import contextlib
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scripted_proposer import ScriptedProposer

from shared.errors import CheckpointError, ConfigError
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.families.common.fp8_blocks import dequantize
from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig
from verify_worker.families.interface import StepBatch
from verify_worker.target_loader import load_target

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
            q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=2,
            index_topk=6, index_head_dim=16, index_n_heads=4,
            index_topk_freq=2, index_skip_topk_offset=2,  # -> indexer_types full, full, shared, full, shared
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, tie_word_embeddings=False)
CONTEXT = 40  # well past index_topk: most rows attend to a sparse selection


@contextlib.contextmanager
def stable_topk():
    """torch.topk (function and method) with ties broken toward the lower index."""
    original_fn, original_method = torch.topk, torch.Tensor.topk

    def topk(input, k, dim=-1, largest=True, sorted=True, **_):
        order = torch.sort(input, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))

    torch.topk, torch.Tensor.topk = topk, topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = original_fn, original_method


def random_glm(seed: int = 0, **overrides):
    """transformers' GlmMoeDsaForCausalLM with weights drawn far from ties (std 0.2; norms, router bias and the
    indexer's LayerNorm perturbed so every parameter matters)."""
    import transformers

    config = transformers.GlmMoeDsaConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GlmMoeDsaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith(("norm.weight", "k_norm.weight")):
                tensor.copy_(1 + 0.1 * noise)
            elif name.endswith("e_score_correction_bias") or name.endswith("k_norm.bias"):
                tensor.copy_(0.5 * noise)
            else:
                tensor.copy_(0.2 * noise)
    return model


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm_moe_dsa")
    hf = random_glm()
    hf.save_pretrained(folder)
    return hf, load_target(folder), folder


def prompt_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), stable_topk():
        return hf(ids).logits.float()


def run(target, state, ids, positions, slots, taps=()):
    return target.step(StepBatch(ids, positions, slots), state, taps)


def prefill_logits(target, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one prompt [1, n] run in one step from an empty slot."""
    return target.logits(run(target, target.new_state(1, 64), ids, torch.arange(ids.shape[1])[None],
                             torch.tensor([0])).hidden)


def test_config_reads_the_published_keys():
    cfg = GlmMoeDsaConfig.from_dict({**TINY, "architectures": ["GlmMoeDsaForCausalLM"]})
    assert cfg.indexer_types == ("full", "full", "shared", "full", "shared")
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse", "sparse", "sparse")
    released = GlmMoeDsaConfig.from_dict({**TINY, "num_hidden_layers": 78, "index_topk_freq": 4,
                                          "index_skip_topk_offset": 3})
    full = [i for i, t in enumerate(released.indexer_types) if t == "full"]
    assert full[:5] == [0, 1, 2, 6, 10] and full[-1] == 74 and len(full) == 21  # the released GLM-5.2 schedule


@pytest.mark.parametrize("change, message", [
    ({"indexer_types": ["shared", "full", "full", "full", "full"]}, "first layer's indexer must be 'full'"),
    ({"indexer_types": ["full"] * 4}, "for each of the 5"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"n_group": 3}, "n_group 3 does not divide"),
    ({"num_key_value_heads": 1}, "num_key_value_heads == num_attention_heads"),
    ({"quantization_config": {"quant_method": "awq"}}, "only quant_method 'fp8'"),
])
def test_bad_configs_name_what_is_wrong(change, message):
    with pytest.raises(ConfigError, match=message):
        GlmMoeDsaConfig.from_dict({**TINY, **change})


def test_prefill_matches_transformers(glm):
    hf, target, _ = glm
    ids = prompt_ids(CONTEXT, 1)
    state = target.new_state(1, 64)
    got = target.logits(run(target, state, ids, torch.arange(CONTEXT)[None], torch.tensor([0])).hidden)
    want = hf_logits(hf, ids)
    assert (got - want).abs().max() < 1e-4
    assert state.nbytes() == target.state_bytes_per_slot(64)


def test_decode_after_prefill_matches_transformers_full_forward(glm):
    hf, target, _ = glm
    ids = prompt_ids(CONTEXT, 2)
    want = hf_logits(hf, ids)[0]  # [CONTEXT, vocab]
    state = target.new_state(2, 64)
    slot = torch.tensor([1])
    run(target, state, ids[:, :20], torch.arange(20)[None], slot)
    for position in range(20, CONTEXT):
        out = run(target, state, ids[:, position: position + 1], torch.tensor([[position]]), slot)
        assert (target.logits(out.hidden)[0, 0] - want[position]).abs().max() < 1e-4, position


def test_a_verify_block_equals_one_token_steps_bit_for_bit(glm):
    """The losslessness invariant: a row's logits and taps do not depend on the block or the batch it is in."""
    _, target, _ = glm
    ids = prompt_ids(CONTEXT, 3)
    other = prompt_ids(CONTEXT, 4)
    state = target.new_state(3, 64)
    context, taps = CONTEXT - 8, (1, 3)
    for slot, seq in ((0, ids), (1, ids), (2, other)):
        run(target, state, seq[:, :context], torch.arange(context)[None], torch.tensor([slot]))
    steps = [run(target, state, ids[:, context + i: context + i + 1], torch.tensor([[context + i]]),
                 torch.tensor([0]), taps) for i in range(8)]
    block_ids = torch.cat([ids[:, context:], other[:, context - 3: context + 5]])  # a neighbour, other lengths
    positions = torch.stack([torch.arange(context, context + 8), torch.arange(context - 3, context + 5)])
    block = run(target, state, block_ids, positions, torch.tensor([1, 2]), taps)
    one_by_one = torch.cat([s.hidden for s in steps], 1)
    assert torch.equal(block.hidden[:1], one_by_one)
    assert torch.equal(block.taps[:1], torch.cat([s.taps for s in steps], 1))
    assert torch.equal(target.logits(block.hidden[:1]), target.logits(one_by_one))


def test_speculative_greedy_equals_plain_and_transformers(glm):
    hf, target, _ = glm
    prompts = [prompt_ids(n, 10 + n)[0].tolist() for n in (3, 17, 30)]
    new_tokens = 24
    requests = [GenerationRequest(tuple(p), new_tokens, request_id=f"r{i}") for i, p in enumerate(prompts)]
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=128).generate(requests)
    for prompt, result in zip(prompts, plain):
        with torch.no_grad(), stable_topk():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert result.token_ids == out[0, len(prompt):].tolist()
    sequences = {r.request_id: list(r.prompt_ids) + p.token_ids for r, p in zip(requests, plain)}
    for buckets in (None, "eager"):  # "eager": each decode step padded as --cuda-graphs pads it (step_buckets.py)
        proposer = ScriptedProposer(sequences, block_size=8, num_layers=TINY["num_hidden_layers"])
        spec = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=128,
                                 step_buckets=buckets).generate(requests)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], buckets
        steps = sum(r.stats.verify_steps for r in spec)
        assert sum(r.stats.committed_tokens for r in spec) / steps > 2  # drafts were accepted, and rejected


def test_a_verify_block_then_rollback_continues_like_transformers(glm):
    """A block whose drafts go wrong after two, only the accepted prefix kept: the next steps (which overwrite
    the rejected positions) give transformers' logits of the true sequence."""
    hf, target, _ = glm
    ids = prompt_ids(CONTEXT, 9)
    want = hf_logits(hf, ids)[0]
    state, slot, start = target.new_state(1, 64), torch.tensor([0]), 24
    run(target, state, ids[:, :start], torch.arange(start)[None], slot)
    block = ids[:, start: start + 8].clone()
    block[0, 3:] = (block[0, 3:] + 1) % TINY["vocab_size"]  # rejected from the fourth token on
    out = run(target, state, block, torch.arange(start, start + 8)[None], slot)
    logits = target.logits(out.hidden)[0]
    assert (logits[:3] - want[start: start + 3]).abs().max() < 1e-4  # the accepted rows
    target.commit(state, slot, torch.tensor([3]))
    for position in range(start + 3, CONTEXT):
        step = run(target, state, ids[:, position: position + 1], torch.tensor([[position]]), slot)
        assert (target.logits(step.hidden)[0, 0] - want[position]).abs().max() < 1e-4, position


@pytest.mark.parametrize("block_size", [4, 8])
def test_a_random_dflash_drafter_attaches_and_stays_lossless(glm, block_size):
    """A DFlash drafter reads the GLM target's taps (decoder layer outputs) and drafts with its embedding and
    lm_head; greedy output equals plain decoding and transformers' generate."""
    from conftest import tiny_draft_config

    from draft_worker.draft_checkpoint import random_drafter
    from draft_worker.local_proposer import LocalProposer

    hf, target, _ = glm
    drafter = random_drafter(tiny_draft_config(target_layers=TINY["num_hidden_layers"], hidden=32,
                                               target_layer_ids=(1, 3), block_size=block_size), seed=4, std=0.2)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=block_size,
                             max_requests=2, max_model_len=128)
    prompts = [prompt_ids(n, 20 + n)[0].tolist() for n in (5, 26)]
    requests = [GenerationRequest(tuple(p), 16) for p in prompts]
    spec = SpeculativeEngine(target, proposer, max_requests=2, max_model_len=128).generate(requests)
    for prompt, result in zip(prompts, spec):
        with torch.no_grad(), stable_topk():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert result.token_ids == out[0, len(prompt):].tolist()
    assert sum(r.stats.draft_tokens for r in spec) > 0


def quantize_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference block quantizer: per block scale = max|w| / 448 (e4m3's largest), q = w / scale in e4m3."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.zeros(grid)
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max() / 448
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale[i, j]
    return out


def write_fp8_copy(src, dst, block: int = 16) -> dict[str, torch.Tensor]:
    """The checkpoint at src with every projection block-quantized (as GLM-5.2-FP8 ships: norms, router,
    embedding, lm_head and the indexer's head weights stay as they are); returns the dequantized tensors."""
    import json

    tensors = load_file(str(src / "model.safetensors"))
    kept = ("norm.weight", "norm.bias", "mlp.gate.weight", "e_score_correction_bias", "embed_tokens.weight",
            "lm_head.weight", "weights_proj.weight")
    out, dequantized = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and not name.endswith(kept):
            q, scale = quantize_blocks(tensor.float(), block)
            out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = q, scale
            dequantized[name] = dequantize_reference(q, scale, block)
        else:
            out[name] = dequantized[name] = tensor
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block],
                                     "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def test_fp8_block_checkpoint_stays_fp8_and_matches_transformers(glm, tmp_path):
    """The experts and projections stay FP8 blocks in the model (kv_b, read per head, is dequantized at load);
    partial blocks included: kv_a_proj_with_mqa has 16 + 8 = 24 rows in blocks of 16."""
    hf, _, folder = glm
    dequantized = write_fp8_copy(folder, tmp_path / "fp8")
    target = load_target(tmp_path / "fp8", dtype="float32")
    state = target.state_dict()
    fp8 = {name for name, tensor in state.items() if tensor.dtype == torch.float8_e4m3fn}
    assert "model.layers.2.mlp.experts.gate_up_proj" in fp8 and "model.layers.0.self_attn.q_b_proj.weight" in fp8
    assert "model.layers.0.self_attn.kv_b_proj.weight" not in fp8
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # the loader's blocks equal the reference's
    assert torch.equal(dequantize(state[name], state[name + "_scale_inv"], (16, 16)), dequantized[name])
    reference = random_glm()
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if name in dequantized:
                tensor.copy_(dequantized[name])
        for e in range(TINY["n_routed_experts"]):  # transformers stacks its experts
            for layer in (2, 3, 4):
                p = f"model.layers.{layer}.mlp.experts"
                gate_up = torch.cat([dequantized[f"{p}.{e}.gate_proj.weight"], dequantized[f"{p}.{e}.up_proj.weight"]])
                reference.state_dict()[f"{p}.gate_up_proj"][e].copy_(gate_up)
                reference.state_dict()[f"{p}.down_proj"][e].copy_(dequantized[f"{p}.{e}.down_proj.weight"])
    ids = prompt_ids(CONTEXT, 5)
    got = prefill_logits(target, ids)
    assert (got - hf_logits(reference, ids)).abs().max() < 1e-4
    assert (got - hf_logits(hf, ids)).abs().max() > 1e-3  # the quantization is real


def test_mtp_layers_are_skipped_and_named(glm, tmp_path, caplog):
    import shutil

    _, target, folder = glm
    copy = tmp_path / "with_mtp"
    shutil.copytree(folder, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.layers.5.eh_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.5.enorm.weight"] = torch.ones(32)
    save_file(tensors, str(copy / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="dflash.target"):
        loaded = load_target(copy, dtype="float32")
    assert "multi-token-prediction layer(s) [5]" in caplog.text
    ids = prompt_ids(12, 6)
    assert torch.equal(prefill_logits(loaded, ids), prefill_logits(target, ids))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"), "experts.5.up_proj.weight"),
    (lambda t: t.update({"model.layers.1.self_attn.indexer.extra": torch.zeros(2)}), "indexer.extra"),
    (lambda t: t.pop("model.layers.0.self_attn.indexer.wk.weight"), "indexer.wk.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 31)}), "o_proj.weight"),
])
def test_bad_checkpoints_name_the_tensor(glm, tmp_path, edit, message):
    import shutil

    _, _, folder = glm
    copy = tmp_path / "bad"
    shutil.copytree(folder, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_target(copy, dtype="float32")


def test_an_fp8_scale_that_does_not_fit_is_refused(glm, tmp_path):
    _, _, folder = glm
    write_fp8_copy(folder, tmp_path / "fp8")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_b_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight: scale grid \[1, 1\]"):
        load_target(tmp_path / "fp8", dtype="float32")


def test_a_checkpoint_that_does_not_fit_the_slices_or_the_format_is_refused_before_reading(glm, tmp_path):
    """Checked from the files' headers: a tensor a rank cuts from must have the size the split assumes (rank 1 of
    TP 2 would otherwise read rows that are not its own), and a weight with FP8 scales must be e4m3."""
    from verify_worker.parallel.group import TensorParallel

    _, _, folder = glm
    write_fp8_copy(folder, tmp_path / "fp8")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    short = dict(tensors)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight_scale_inv"):
        short[name] = short[name][:, : 16 if name.endswith("weight") else 1].contiguous()  # half its columns
    (tmp_path / "short").mkdir()
    save_file(short, str(tmp_path / "short" / "model.safetensors"))
    (tmp_path / "short" / "config.json").write_text((tmp_path / "fp8" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"o_proj\.weight'.*\[32, 16\]: 32 along dimension 1 expected"):
        load_target(tmp_path / "short", dtype="float32", tp=TensorParallel(1, 2), pack=False)
    tensors["model.layers.0.self_attn.q_a_proj.weight"] = tensors["model.layers.0.self_attn.q_a_proj.weight"].float()
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight has a weight_scale_inv but is F32"):
        load_target(tmp_path / "fp8", dtype="float32")


def test_random_schedules_of_shared_layers_stay_lossless(tmp_path):
    """full / shared runs in another order, and index_topk above some contexts (dense rows mixed in)."""
    rng = random.Random(7)
    types = ["full"] + [rng.choice(["full", "shared"]) for _ in range(3)]
    hf = random_glm(seed=3, num_hidden_layers=4, indexer_types=types, index_topk=10, first_k_dense_replace=1)
    hf.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    ids = prompt_ids(CONTEXT, 8)
    got = prefill_logits(target, ids)
    assert (got - hf_logits(hf, ids)).abs().max() < 1e-4


def test_dflash_serve_serves_a_glm_moe_dsa_target_with_its_defaults(tmp_path):
    """The whole product on a GLM-5.2 checkpoint: gateway, draft worker and verify worker with default flags;
    speculative greedy text equals plain decoding (num_speculative_tokens 0) and the engine's own plain output."""
    import json

    import httpx
    from conftest import tiny_draft_config
    from server_harness import CHAT_TEMPLATE, Server

    from draft_worker.draft_checkpoint import random_drafter, save_drafter
    from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer

    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    random_glm(seed=5, vocab_size=258, eos_token_id=256).save_pretrained(target_dir)
    write_byte_tokenizer(target_dir)
    (target_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT,
                                                                  "chat_template": CHAT_TEMPLATE}))
    drafter = random_drafter(tiny_draft_config(target_layers=TINY["num_hidden_layers"], vocab=258, hidden=32,
                                               target_layer_ids=(1, 3), block_size=4), seed=3, std=0.2)
    save_drafter(drafter, draft_dir)
    server = Server(target_dir, draft_dir, log_dir=tmp_path)
    try:
        server.wait_ready()
        outputs = {}
        for spec in (None, 0):
            body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0,
                    "return_token_ids": True, "ignore_eos": True}
            if spec is not None:
                body["num_speculative_tokens"] = spec
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            outputs[spec] = response.json()["choices"][0]["token_ids"]
        assert outputs[None] == outputs[0] and len(outputs[0]) == 20
        target = load_target(target_dir)
        prompt = list("def add(a, b):".encode())
        plain = SpeculativeEngine(target, None, max_requests=1, max_model_len=64).generate(
            [GenerationRequest(tuple(prompt), 20)])[0]
        assert plain.token_ids == outputs[0]
        cfg = target.config  # the start-up line reports the cache per request and per token
        per_token = (cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 3 * cfg.index_head_dim) * 4
        assert f"{per_token / 2**10:.1f} KiB per token" in server.stderr_path.read_text()
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def glm_tp2(glm, tmp_path_factory):
    """TP 2 over gloo on the FP8 copy (the plain layout's slices run in the engine test below)."""
    from tp_ranks import run_ranks, sparse_logits

    _, _, folder = glm
    fp8 = tmp_path_factory.mktemp("glm_fp8_tp") / "fp8"
    write_fp8_copy(folder, fp8)
    out = fp8 / "tp2.pt"
    run_ranks(sparse_logits, 2, str(fp8), str(out))
    return fp8, torch.load(out), torch.load(f"{out}.rank1")


def test_tp2_equals_tp1(glm_tp2):
    """Heads and expert columns split over two ranks, FP8 scales sliced with their weights: prefill, a verify
    block and its taps equal the single-process target's within float32 tolerance."""
    from tp_ranks import sparse_calls

    folder, got, _ = glm_tp2
    want = sparse_calls(load_target(folder, dtype="float32"))
    for key in ("prefill", "block", "taps"):
        assert (got[key] - want[key]).abs().max() < 1e-4, key


def test_each_tp_rank_holds_only_its_slice(glm_tp2):
    """The weights' slices (FP8 scales aside: a weight stays FP8 only where every rank's slice is whole blocks, so at
    these tiny widths TP 1 keeps the experts FP8 and both ranks of TP 2 dequantize them, alike)."""
    folder, rank0, rank1 = glm_tp2
    whole = {n: tuple(t.shape) for n, t in load_target(folder, dtype="float32").state_dict().items()
             if not n.endswith("_scale_inv")}
    split = ("q_b_proj", "kv_b_proj", "o_proj", "experts", "gate_proj", "up_proj", "down_proj", "embed_tokens",
             "lm_head")
    scaled = [{n for n in shapes if n.endswith("_scale_inv")} for shapes in (rank0["shapes"], rank1)]
    assert scaled[0] == scaled[1] and "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in scaled[0], scaled
    assert not any("experts" in name for name in scaled[0]), scaled
    for shapes in (rank0["shapes"], rank1):
        shapes = {n: shape for n, shape in shapes.items() if not n.endswith("_scale_inv")}
        assert set(shapes) == set(whole)
        for name, full in whole.items():
            halves = torch.Size(shapes[name]).numel() * 2 == torch.Size(full).numel()
            assert halves if any(part in name for part in split) and "gate.weight" not in name else \
                shapes[name] == full, name


def test_tp2_engine_greedy_equals_tp1(glm, tmp_path):
    from conftest import tiny_draft_config
    from tp_ranks import engine_generate, run_ranks

    from draft_worker.draft_checkpoint import random_drafter, save_drafter

    _, target, folder = glm
    save_drafter(random_drafter(tiny_draft_config(target_layers=TINY["num_hidden_layers"], hidden=32,
                                                  target_layer_ids=(1, 3), block_size=4), seed=4, std=0.2),
                 tmp_path / "draft")
    prompts = [prompt_ids(n, 30 + n)[0].tolist() for n in (4, 21, 33)]
    out = tmp_path / "engine.pt"
    run_ranks(engine_generate, 2, str(folder), str(tmp_path / "draft"), prompts, str(out))
    want = SpeculativeEngine(target, None, max_requests=3).generate([GenerationRequest(tuple(p), 24) for p in prompts])
    assert torch.load(out)["tokens"] == [r.token_ids for r in want]


def test_an_unserved_architecture_is_refused_naming_the_served_ones():
    from verify_worker.families.registry import family_for

    assert family_for({"architectures": ["GlmMoeDsaForCausalLM"]}).name == "glm_moe_dsa"
    assert family_for({"model_type": "glm_moe_dsa"}).name == "glm_moe_dsa"
    with pytest.raises(ConfigError, match="KimiLinearForCausalLM.*supported are .*GlmMoeDsaForCausalLM"):
        family_for({"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear"})


def test_verify_equals_decode_in_bfloat16_too(glm):
    _, _, folder = glm
    target = load_target(folder, dtype="bfloat16")
    ids = prompt_ids(CONTEXT, 3)
    state = target.new_state(2, 64)
    for slot in (0, 1):
        run(target, state, ids[:, :32], torch.arange(32)[None], torch.tensor([slot]))
    steps = [run(target, state, ids[:, 32 + i: 33 + i], torch.tensor([[32 + i]]), torch.tensor([0])).hidden
             for i in range(8)]
    block = run(target, state, ids[:, 32:40], torch.arange(32, 40)[None], torch.tensor([1])).hidden
    assert block.dtype == torch.bfloat16 and torch.equal(block, torch.cat(steps, 1))


def test_the_triton_kernels_are_row_invariant_and_serve_the_family_exactly(tmp_path):
    """The family's Triton kernels (kernel_set.TritonKernels: cuda_ext/grouped_rows, latent_attention,
    index_scores) under Triton's interpreter, in a process of its own (TRITON_INTERPRET must be set before Triton
    is imported): tests/glm_kernels_interpreted.py, on an FP8 checkpoint of two layers (a dense one with a full
    indexer, an MoE one that shares its selection: the interpreter runs a program in milliseconds)."""
    pytest.importorskip("triton")
    folder = tmp_path / "bf16"
    random_glm(num_hidden_layers=2, first_k_dense_replace=1, indexer_types=["full", "shared"]).save_pretrained(folder)
    write_fp8_copy(folder, tmp_path / "fp8")  # experts and projections kept FP8 (blocks of 16); kv_b bfloat16
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, str(here / "glm_kernels_interpreted.py"), str(tmp_path / "fp8")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # the grouped product against the float32 product of the same bfloat16 inputs (empty groups, partial tiles and
    # blocks included); a row's result the same bits alone, in a full tile, or at another place in its tiles
    assert found["kernel_vs_float32"] < 1e-5, found
    assert found["rows_equal_alone"] and found["rows_equal_shifted"], found
    # float32 products the row GEMM does not take (the mHC mixing, the router) on it as one group: IEEE float32
    assert found["float32_rows_vs_float64"] < 1e-6 and found["float32_rows_equal_alone"], found
    # FP8 blocks multiplied inside it (partial edge blocks included) give the dequantized twin's products bit for bit
    assert found["fp8_bfloat16_equals_dequantized"] and found["fp8_float32_equals_dequantized"], found
    for dtype, tolerance in (("bfloat16", 2e-2), ("float32", 1e-5)):  # a projection kept FP8 (one group)
        assert found[f"fp8_rows_{dtype}_equal_dequantized"] and found[f"fp8_rows_{dtype}_rows_equal_alone"], found
        assert found[f"fp8_rows_{dtype}_vs_torch"] < tolerance, found
        # W8A8 (activations quantized per row and 64 columns): PyTorch's W8A8 but for the order of the sums, rows
        # independent, and within the activations' rounding (e4m3: 3 mantissa bits) of W8A16
        w8a8_tolerance = {"bfloat16": 5e-4, "float32": 1e-6}[dtype]
        assert found[f"w8a8_{dtype}_vs_torch"] < w8a8_tolerance and found[f"w8a8_{dtype}_rows_equal_alone"], found
        assert 1e-4 < found[f"w8a8_{dtype}_vs_w8a16"] < 0.1, found
    # the MoE experts on it: close to PyTorch's products, and each token's row the same alone
    assert found["experts_triton_vs_torch"] < 2e-2 and found["experts_rows_equal_alone"], found
    # attention and the indexer's scores against PyTorch's (float32: another order of the same sums; bfloat16: the
    # probabilities rounded before the weighted sum), each row the same alone, and with fewer keys past its own
    assert found["attention_float32_vs_torch"] < 1e-5 and found["attention_bfloat16_vs_torch"] < 2e-2, found
    assert found["index_float32_vs_torch"] < 1e-5 and found["index_bfloat16_vs_torch"] < 1e-5, found
    for dtype in ("float32", "bfloat16"):
        assert found[f"attention_{dtype}_rows_equal_alone"] and found[f"index_{dtype}_rows_equal_alone"], found
        assert found[f"attention_{dtype}_equal_with_fewer_keys"], found
        # the selected keys' latents alone (a width bounds the selection): as close, each row the same alone and
        # with fewer keys; a selection wider than the width is an error, not a silent cut
        assert found[f"selected_{dtype}_vs_torch"] < {"float32": 1e-5, "bfloat16": 2e-2}[dtype], found
        assert found[f"selected_{dtype}_rows_equal_alone"] and found[f"selected_{dtype}_equal_with_fewer_keys"], found
        assert "more keys than the selection's width" in found[f"selected_{dtype}_too_narrow"], found
    # the check a GPU runs at pack passes on them, and names a kernel that cannot launch
    assert found["pack_check_float32_passes"] and found["pack_check_bfloat16_passes"], found
    assert "kernel 'latent_attention' failed" in found["pack_check_names_a_failed_kernel"], found
    assert "out of resource" in found["pack_check_names_a_failed_kernel"], found
    # the family on them, an FP8 checkpoint (every kernel: the projections' fp8_rows, the experts' grouped product
    # with scales, MLA's per-head products without, attention, the indexer): greedy speculative == plain with right
    # and wrong drafts (drafts accepted), and plain decoding gives the CPU family's tokens or differs only at a
    # near-tie (the script raises otherwise)
    assert found["kernels"] == ["triton"], found
    assert found["speculative_equals_plain"] and 1 < found["committed_per_step"] < 4, found
