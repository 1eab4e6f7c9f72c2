"""FP8 block checkpoints kept FP8 in the model (both GLM families; the default compute dtype and bfloat16): the logits
of the FP8 target equal those of its dequantized twin bit for bit on CPU (the torch path dequantizes a weight just
before its product, to the value a load-time dequantization gives it), greedy speculative == plain on it, and the
loader says what it kept, with its progress.
"""

import json
import logging

import pytest
import torch
from family_exactness import exactness_findings
from safetensors.torch import load_file, save_file
from test_glm5_next import prompt_ids, random_glm5, run
from test_glm_moe_dsa import dequantize_reference, quantize_blocks, random_glm

from verify_worker.target_loader import load_target

GLM_QUANTIZED = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight",
                 "mlp.experts.", "shared_experts.", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight")


def write_pair(src, dst, block: int, quantized: tuple[str, ...]):
    """dst/fp8: src with the 2-D weights named by `quantized` block-quantized; dst/twin: the
    same checkpoint holding the dequantized weights in float32. Returns both folders."""
    tensors = load_file(str(src / "model.safetensors"))
    fp8, twin = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and any(part in name for part in quantized):
            q, scale = quantize_blocks(tensor.float(), block)
            fp8[name], fp8[name[: -len(".weight")] + ".weight_scale_inv"] = q, scale
            twin[name] = dequantize_reference(q, scale, block)
        else:
            fp8[name] = twin[name] = tensor
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
             "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    folders = {}
    for kind, checkpoint in (("fp8", fp8), ("twin", twin)):
        folders[kind] = dst / kind
        folders[kind].mkdir()
        save_file(checkpoint, str(folders[kind] / "model.safetensors"))
        written = {**config, "quantization_config": quant} if kind == "fp8" else config
        (folders[kind] / "config.json").write_text(json.dumps(written))
    return folders["fp8"], folders["twin"]


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_an_fp8_target_equals_its_dequantized_twin_and_speculates_exactly(family, tmp_path, caplog):
    """Blocks of 8: the experts' gate|up halves are whole row blocks, so the experts stay FP8 too; GLM-5.2's
    kv_a_proj_with_mqa has a partial block (16 + 8 = 24 rows in blocks of 16 at block 16: the last check)."""
    if family == "glm_moe_dsa":
        random_glm(num_hidden_layers=3).save_pretrained(tmp_path / "src")
        fp8, twin = write_pair(tmp_path / "src", tmp_path, 8, GLM_QUANTIZED)
    else:  # KDA's o_proj quantized too (GLM-5.3-Flash's FP8 checkpoints leave KDA bfloat16): dequantized at load
        random_glm5().save_pretrained(tmp_path / "src")
        fp8, twin = write_pair(tmp_path / "src", tmp_path, 8, GLM_QUANTIZED)
    with caplog.at_level(logging.INFO, logger="dflash.target"):
        target = load_target(fp8)  # the default dtype: bfloat16 on a GPU, float32 or bfloat16 on a CPU (by its ISA)
    oracle = load_target(twin, dtype=str(target.embed_weight.dtype).removeprefix("torch."))
    kept = {name for name, tensor in target.state_dict().items() if tensor.dtype == torch.float8_e4m3fn}
    assert any(name.endswith("experts.gate_up_proj") for name in kept), kept
    assert any(name.endswith("q_b_proj.weight") for name in kept), kept
    assert not any("kv_b_proj" in name for name in kept), kept
    assert any("100%" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert any(f"{len(kept)} tensor(s) kept FP8" in r.getMessage() for r in caplog.records)
    assert not any("memory plan counted" in r.getMessage() for r in caplog.records)  # as published: as planned
    ids = prompt_ids(20, 5)
    pairs = [(target, oracle), (load_target(fp8, dtype="bfloat16"), load_target(twin, dtype="bfloat16"))]
    for model, twin_model in pairs:
        got, want = (m.logits(run(m, m.new_state(1, 32), ids, 0, 0).hidden) for m in (model, twin_model))
        assert torch.equal(got, want), model.embed_weight.dtype
    found = exactness_findings(target, oracle)
    assert found["speculative_equals_plain"] and found["tokens_equal_oracle"], found
    assert 1 < found["committed_per_step"] < 4, found  # drafts accepted and rejected


def test_a_checkpoint_with_fewer_fp8_weights_than_published_says_the_plan_undercounts(tmp_path, caplog):
    random_glm(num_hidden_layers=2, first_k_dense_replace=1, indexer_types=["full", "shared"]).save_pretrained(
        tmp_path / "src")
    fp8, _ = write_pair(tmp_path / "src", tmp_path, 8, tuple(q for q in GLM_QUANTIZED if q != "indexer.wk.weight"))
    with caplog.at_level(logging.INFO, logger="dflash.target"):
        target = load_target(fp8)
    assert target.state_dict()["model.layers.0.self_attn.indexer.wk.weight"].dtype != torch.float8_e4m3fn
    warned = [r.getMessage() for r in caplog.records if "memory plan counted" in r.getMessage()]
    assert warned and "0 more" in warned[0] and "1 fewer" in warned[0] and "indexer.wk.weight" in warned[0], warned
