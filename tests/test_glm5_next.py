"""GLM-5.3-Flash (glm5_next) against transformers, the oracle, on the tiny config of
../shared/docs/glm-targets.md section 5: KDA layers, pooled DSA (index_topk 8 < the context, kpool 4, a shared
indexer layer), mHC streams, dense-first clamped MoE, written by transformers as a multimodal checkpoint.

The oracle runs with a stable torch.topk (see test_glm_moe_dsa.py). Speculative rollback is checked tensor by
tensor: after a verify block and a commit of part of it, every KDA state and conv window equals what plain
decoding of the kept tokens leaves.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripted_proposer import ScriptedProposer
from test_glm_moe_dsa import stable_topk

from shared.errors import ConfigError
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.families.interface import StepBatch
from verify_worker.target_loader import load_target

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
            q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True,
            layer_types=["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                         "linear_attention", "linear_attention", "deepseek_sparse_attention"],
            indexer_types=["full", "full", "shared", "full", "full", "full"],
            mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
            index_topk=8, index_kpool=4, index_head_dim=16, index_n_heads=4, index_kpool_always_select_tail=True,
            linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
            hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, rms_norm_eps=1e-5,
            pad_token_id=0, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
            max_position_embeddings=256)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, image_size=4, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, projection_intermediate_size=32)
CONTEXT = 36
HERE = Path(__file__).resolve().parent


def random_glm5(seed: int = 0, **overrides):
    """transformers' Glm5NextForConditionalGeneration, every text parameter perturbed so it matters (random init
    leaves the pooling gate, the mHC bases and the router bias at constants)."""
    import transformers

    config = transformers.Glm5NextConfig(text_config={**TEXT, **overrides}, vision_config=VISION)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Glm5NextForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if "visual" in name:
                continue
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * noise)
            elif name.endswith(("hc.scale",)):
                tensor.copy_(1 + 0.2 * noise)
            elif name.endswith(("e_score_correction_bias", "k_norm.bias", "hc.base", "compress_ape", "dt_bias")):
                tensor.copy_(0.5 * noise)
            elif name.endswith("A_log"):
                tensor.copy_(0.3 * noise)
            else:
                tensor.copy_(0.2 * noise)
    return model


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm5_next")
    hf = random_glm5()
    hf.save_pretrained(folder)
    return hf, load_target(folder), folder


def prompt_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TEXT["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), stable_topk():
        return hf(input_ids=ids).logits.float()


def run(target, state, ids, start, slot, taps=(), lengths=None):
    positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    return target.step(StepBatch(ids, positions, torch.as_tensor(slot).reshape(-1), lengths), state, taps)


def test_config_reads_the_published_spellings():
    cfg = Glm5NextConfig.from_dict({"architectures": ["Glm5NextForConditionalGeneration"], "text_config": TEXT})
    assert cfg.layer_types == ("linear", "indexed", "indexed", "linear", "linear", "indexed")
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel, cfg.gate_lower_bound) == (2, 16, 4, -5.0)
    default = Glm5NextConfig.from_dict({**TEXT, "layer_types": None, "indexer_types": None, "mlp_layer_types": None,
                                       "num_hidden_layers": 45})
    assert default.layer_types.count("linear") == 34 and default.layer_types[3::4] == ("indexed",) * 11
    with pytest.raises(ConfigError, match="layer 5's indexer is 'shared' but layer 4 is not a full indexed layer"):
        Glm5NextConfig.from_dict({**TEXT, "indexer_types": ["full", "full", "shared", "full", "full", "shared"]})
    with pytest.raises(ConfigError, match="qk_rope_head_dim 8"):
        Glm5NextConfig.from_dict({**TEXT, "qk_rope_head_dim": 8})


def test_prefill_and_taps_match_transformers(glm5):
    hf, target, _ = glm5
    ids = prompt_ids(CONTEXT, 1)
    out = run(target, target.new_state(1, 64), ids, 0, 0, taps=(1, 4, 5))
    with torch.no_grad(), stable_topk():
        ref = hf(input_ids=ids, output_hidden_states=True)
        captured = {}
        hook = hf.model.language_model.norm.register_forward_pre_hook(lambda _, args: captured.update(x=args[0]))
        hf(input_ids=ids)
        hook.remove()
    assert (target.logits(out.hidden) - ref.logits).abs().max() < 1e-4
    taps = out.taps.view(1, CONTEXT, 3, TEXT["hidden_size"])
    streams = ref.hidden_states  # [b, s, N, D] per layer output (the last one is normed)
    assert (taps[:, :, 0] - streams[2].mean(2)).abs().max() < 1e-4  # tap i = layer i's output, streams averaged
    assert (taps[:, :, 1] - streams[5].mean(2)).abs().max() < 1e-4
    assert (taps[:, :, 2] - captured["x"]).abs().max() < 1e-4  # the final layer: the pre-norm mean


def test_decode_after_prefill_matches_transformers(glm5):
    hf, target, _ = glm5
    ids = prompt_ids(CONTEXT, 2)
    want = hf_logits(hf, ids)[0]
    state = target.new_state(2, 64)
    run(target, state, ids[:, :20], 0, 1)
    target.commit(state, torch.tensor([1]), torch.tensor([20]))
    for position in range(20, CONTEXT):
        out = run(target, state, ids[:, position: position + 1], position, 1)
        target.commit(state, torch.tensor([1]), torch.tensor([1]))
        assert (target.logits(out.hidden)[0, 0] - want[position]).abs().max() < 1e-4, position


def kda_tensors(state, slot: int) -> list[torch.Tensor]:
    return [t[slot] for layer in sorted(state.recurrent) for t in
            (state.recurrent[layer].committed, state.recurrent[layer].committed_window)]


def test_verify_equals_decode_and_a_commit_leaves_plain_decodings_state(glm5):
    """A block of 8 (its later drafts wrong), beside a neighbour row of another length, equals 8 one-token steps
    bit for bit; committing 3 of it leaves the KDA states of plain decoding of those 3, tensor by tensor; the
    next steps then give transformers' logits of the true sequence."""
    hf, target, _ = glm5
    ids, other = prompt_ids(CONTEXT, 3), prompt_ids(CONTEXT, 4)
    context, taps = 24, (0, 2)
    state = target.new_state(3, 64)
    for slot, seq in ((0, ids), (1, ids), (2, other)):
        run(target, state, seq[:, :context], 0, slot)
        target.commit(state, torch.tensor([slot]), torch.tensor([context]))
    block = ids[:, context: context + 8].clone()
    block[0, 3:] = (block[0, 3:] + 1) % TEXT["vocab_size"]
    steps = []
    for i in range(8):  # slot 0: plain one-token decoding of the same (wrong) tokens
        steps.append(run(target, state, block[:, i: i + 1], context + i, 0, taps))
        target.commit(state, torch.tensor([0]), torch.tensor([1]))
        if i == 2:
            after_three = [t.clone() for t in kda_tensors(state, 0)]
    rows = torch.cat([block, torch.cat([other[:, context: context + 5], torch.zeros(1, 3, dtype=torch.long)], 1)])
    positions = torch.stack([torch.arange(context, context + 8), torch.arange(context, context + 8)])
    verify = target.step(StepBatch(rows, positions, torch.tensor([1, 2]), torch.tensor([8, 5])), state, taps)
    one_by_one = torch.cat([s.hidden for s in steps], 1)
    assert torch.equal(verify.hidden[:1], one_by_one)
    assert torch.equal(verify.taps[:1], torch.cat([s.taps for s in steps], 1))
    target.commit(state, torch.tensor([1, 2]), torch.tensor([3, 5]))
    for got, want in zip(kda_tensors(state, 1), after_three):
        assert torch.equal(got, want)
    want_logits = hf_logits(hf, ids)[0]
    assert (target.logits(verify.hidden[0, :3]) - want_logits[context: context + 3]).abs().max() < 1e-4
    for position in range(context + 3, CONTEXT):
        out = run(target, state, ids[:, position: position + 1], position, 1)
        target.commit(state, torch.tensor([1]), torch.tensor([1]))
        assert (target.logits(out.hidden)[0, 0] - want_logits[position]).abs().max() < 1e-4, position


def test_a_commit_of_nothing_and_a_reset_restore_the_slot(glm5):
    _, target, _ = glm5
    ids = prompt_ids(20, 5)
    state = target.new_state(1, 64)
    run(target, state, ids[:, :12], 0, 0)
    target.commit(state, torch.tensor([0]), torch.tensor([12]))
    before = [t.clone() for t in kda_tensors(state, 0)]
    run(target, state, ids[:, 12:], 12, 0)
    target.commit(state, torch.tensor([0]), torch.tensor([0]))  # an undone step
    assert all(torch.equal(a, b) for a, b in zip(kda_tensors(state, 0), before))
    target.reset(state, 0)
    assert all(not t.any() for t in kda_tensors(state, 0))


@pytest.mark.parametrize("where", ["forward", "keep", "replay"])
def test_a_step_that_fails_midway_is_undone_and_the_slot_decodes_on_exactly(glm5, where):
    """A step that raises in the second KDA layer after the first did its part: at the layer's start (forward),
    after it wrote its tip (keep), or in the commit after the first layer replayed (replay: out of memory, say). The
    engine then commits nothing for the slot: every layer's state is as before the step, and the slot's next verify
    block and partial commit give the states of a slot that never failed."""
    _, target, _ = glm5
    ids = prompt_ids(20, 6)
    states = [target.new_state(1, 64) for _ in range(2)]
    for state in states:
        run(target, state, ids[:, :12], 0, 0)
        target.commit(state, torch.tensor([0]), torch.tensor([12]))
    failed = states[0]
    before = [t.clone() for t in kda_tensors(failed, 0)]
    layer = list(failed.recurrent)[1]
    second = target.model.layers[layer].self_attn if where == "forward" else failed.recurrent[layer]

    def boom(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    setattr(second, where, boom)  # the instance's own: the class's method again once deleted
    try:
        with pytest.raises(RuntimeError, match="a kernel failed"):
            run(target, failed, ids[:, 12:18], 12, 0)
            target.commit(failed, torch.tensor([0]), torch.tensor([3]))
    finally:
        delattr(second, where)
    target.commit(failed, torch.tensor([0]), torch.tensor([0]))
    assert all(torch.equal(a, b) for a, b in zip(kda_tensors(failed, 0), before))
    for state in states:
        run(target, state, ids[:, 12:18], 12, 0)
        target.commit(state, torch.tensor([0]), torch.tensor([4]))
    assert all(torch.equal(a, b) for a, b in zip(kda_tensors(states[0], 0), kda_tensors(states[1], 0)))


def test_prompt_chunks_start_at_multiples_of_the_recurrences_chunk(glm5):
    """A recurrence with a chunked form for prompts (fla's chunk_kda on a GPU: prefill_align 64) has every prompt
    chunk start at a multiple of its chunk, however the prefill budget is shared: here a stand-in of 16 on CPU, with
    a budget of 40 shared by three prompts. The prompt chunks reach it flagged, and the tokens are those of a
    recurrence without one; a budget below the chunk is refused."""
    from verify_worker.families.common.kda_recurrence import TorchRecurrence

    _, target, _ = glm5

    class Aligned(TorchRecurrence):
        prefill_align = 16

        def run_prompt(self, state, q, k, v, decay, g, beta, live):
            return self.run(state, q, k, v, decay, g, beta, live)

    recorded = []
    step = target.step

    def spy(batch, state, taps=()):
        if batch.prefill:
            recorded.extend(batch.positions[:, 0].tolist())
        return step(batch, state, taps)

    prompts = [prompt_ids(n, 70 + n)[0].tolist() for n in (37, 23, 50)]
    requests = [GenerationRequest(tuple(p), 8, request_id=f"r{i}") for i, p in enumerate(prompts)]
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=128,
                              max_prefill_tokens=40).generate(requests)
    target.use_recurrence(Aligned())
    target.step = spy  # the instance's own: the class's method again once deleted
    try:
        assert target.prefill_align == 16
        aligned = SpeculativeEngine(target, None, max_requests=3, max_model_len=128,
                                    max_prefill_tokens=40).generate(requests)
        with pytest.raises(ConfigError, match="max_prefill_tokens must be >= 16"):
            SpeculativeEngine(target, None, max_prefill_tokens=8)
    finally:
        del target.step
        target.use_recurrence(TorchRecurrence())
    assert recorded and all(start % 16 == 0 for start in recorded), recorded
    assert any(start > 0 for start in recorded)  # prompts were split
    assert [r.token_ids for r in aligned] == [r.token_ids for r in plain]


def test_speculative_greedy_equals_plain_and_transformers(glm5):
    hf, target, _ = glm5
    prompts = [prompt_ids(n, 10 + n)[0].tolist() for n in (2, 9, 17, 26, 31)]
    new_tokens = 64
    requests = [GenerationRequest(tuple(p), new_tokens, request_id=f"r{i}") for i, p in enumerate(prompts)]
    plain = SpeculativeEngine(target, None, max_requests=5, max_model_len=128).generate(requests)
    for prompt, result in zip(prompts[:2], plain[:2]):  # transformers' generate is slow: two prompts
        with torch.no_grad(), stable_topk():
            out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert result.token_ids == out[0, len(prompt):].tolist()
    sequences = {r.request_id: list(r.prompt_ids) + p.token_ids for r, p in zip(requests, plain)}
    for buckets in (None, "eager"):  # "eager": each decode step padded as --cuda-graphs pads it (step_buckets.py)
        proposer = ScriptedProposer(sequences, block_size=8, num_layers=TEXT["num_hidden_layers"])
        spec = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=128,
                                 step_buckets=buckets).generate(requests)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], buckets
        steps = sum(r.stats.verify_steps for r in spec)
        assert sum(r.stats.committed_tokens for r in spec) / steps > 2  # drafts were accepted, and rejected


def test_a_padded_step_gives_the_real_rows_and_leaves_their_states_as_the_unpadded_one(glm5):
    """What --cuda-graphs runs (verify_worker/step_buckets.py): its warm-up's placeholder rows, then rows padded to a
    power of two in a scratch slot, tokens padded to the block after a row's real ones, keys to the bucket. The
    real rows' outputs equal the unpadded step's bit for bit, and after a partial commit so do their KDA states and
    conv windows; the next step's too; the scratch slot's state stays zero."""
    from verify_worker.step_buckets import StepBuckets

    _, target, _ = glm5
    taps = (1, 3)
    states = [target.new_state(4, 64, 8) for _ in range(2)]  # slot 3: the padded state's scratch slot
    for state in states:
        for slot in range(3):
            run(target, state, prompt_ids(20 + slot, 60 + slot), 0, slot)
            target.commit(state, torch.tensor([slot]), torch.tensor([20 + slot]))
    plain, padded = states
    buckets = StepBuckets(target, padded, scratch_slot=3, block_size=8, taps=taps)
    assert buckets.warm_up(3) == 6  # every shape, from placeholder rows (what a capture runs): the slots untouched
    slots, lengths, kept = [2, 0, 1], [8, 5, 3], [3, 5, 1]
    starts = torch.tensor([22, 20, 21])  # each slot's committed tokens
    for round_ in range(2):
        ids = torch.randint(0, TEXT["vocab_size"], (3, 8), generator=torch.Generator().manual_seed(round_))
        positions = starts[:, None] + torch.arange(8)
        want = target.step(StepBatch(ids, positions, torch.tensor(slots), torch.tensor(lengths)), plain, taps)
        got = buckets.step(ids, positions, slots, int(positions.max()) + 1, lengths)
        for row, n in enumerate(lengths):  # a row's real tokens
            assert torch.equal(got.hidden[row, :n], want.hidden[row, :n]), (round_, row)
            assert torch.equal(got.taps[row, :n], want.taps[row, :n]), (round_, row)
        assert padded.pending_tokens[slots].tolist() == lengths  # the real tokens alone are pending
        scratch = [t[3] for layer in padded.recurrent.values() for t in layer.tensors()]
        assert not any(t.any() for t in scratch)  # the padded row took in no token
        for state in states:
            target.commit(state, torch.tensor(slots), torch.tensor(kept))
        for slot in range(3):
            assert all(torch.equal(a, b) for a, b in zip(kda_tensors(padded, slot), kda_tensors(plain, slot)))
        starts += torch.tensor(kept)


def test_a_random_dflash2_drafter_attaches_and_stays_lossless(glm5):
    from conftest import tiny_draft_config

    from draft_worker.draft_checkpoint import random_drafter
    from draft_worker.local_proposer import LocalProposer
    from shared.draft_config import DFlash2Settings

    _, target, _ = glm5
    drafter = random_drafter(tiny_draft_config(
        target_layers=TEXT["num_hidden_layers"], hidden=32, target_layer_ids=(1, 3, 5), block_size=8,
        dflash2=DFlash2Settings(conv_group_size=8, selector_rank=8, selector_top_k=4)), seed=4, std=0.2)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=5,
                             max_model_len=128)
    prompts = [prompt_ids(n, 40 + n)[0].tolist() for n in (3, 11, 19, 27, 33)]
    requests = [GenerationRequest(tuple(p), 64) for p in prompts]
    plain = SpeculativeEngine(target, None, max_requests=5, max_model_len=128).generate(requests)
    spec = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=128).generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.stats.draft_tokens for r in spec) > 0


def test_a_dflash2_drafter_shaped_like_the_published_one_loads_against_a_tiny_target(tmp_path):
    """GLM-5.3-Flash's published DFlash 2 drafter: block 8, taps [5, 14, 24, 33, 42] of 45 layers. A tiny 45-layer
    target (KDA everywhere but every fourth layer, as published) takes it: the engine checks the layer count and
    the taps, and greedy speculative decoding equals plain decoding."""
    from conftest import tiny_draft_config

    from draft_worker.draft_checkpoint import load_drafter, random_drafter, save_drafter
    from draft_worker.local_proposer import LocalProposer
    from shared.draft_config import DFlash2Settings

    random_glm5(seed=6, num_hidden_layers=45, layer_types=None, indexer_types=None, mlp_layer_types=None,
                n_routed_experts=4, n_group=1).save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target")
    assert target.config.layer_types.count("linear") == 34
    draft = tiny_draft_config(target_layers=45, hidden=32, target_layer_ids=(5, 14, 24, 33, 42), block_size=8,
                              dflash2=DFlash2Settings())
    save_drafter(random_drafter(draft, seed=2, std=0.2), tmp_path / "draft")
    drafter = load_drafter(tmp_path / "draft")
    assert (drafter.config.target_layer_ids, drafter.config.block_size) == ((5, 14, 24, 33, 42), 8)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=1, max_model_len=64)
    request = [GenerationRequest(tuple(prompt_ids(9, 7)[0].tolist()), 6)]
    plain = SpeculativeEngine(target, None, max_requests=1, max_model_len=64).generate(request)
    assert SpeculativeEngine(target, proposer, max_requests=1, max_model_len=64).generate(request)[0].token_ids == \
        plain[0].token_ids


def test_dflash_serve_serves_sixteen_streams_each_as_served_alone(tmp_path):
    """The whole product on a GLM-5.3-Flash checkpoint with a DFlash 2 drafter and default flags; the start-up
    line reports the state per request (two KDA states per KDA layer, whatever the block size)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from conftest import tiny_draft_config
    from server_harness import CHAT_TEMPLATE, Server
    from test_server_faults import completion_tokens, stream_tokens

    from draft_worker.draft_checkpoint import random_drafter, save_drafter
    from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer
    from shared.draft_config import DFlash2Settings

    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    random_glm5(seed=5, vocab_size=258, eos_token_id=256).save_pretrained(target_dir)
    write_byte_tokenizer(target_dir)
    (target_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT,
                                                                  "chat_template": CHAT_TEMPLATE}))
    save_drafter(random_drafter(tiny_draft_config(
        target_layers=TEXT["num_hidden_layers"], vocab=258, hidden=32, target_layer_ids=(1, 3, 5), block_size=8,
        dflash2=DFlash2Settings(conv_group_size=8, selector_rank=8, selector_top_k=4)), seed=3, std=0.2), draft_dir)
    server = Server(target_dir, draft_dir, log_dir=tmp_path)
    prompts = [f"def f{i}(x):" + " y" * i for i in range(16)]
    try:
        server.wait_ready()
        alone = [completion_tokens(server.url, p, 8, ignore_eos=True)["choices"][0]["token_ids"] for p in prompts]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda p: stream_tokens(server.url, p, 8, ignore_eos=True), prompts))
        for want, (got, error, done) in zip(alone, together):
            assert error is None and done and got == want and len(got) == 8
        target = load_target(target_dir)
        capacity = target.config.max_position_embeddings + 8
        per_request = target.state_bytes_per_slot(capacity)
        assert f"{per_request / 2**20:.1f} MiB per request" in server.stderr_path.read_text()
    finally:
        assert server.stop() == 0


def test_flat_text_exports_and_an_mtp_layer_load_the_same_model(glm5, tmp_path, caplog):
    """A text-only export (flat config, `model.` names) with the MTP layer and vLLM-only keys (mhc, mla_use_nope,
    topk_method, scoring_func) loads to the same logits; the MTP layer and the vision tower are named in the log."""
    import json
    import logging

    from safetensors.torch import load_file, save_file

    _, target, folder = glm5
    config = json.loads((folder / "config.json").read_text())
    flat = {**config["text_config"], "dtype": config["dtype"],  # an export states its dtype (here: float32)
            "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "mhc": True, "mla_use_nope": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {name.replace("model.language_model.", "model."): t for name, t in tensors.items()
               if not name.startswith("model.visual.")}
    renamed["model.layers.6.eh_proj.weight"] = torch.zeros(32, 64)  # the MTP layer
    (tmp_path / "flat").mkdir()
    save_file(renamed, str(tmp_path / "flat" / "model.safetensors"))
    (tmp_path / "flat" / "config.json").write_text(json.dumps(flat))
    with caplog.at_level(logging.INFO, logger="dflash.target"):
        loaded = load_target(tmp_path / "flat")
        load_target(folder)
    assert "multi-token-prediction layer(s) [6]" in caplog.text
    assert "tensor(s) the verify worker does not use (e.g. model.visual." in caplog.text
    ids = prompt_ids(20, 8)
    outs = [m.logits(run(m, m.new_state(1, 64), ids, 0, 0).hidden) for m in (loaded, target)]
    assert torch.equal(*outs)


def test_tp2_equals_tp1(glm5, tmp_path):
    """KDA heads (and their conv channels and gates), MLA heads and MLP / expert columns split over two ranks,
    mHC, indexer and router replicated: a prefill, then a verify block continuing it, and its taps equal the
    single-process target's; each rank holds half of every sharded tensor."""
    from tp_ranks import run_ranks, sparse_calls, sparse_logits

    _, target, folder = glm5
    out = tmp_path / "tp2.pt"
    run_ranks(sparse_logits, 2, str(folder), str(out))
    got, rank1 = torch.load(out), torch.load(f"{out}.rank1")
    want = sparse_calls(load_target(folder))
    for key in ("prefill", "block", "taps"):
        assert (got[key] - want[key]).abs().max() < 1e-4, key
    whole = {n: tuple(t.shape) for n, t in target.state_dict().items()}
    halves = [n for n in whole if torch.Size(rank1[n]).numel() * 2 == torch.Size(whole[n]).numel()]
    assert any("self_attn.q_conv1d" in n for n in halves) and any("A_log" in n for n in halves)
    assert all(rank1[n] == whole[n] for n in whole if "hc." in n or "indexer" in n or "mlp.gate." in n)


def test_tp2_engine_greedy_equals_tp1(glm5, tmp_path):
    """Speculative decoding on TP 2: every verify step's commit reaches both ranks, whose KDA states stay in step."""
    from conftest import tiny_draft_config
    from tp_ranks import engine_generate, run_ranks

    from draft_worker.draft_checkpoint import random_drafter, save_drafter

    _, target, folder = glm5
    save_drafter(random_drafter(tiny_draft_config(target_layers=TEXT["num_hidden_layers"], hidden=32,
                                                  target_layer_ids=(1, 3), block_size=4), seed=4, std=0.2),
                 tmp_path / "draft")
    prompts = [prompt_ids(n, 50 + n)[0].tolist() for n in (5, 23)]
    out = tmp_path / "engine.pt"
    run_ranks(engine_generate, 2, str(folder), str(tmp_path / "draft"), prompts, str(out))
    want = SpeculativeEngine(target, None, max_requests=2).generate([GenerationRequest(tuple(p), 24) for p in prompts])
    assert torch.load(out)["tokens"] == [r.token_ids for r in want]


def test_verify_equals_decode_in_bfloat16_too(glm5):
    """The same invariance with the weights and activations in bfloat16 (emulated on CPUs without native bfloat16:
    the rows are still computed one at a time)."""
    _, _, folder = glm5
    target = load_target(folder, dtype="bfloat16")
    ids = prompt_ids(CONTEXT, 3)
    state = target.new_state(2, 64)
    for slot in (0, 1):
        run(target, state, ids[:, :28], 0, slot)
        target.commit(state, torch.tensor([slot]), torch.tensor([28]))
    steps = []
    for i in range(8):
        steps.append(run(target, state, ids[:, 28 + i: 29 + i], 28 + i, 0).hidden)
        target.commit(state, torch.tensor([0]), torch.tensor([1]))
    block = run(target, state, ids[:, 28:36], 28, 1).hidden
    assert block.dtype == torch.bfloat16 and torch.equal(block, torch.cat(steps, 1))


def test_an_fp8_checkpoint_loads_as_its_dequantized_twin(glm5, tmp_path):
    """GLM-5.3-Flash FP8 as vLLM describes it: the MLA projections and the experts block-quantized (KDA
    projections stay bf16), kv_a_proj_with_mqa with a partial block (16 rows in blocks of 12). The FP8 target's
    logits equal those of a float32 checkpoint holding the dequantized weights, bit for bit; at TP 2 too."""
    import json

    from safetensors.torch import load_file, save_file
    from test_glm_moe_dsa import dequantize_reference, quantize_blocks
    from tp_ranks import run_ranks, sparse_calls, sparse_logits

    _, _, folder = glm5
    tensors = load_file(str(folder / "model.safetensors"))
    quantized = (".q_a_proj.weight", ".q_b_proj.weight", ".kv_a_proj_with_mqa.weight", ".kv_b_proj.weight",
                 "mlp.experts.", "indexer.wk.weight")
    fp8, twin = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and any(part in name for part in quantized) and name.endswith(".weight"):
            q, scale = quantize_blocks(tensor.float(), 12)
            fp8[name], fp8[name[: -len(".weight")] + ".weight_scale_inv"] = q, scale
            twin[name] = dequantize_reference(q, scale, 12)
        else:
            fp8[name] = twin[name] = tensor
    config = json.loads((folder / "config.json").read_text())
    for kind, checkpoint in (("fp8", fp8), ("twin", twin)):
        (tmp_path / kind).mkdir()
        save_file(checkpoint, str(tmp_path / kind / "model.safetensors"))
        quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [12, 12]}}
        (tmp_path / kind / "config.json").write_text(json.dumps({**config, **(quant if kind == "fp8" else {})}))
    ids = prompt_ids(24, 9)
    got, want = (m.logits(run(m, m.new_state(1, 64), ids, 0, 0).hidden)
                 for m in (load_target(tmp_path / "fp8", dtype="float32"), load_target(tmp_path / "twin")))
    assert torch.equal(got, want)
    out = tmp_path / "tp2.pt"
    run_ranks(sparse_logits, 2, str(tmp_path / "fp8"), str(out))
    reference = sparse_calls(load_target(tmp_path / "twin"))
    assert (torch.load(out)["block"] - reference["block"]).abs().max() < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
                    reason="fla-core and triton not installed (pip install -e '.[gpu]')")
def test_fla_kda_equals_its_one_token_steps_and_matches_the_cpu_recurrence(tmp_path):
    """fla's fused recurrent KDA kernel (the recurrence on CUDA) under Triton's interpreter, in a process of its
    own (TRITON_INTERPRET must be set before Triton is imported): tests/kda_fla_interpreted.py, on two layers (KDA
    with a dense MLP, then MLA behind the pooled indexer with the MoE: the interpreter runs a program in
    milliseconds)."""
    folder = tmp_path
    random_glm5(num_hidden_layers=2, layer_types=["linear_attention", "deepseek_sparse_attention"],
                indexer_types=["full"] * 2, mlp_layer_types=["dense", "sparse"]).save_pretrained(folder)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, str(HERE / "kda_fla_interpreted.py"), str(folder)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # the kernel's rounding differs from PyTorch's ops (its own exp, fused sums): close, not equal
    assert found["fla_vs_torch_output"] < 1e-5 and found["fla_vs_torch_state"] < 1e-5, found
    # exactness: a verify block's state and outputs are those of as many one-token steps, bit for bit; padding
    # past a row's real tokens leaves its state alone; the commit's replay (no outputs) gives the forward's state
    assert found["block_equals_steps_output"] and found["block_equals_steps_state"], found
    assert found["padding_leaves_state"] and found["replay_equals_forward_state"], found
    # the family on that backend: greedy speculative == plain (drafts accepted and rejected), and plain decoding
    # gives the CPU recurrence's tokens (or differs only at a near-tie)
    assert found["backend"] == "fla" and found["kernels"] == ["triton"], found
    assert found["speculative_equals_plain"], found
    assert 1 < found["committed_per_step"] < 4, found
