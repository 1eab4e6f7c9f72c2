"""DFlash 2: the published checkpoint layout, the identity-initialised convolution, the selector walk, greedy
identity and sampling losslessness with the selector's sparse q, and training."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import tiny_draft_config
from greedy_check import assert_same_or_near_tie
from safetensors import safe_open

from cuda_ext.dflash2_walk.reference import walk as walk_reference
from draft_worker.dflash2_model import DFlash2DraftModel, upgrade_to_dflash2
from draft_worker.draft_checkpoint import load_drafter, random_drafter, save_drafter
from draft_worker.local_proposer import LocalProposer
from shared.cpu_kernels.library import cpu_kernels
from shared.draft_config import DFlash2Settings, DraftConfig
from shared.errors import ConfigError
from shared.generation_request import GenerationRequest
from shared.proposals import DraftItem
from shared.sampling_params import SamplingParams
from training.masks import block_visibility
from training.trainer import DrafterTrainer, Example, TrainSettings
from verify_worker.engine import SpeculativeEngine

SMALL = DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
PROMPTS = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66], [100, 2], [8, 8, 8, 8, 1]]


def dflash2_drafter(seed=1, block_size=8, **overrides):
    return random_drafter(tiny_draft_config(block_size=block_size, dflash2=SMALL, **overrides), seed=seed, std=0.2)


def test_checkpoint_round_trips_with_the_published_names(tmp_path):
    drafter = dflash2_drafter()
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k")} == {"conv_kernel_size": 2,
                                                                            "conv_group_size": 16,
                                                                            "selector_rank": 8, "selector_top_k": 4}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for name in ("layers.0.attention_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
                 "layers.0.mlp_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight", "fc.weight", "layers.0.self_attn.q_proj.weight"):
        assert name in names, name
    assert not any(n.endswith("codebook.weight") for n in names)
    loaded = load_drafter(tmp_path)
    assert isinstance(loaded, DFlash2DraftModel) and loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_dflash2_config_errors():
    cfg = tiny_draft_config(dflash2=SMALL).to_dict()
    cfg["dflash_config"]["conv_group_size"] = 7
    with pytest.raises(ConfigError, match="conv_group_size 7 does not divide hidden_size 64"):
        DraftConfig.from_dict(cfg)
    cfg["dflash_config"]["conv_group_size"] = 0
    with pytest.raises(ConfigError, match="conv_group_size"):
        DraftConfig.from_dict(cfg)
    cfg = tiny_draft_config(dflash2=SMALL).to_dict()
    assert "selector_sample_top_k" not in cfg["dflash_config"]  # the extension key is written only when set
    assert DraftConfig.from_dict(cfg).dflash2.sample_top_k == SMALL.selector_top_k
    cfg["dflash_config"]["selector_sample_top_k"] = -1
    with pytest.raises(ConfigError, match="selector_sample_top_k"):
        DraftConfig.from_dict(cfg)


def test_identity_convolution_leaves_the_block_unchanged(qwen3_pair):
    """A DFlash drafter upgraded to DFlash 2 (identity convolutions) gives the same block hidden states, in the
    serving path and in the training path."""
    _, target, _, _ = qwen3_pair
    v1 = random_drafter(tiny_draft_config(layers=2, block_size=6), seed=9, std=0.2)
    v2 = upgrade_to_dflash2(v1, SMALL)
    features = torch.randn(13, 2 * 64, generator=torch.Generator().manual_seed(0))
    block = target.embed_weight[torch.tensor([[5, 127, 127, 127, 127, 127]])]
    outs = []
    for drafter in (v1, v2):
        cache = drafter.new_cache(1, 32)
        drafter.ingest_context(cache, torch.zeros(13, dtype=torch.long), torch.arange(13), features)
        outs.append(drafter.block_hidden(cache, torch.tensor([0]), torch.tensor([13]), block))
    assert (outs[0] - outs[1]).abs().max() < 1e-6
    mask = block_visibility(torch.tensor([4, 9]), 13, 6, torch.tensor([6, 6]))
    positions = torch.cat([torch.arange(4, 10), torch.arange(9, 15)])
    embeds = target.embed_weight[torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(1))]
    train = [d.train_hidden(features, embeds, positions, mask) for d in (v1, v2)]
    assert (train[0] - train[1]).abs().max() < 1e-6


def test_training_forward_equals_the_served_forward_with_live_convolutions(qwen3_pair):
    """Random (non-identity) convolutions: the many-blocks training path equals the cached serving path."""
    _, target, _, _ = qwen3_pair
    drafter = dflash2_drafter(seed=4, block_size=6, layers=2)
    trainer = DrafterTrainer(target, drafter, TrainSettings(steps=1))
    ids = torch.randint(0, 120, (20,), generator=torch.Generator().manual_seed(4))
    features, _ = trainer.target_view(ids)
    anchors = torch.tensor([3, 13])
    block_ids, positions, _, _, lengths = trainer.layout(Example(ids, 1), anchors)
    mask = block_visibility(anchors, len(ids), 6, lengths)
    trained = drafter.train_hidden(features, target.embed_weight[block_ids], positions, mask)[6:]
    cache = drafter.new_cache(1, 64)
    drafter.ingest_context(cache, torch.zeros(13, dtype=torch.long), torch.arange(13), features[:13])
    served = drafter.block_hidden(cache, torch.tensor([0]), torch.tensor([13]),
                                  target.embed_weight[block_ids[6:]][None])[0]
    assert (trained - served).abs().max() < 1e-4


def test_a_walk_over_one_candidate_is_argmax_drafting():
    drafter = dflash2_drafter(seed=2)
    gen = torch.Generator().manual_seed(3)
    hidden, logits = torch.randn(3, 7, 64, generator=gen), torch.randn(3, 7, 128, generator=gen)
    tokens, q, candidates = drafter.walk(hidden, logits, torch.tensor([1, 2, 3]), torch.zeros(3), None, k=1)
    assert torch.equal(tokens, logits.argmax(-1)) and torch.all(q == 1)
    # with K candidates the walk may leave the argmax, and only ever picks one of the candidates
    tokens, q, candidates = drafter.walk(hidden, logits, torch.tensor([1, 2, 3]), torch.zeros(3), None)
    assert torch.all((candidates == tokens[..., None]).any(-1))
    # sampled rows report a proper distribution over the K candidates
    tokens, q, candidates = drafter.walk(hidden, logits, torch.tensor([1, 2, 3]), torch.ones(3),
                                         torch.rand(3, 7, dtype=torch.float64, generator=gen))
    assert torch.allclose(q.sum(-1), torch.ones(3, 7)) and q.shape == (3, 7, 4)


def test_proposer_walks_greedy_rows_over_top_k_and_sampled_rows_over_sample_top_k(qwen3_pair):
    _, target, _, _ = qwen3_pair
    settings = DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=2,
                               selector_sample_top_k=6)
    drafter = random_drafter(tiny_draft_config(block_size=8, dflash2=settings), seed=3, std=0.2)
    with torch.no_grad():  # a pair term strong enough that the candidate count changes the walk
        drafter.candidate_selector.predecessor_codebook.mul_(20)
    weights = {name: t.clone() for name, t in drafter.state_dict().items()}  # the proposer packs the drafter
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=4, max_model_len=64)
    out = target(torch.tensor([PROMPTS[0]]), torch.arange(7)[None], None, None, drafter.config.target_layer_ids)
    items = [DraftItem(request_id=f"r{i}", context_start=0, context_features=out.taps[0], anchor_token=5,
                       num_draft=7, sampling=SamplingParams(temperature=t), seed=i) for i, t in enumerate([0, 1, 0, 1])]
    results = proposer.propose(items)
    for item, result in zip(items, results):
        if item.sampling.greedy:
            assert result.q_probs is None
        else:
            assert result.q_probs.shape == result.q_ids.shape == (7, 6)
            assert torch.allclose(result.q_probs.sum(-1), torch.ones(7))
            assert torch.all((result.q_ids == result.tokens[:, None]).any(-1))
    # the two greedy rows saw the same context and anchor: the same walk over the top 2
    assert torch.equal(results[0].tokens, results[2].tokens)
    alone = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=1, max_model_len=64)
    assert torch.equal(alone.propose([items[0]])[0].tokens, results[0].tokens)

    def greedy_walk(top_k, sample_top_k):  # the same weights under other candidate counts
        cfg = drafter.config
        twin = random_drafter(dataclasses.replace(cfg, dflash2=dataclasses.replace(
            cfg.dflash2, selector_top_k=top_k, selector_sample_top_k=sample_top_k)), seed=3, std=0.2)
        twin.load_state_dict(weights)
        return LocalProposer(twin, target.embed_weight, target.lm_head_weight, max_requests=1,
                             max_model_len=64).propose([items[0]])[0].tokens

    assert torch.equal(greedy_walk(2, 2), results[0].tokens)  # the sampled candidate count plays no part
    assert not torch.equal(greedy_walk(6, 6), results[0].tokens)  # and the greedy one does (this seed)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_dflash2_greedy_equals_plain(qwen3_pair, block_size):
    _, target, _, _ = qwen3_pair
    plain = SpeculativeEngine(target, None, max_requests=5, max_model_len=256).generate(
        [GenerationRequest(tuple(p), 48) for p in PROMPTS])
    proposer = LocalProposer(dflash2_drafter(seed=6), target.embed_weight, target.lm_head_weight,
                             block_size=block_size, max_requests=5, max_model_len=256)
    results = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=256).generate(
        [GenerationRequest(tuple(p), 48) for p in PROMPTS])
    for prompt, result, want in zip(PROMPTS, results, plain):
        assert result.stats.draft_tokens > 0
        assert_same_or_near_tie(target, prompt, result.token_ids, want.token_ids)


def test_trainer_learns_the_selector_and_can_train_only_the_dflash2_parts(qwen3_pair):
    _, target, _, _ = qwen3_pair
    drafter = upgrade_to_dflash2(random_drafter(tiny_draft_config(block_size=8), seed=2, std=0.05), SMALL)
    backbone = {n: t.clone() for n, t in drafter.state_dict().items() if "conv" not in n and "selector" not in n}
    gen = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, 120, (48,), generator=gen), 8) for _ in range(4)]
    trainer = DrafterTrainer(target, drafter, TrainSettings(steps=40, lr=3e-3, anchors_per_sequence=16,
                                                            train_only=("conv", "candidate_selector")))
    before = sum(trainer.sequence_loss(e, torch.arange(8, 40, 4))[0].item() for e in examples)
    trainer.train(examples, log=lambda _: None)
    after = sum(trainer.sequence_loss(e, torch.arange(8, 40, 4))[0].item() for e in examples)
    assert after < before
    for name, tensor in backbone.items():
        assert torch.equal(drafter.state_dict()[name], tensor), name  # the DFlash backbone did not move
    assert drafter.layers[0].mlp_conv.kernel_projection.weight.abs().sum() > 0  # the convolution did
    report = trainer.evaluate(examples)
    assert len(report["per_position_accuracy"]) == 7


def test_selector_scores_are_the_same_for_few_and_many_candidates():
    selector = dflash2_drafter(seed=7).candidate_selector
    gen = torch.Generator().manual_seed(8)
    projected, previous = torch.randn(3, 8, generator=gen), torch.randint(0, 128, (3,), generator=gen)
    everything = torch.arange(128).expand(3, 128)  # 128 candidates: the one-matmul path
    few = torch.randint(0, 128, (3, 4), generator=gen)  # 4 candidates: the gather path
    with torch.no_grad():
        all_scores = selector.scores(torch.zeros(3, 128), everything, previous, projected)
        few_scores = selector.scores(torch.zeros(3, 4), few, previous, projected)
        by_hand = ((selector.predecessor_codebook[previous] * projected)[:, None, :]
                   * selector.successor_codebook[everything]).sum(-1)
    assert torch.allclose(all_scores, by_hand, atol=1e-5)
    assert torch.allclose(few_scores, all_scores.gather(1, few), atol=1e-5)


def test_soft_selector_loss_is_cross_entropy_to_the_target_through_the_pair_term():
    drafter = dflash2_drafter(seed=4)
    gen = torch.Generator().manual_seed(5)
    hidden, logits = torch.randn(6, 64, generator=gen), torch.randn(6, 128, generator=gen)
    previous, labels = torch.randint(0, 128, (6,), generator=gen), torch.randint(0, 128, (6,), generator=gen)
    target_logp = torch.log_softmax(torch.randn(6, 128, generator=gen), -1)
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.zero_()  # no pair term: q is the drafter's own softmax
    zero_pair = drafter.selector_loss(hidden, logits, previous, labels, target_logp)
    want = -(target_logp.exp() * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(zero_pair, want, atol=1e-5)


def test_soft_selector_loss_uses_the_pair_term_and_leaves_the_drafter_logits_alone():
    drafter = dflash2_drafter(seed=9).requires_grad_(True)
    selector = drafter.candidate_selector
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(5, 64, generator=gen)
    logits = torch.randn(5, 128, generator=gen, requires_grad=True)
    previous, labels = torch.randint(0, 128, (5,), generator=gen), torch.randint(0, 128, (5,), generator=gen)
    target_logp = torch.log_softmax(torch.randn(5, 128, generator=gen), -1)
    loss = drafter.selector_loss(hidden, logits, previous, labels, target_logp)
    pair = ((selector.predecessor_codebook[previous] * selector.hidden_projection(hidden)) @ selector.successor_codebook.T)
    want = -(target_logp.exp() * torch.log_softmax(logits.detach() + pair, -1)).sum(-1)
    assert torch.allclose(loss, want, atol=1e-5)
    loss.sum().backward()
    assert logits.grad is None  # the drafter's logits learn from the DFlash loss only
    assert selector.predecessor_codebook.grad.abs().sum() > 0 and selector.successor_codebook.grad.abs().sum() > 0


def test_soft_selector_training_moves_q_toward_the_target(qwen3_pair):
    _, target, _, _ = qwen3_pair
    drafter = upgrade_to_dflash2(random_drafter(tiny_draft_config(block_size=8), seed=2, std=0.05), SMALL)
    gen = torch.Generator().manual_seed(1)
    examples = [Example(torch.randint(0, 120, (48,), generator=gen), 8) for _ in range(4)]
    trainer = DrafterTrainer(target, drafter, TrainSettings(steps=40, lr=3e-3, anchors_per_sequence=16,
                                                            selector_soft_weight=1.0,
                                                            train_only=("candidate_selector",)))

    def soft_selector_loss():
        total = 0.0
        for example in examples:
            _, logits, labels, rows, anchors, hidden = trainer.sequence_loss(example, torch.arange(8, 40, 4))
            positions = (anchors[:, None] + torch.arange(8)).reshape(-1)[(torch.arange(8) > 0).repeat(len(anchors))]
            target_logp = trainer.target_view(example.ids)[1][positions - 1]
            with torch.no_grad():
                total += drafter.selector_loss(hidden, logits, example.ids[positions - 1], labels, target_logp).mean()
        return float(total)

    before = soft_selector_loss()
    trainer.train(examples, log=lambda _: None)
    assert soft_selector_loss() < before - 0.05


def test_dflash_serve_serves_a_dflash2_drafter_and_says_so(tmp_path):
    import httpx
    from server_harness import Server, metric_value, write_server_models

    target, _ = write_server_models(tmp_path)
    draft = tmp_path / "draft2"
    save_drafter(random_drafter(tiny_draft_config(vocab=258, block_size=4, dflash2=SMALL), seed=3, std=0.2), draft)
    server = Server(target, draft, log_dir=tmp_path)
    try:
        server.wait_ready()
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert models["data"][0]["drafter"] == {"kind": "dflash2", "available": True, "license": None}
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 40, "temperature": 0, "return_token_ids": True}
        spec = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        plain = httpx.post(f"{server.url}/v1/completions", json={**body, "num_speculative_tokens": 0}, timeout=60).json()
        assert spec["usage"]["speculative"]["draft_tokens"] > 0
        server.assert_same_or_near_tie("def f(x):", spec["choices"][0]["token_ids"], plain["choices"][0]["token_ids"])
        assert metric_value(server.metrics("verify"), "dflash_drafter_available", {"kind": "dflash2"}) == 1
    finally:
        server.stop()


@pytest.mark.parametrize("top_k", [1, 4, 32])
def test_the_walk_kernel_walks_the_reference_path(top_k, monkeypatch):
    """The drafter's walk on the host build of cuda_ext's walk kernel (the CPU default for greedy walks; switched
    in for sampled ones) picks what the PyTorch reference picks, row after row (each choice feeding the next
    row's pair term), greedy and sampled rows mixed; a token id outside the selector's vocabulary is refused."""
    monkeypatch.setenv("DFLASH_KERNELS", "host")
    settings = dataclasses.replace(SMALL, selector_top_k=top_k, selector_rank=16)
    drafter = random_drafter(tiny_draft_config(dflash2=settings), seed=4, std=0.2)
    with torch.no_grad():  # codebooks large enough that the pair term changes choices
        for book in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
            book.copy_(torch.randn(book.shape, generator=torch.Generator().manual_seed(5)))
    gen = torch.Generator().manual_seed(6)
    hidden, logits = torch.randn(5, 7, 64, generator=gen), torch.randn(5, 7, 128, generator=gen)
    anchors = torch.tensor([1, 2, 3, 127, 0])
    temperatures = torch.tensor([0.0, 0.8, 0.0, 1.3, 0.5])
    uniforms = torch.rand(5, 7, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        for temps in (torch.zeros(5), temperatures):
            unary, candidates = drafter.candidates(logits)
            projected = drafter.candidate_selector.hidden_projection(hidden)
            books = drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook
            want = walk_reference(unary, candidates, anchors, projected, *books, temps, uniforms)
            got = drafter.walk(hidden, logits, anchors, temps, uniforms)  # tokens, q, candidates
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], candidates)
            assert torch.allclose(got[1], want[2], atol=1e-6)
    if top_k > 1:  # the pair term mattered: not simply each row's argmax
        assert not torch.equal(drafter.walk(hidden, logits, anchors, torch.zeros(5), None)[0], logits.argmax(-1))
    with pytest.raises(IndexError, match="outside the vocabulary"):
        drafter.walk(hidden, logits, torch.tensor([1, 2, 3, 128, 0]), torch.zeros(5), None)


@pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")
def test_packed_for_the_cpu_kernels_drafts_what_the_unpacked_drafter_drafts():
    """A DFlash 2 drafter packed for the C++ kernels (bfloat16 weights, fused norms, rotary, cache writes,
    attention and greedy walk) computes the unpacked drafter's block hidden states and logits."""
    unpacked = dflash2_drafter(seed=9)
    with torch.no_grad():
        for param in unpacked.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    packed = copy.deepcopy(unpacked).pack("bf16")
    assert packed.kernels is not None
    gen = torch.Generator().manual_seed(10)
    features = torch.randn(20, unpacked.config.num_taps * unpacked.config.hidden_size, generator=gen)
    embeds = torch.randn(2, unpacked.config.block_size, unpacked.config.hidden_size, generator=gen)
    lm_head = torch.randn(unpacked.config.vocab_size, unpacked.config.hidden_size, generator=gen)
    outputs = []
    with torch.inference_mode():
        for drafter in (unpacked, packed):
            cache = drafter.new_cache(3, 64)
            drafter.ingest_context(cache, torch.tensor([0] * 12 + [2] * 8), torch.cat([torch.arange(12), torch.arange(8)]),
                                   features)
            hidden = drafter.block_hidden(cache, torch.tensor([0, 2]), torch.tensor([12, 8]), embeds)
            outputs.append((hidden, drafter.logits(hidden, lm_head)))
    assert (outputs[0][0] - outputs[1][0]).abs().max() < 1e-4
    assert (outputs[0][1] - outputs[1][1]).abs().max() < 1e-3
