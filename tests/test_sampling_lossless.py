"""Speculative sampling is lossless: the first tokens follow exactly the target's sampling distribution.

Method. On a 5-token vocabulary the exact joint distribution of the first 4 generated tokens (625 outcomes)
is computed by enumerating every prefix with the target and applying the same logits processing. Each
configuration draws N seeded requests (one batched engine run) and a chi-square goodness-of-fit test compares
the counts with the exact probabilities (outcomes expected fewer than 5 times are pooled into one cell).

Bound. Requests are seeded, so every run draws the same samples: the test is deterministic, and a correct
sampler fails it with probability ALPHA over the choice of seeds. The power check below shows that N is large
enough: the classic wrong residual (resampling from p instead of norm(max(0, p - q)) after a rejection) is
rejected at the same ALPHA with the same N.
"""

import itertools
from collections import deque

import pytest
import torch
from conftest import tiny_draft_config, write_hf_checkpoint

from cuda_ext.verify import reference as verify_reference
from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import DraftSampling, LocalProposer
from shared.cpu_kernels.library import cpu_kernels
from shared.generation_request import GenerationRequest
from shared.packed_linear import kernel_layout
from shared.sampling import sample_from, sampling_probs
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.spec_policy import AdaptiveSpeculation
from verify_worker.target_loader import load_target

VOCAB, TOKENS, N, ALPHA = 5, 4, 3000, 1e-3  # the wrong-residual check rejects at p ~ 1e-43 with 3000
PROMPT = (1, 2, 3)


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_vocab")
    write_hf_checkpoint(folder, "qwen3", seed=11, std=0.3, vocab_size=VOCAB, hidden_size=32, head_dim=8,
                        intermediate_size=64, num_hidden_layers=2)
    target = load_target(folder)
    drafter = random_drafter(
        tiny_draft_config(target_layers=2, vocab=VOCAB, hidden=32, head_dim=8, intermediate_size=64,
                          target_layer_ids=(0, 1), block_size=4), seed=5, std=0.3)
    return target, drafter


def exact_joint(target, params: SamplingParams, stop: int | None = None, least: int = 0) -> torch.Tensor:
    """P(first TOKENS tokens = t) for every t, flattened [VOCAB ** TOKENS]; with a stop token and min_tokens
    `least`, the stop token's logit masked for the first `least` tokens."""
    settings = [torch.tensor([v]) for v in (params.temperature, params.top_p, params.top_k)]
    joint = {(): 1.0}
    for _ in range(TOKENS):
        nxt = {}
        for prefix, mass in joint.items():
            seq = list(PROMPT) + list(prefix)
            cache = target.new_state(1, len(seq))
            out = target(torch.tensor([seq]), torch.arange(len(seq))[None], cache, torch.tensor([0]))
            logits = target.logits(out.hidden[:, -1])  # [1, VOCAB]
            if stop is not None and len(prefix) < least:
                logits[:, stop] = float("-inf")
            probs = sampling_probs(logits, *settings)[0]
            for token in range(VOCAB):
                nxt[prefix + (token,)] = mass * float(probs[token])
        joint = nxt
    return torch.tensor([joint[t] for t in itertools.product(range(VOCAB), repeat=TOKENS)], dtype=torch.float64)


def sample_counts(target, proposer, params: SamplingParams, policy=None, **extra) -> torch.Tensor:
    engine = SpeculativeEngine(target, proposer, max_requests=N, max_model_len=16, policy=policy)
    requests = [GenerationRequest(PROMPT, TOKENS, SamplingParams(params.temperature, params.top_p, params.top_k, seed),
                                  **extra) for seed in range(N)]
    counts = torch.zeros(VOCAB**TOKENS, dtype=torch.float64)
    for result in engine.generate(requests):
        index = 0
        for token in result.token_ids:
            index = index * VOCAB + token
        counts[index] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert counts[probs == 0].sum() == 0, "sampled an outcome of probability zero"
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


SETTINGS = {"t1": SamplingParams(temperature=1.0), "t1_top_p0.9": SamplingParams(temperature=1.0, top_p=0.9)}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", [None, DraftSampling.DENSE, DraftSampling.SPARSE, DraftSampling.GREEDY])
def test_first_tokens_follow_the_target_distribution(tiny_vocab_pair, setting, mode):
    target, drafter = tiny_vocab_pair
    params = SETTINGS[setting]
    proposer = None
    if mode is not None:
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=N,
                                 max_model_len=16, draft_sampling=mode, sparse_top_k=2)
    counts = sample_counts(target, proposer, params)
    p_value = chi_square_p_value(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"sampled distribution differs from the target's (p = {p_value:.2e})"


@pytest.mark.parametrize("mode", [None, DraftSampling.DENSE])
def test_min_tokens_follows_the_masked_target_distribution(tiny_vocab_pair, mode):
    """Stop token 0 and min_tokens 3: the first three tokens follow the target's distribution with token 0
    masked, the fourth the whole one (token 0 may end the output there, at its full length); drafts of token 0
    before min_tokens are rejected."""
    target, drafter = tiny_vocab_pair
    proposer = None if mode is None else LocalProposer(drafter, target.embed_weight, target.lm_head_weight,
                                                       max_requests=N, max_model_len=16, draft_sampling=mode)
    params = SETTINGS["t1"]
    counts = sample_counts(target, proposer, params, stop_token_ids=(0,), min_tokens=3)
    p_value = chi_square_p_value(counts, exact_joint(target, params, stop=0, least=3))
    assert p_value > ALPHA, f"sampled distribution differs from the masked target's (p = {p_value:.2e})"


def test_power_a_wrong_residual_is_detected(tiny_vocab_pair, monkeypatch):
    """The same test with the same N rejects a verifier that resamples from p after a rejection (the PyTorch
    reference, patched; its kernel equals it token for token: tests/test_cuda_ext.py)."""
    target, drafter = tiny_vocab_pair
    monkeypatch.setenv("DFLASH_KERNELS", "reference")
    real = verify_reference.verify_sampled

    def wrong_residual(draft, num_drafts, target_probs, draft_probs, accept_u, sample_u):
        accepted, next_token = real(draft, num_drafts, target_probs, draft_probs, accept_u, sample_u)
        rows = torch.arange(len(accepted))
        from_p = sample_from(target_probs[rows, accepted], sample_u)
        return accepted, from_p

    monkeypatch.setattr(verify_reference, "verify_sampled", wrong_residual)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=N, max_model_len=16)
    params = SETTINGS["t1"]
    counts = sample_counts(target, proposer, params)
    assert chi_square_p_value(counts, exact_joint(target, params)) < ALPHA


@pytest.mark.parametrize("setting,kernels", [("t1", "auto"), ("t1_top_p0.9", "host")])
def test_dflash2_selector_sparse_q_is_lossless(tiny_vocab_pair, setting, kernels, monkeypatch):
    """DFlash 2: tokens drawn by the sampled selector walk over 3 of the 5 tokens (selector_sample_top_k; a
    greedy walk would use 2), q reported sparse. The walk and verification run on cuda_ext's host builds (the
    CPU default); with DFLASH_KERNELS=host the drafter's block attention too."""
    from shared.draft_config import DFlash2Settings

    monkeypatch.setenv("DFLASH_KERNELS", kernels)

    target, _ = tiny_vocab_pair
    drafter = random_drafter(
        tiny_draft_config(target_layers=2, vocab=VOCAB, hidden=32, head_dim=8, intermediate_size=64,
                          target_layer_ids=(0, 1), block_size=4,
                          dflash2=DFlash2Settings(conv_group_size=8, selector_rank=4, selector_top_k=2,
                                                  selector_sample_top_k=3)),
        seed=5, std=0.3)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=N, max_model_len=16)
    params = SETTINGS[setting]
    counts = sample_counts(target, proposer, params)
    p_value = chi_square_p_value(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"sampled distribution differs from the target's (p = {p_value:.2e})"


@pytest.fixture(scope="module")
def tiny_vocab_kernel_pair(tmp_path_factory):
    """The tiny pair as a bfloat16 checkpoint on the C++ CPU kernels, as --dtype auto serves one: bfloat16 products
    on AMX where it runs ("amx"), else the float32 ones ("bf16"); a bfloat16 KV cache."""
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels do not build here")
    folder = tmp_path_factory.mktemp("tiny_vocab_bf16")
    write_hf_checkpoint(folder, "qwen3", seed=11, std=0.3, vocab_size=VOCAB, hidden_size=32, head_dim=8,
                        intermediate_size=64, num_hidden_layers=2, dtype=torch.bfloat16)
    layout = "amx" if cpu_kernels().amx else "bf16"
    target = load_target(folder)  # --dtype auto, as served
    assert target.kv_dtype == torch.bfloat16
    drafter = random_drafter(
        tiny_draft_config(target_layers=2, vocab=VOCAB, hidden=32, head_dim=8, intermediate_size=64,
                          target_layer_ids=(0, 1), block_size=4), seed=5, std=0.3)
    with torch.no_grad():
        for param in drafter.parameters():  # weights a bfloat16 checkpoint could hold: the drafter on the kernels too
            param.copy_(param.to(torch.bfloat16).float())
    return target, drafter, layout


@pytest.mark.parametrize("mode", [DraftSampling.DENSE, DraftSampling.SPARSE])
def test_first_tokens_follow_the_target_distribution_on_the_cpu_kernels(tiny_vocab_kernel_pair, mode):
    target, drafter, layout = tiny_vocab_kernel_pair
    assert target.whole_layers is not None and target.head.layout == layout
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=N, max_model_len=16,
                             draft_sampling=mode, sparse_top_k=2,
                             layout=kernel_layout("auto", "bfloat16", "cpu"))  # as the draft worker packs it
    assert proposer.drafter.native_block is not None and proposer.lm_head.layout == layout
    params = SETTINGS["t1_top_p0.9"]
    counts = sample_counts(target, proposer, params)
    p_value = chi_square_p_value(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"sampled distribution differs from the target's (p = {p_value:.2e})"


def test_switching_between_speculative_and_plain_steps_is_lossless(tiny_vocab_pair):
    """The adaptive policy, its step times seeded and a probe after every step: the batch alternates speculative
    and plain steps (each mode is lossless given the past, and the choice depends only on it). The requests are
    seeded for a deterministic test, so the policy is told not to pin seeded requests to speculation."""
    target, drafter = tiny_vocab_pair
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=N, max_model_len=16)
    policy = AdaptiveSpeculation(probe_every=1, refresh_every=1, pin_seeded=False)
    for i in range(16):
        for mode in (False, True):
            policy.step_samples[(1 << i, mode)] = deque([1.0], maxlen=policy.window)
    engine = SpeculativeEngine(target, proposer, max_requests=N, max_model_len=16, policy=policy)
    params = SETTINGS["t1_top_p0.9"]
    states = [engine.add(GenerationRequest(PROMPT, TOKENS, SamplingParams(params.temperature, params.top_p,
                                                                            params.top_k, seed))) for seed in range(N)]
    modes = []
    while engine.has_work():
        engine.step()
        if engine.last_report.decode_requests:
            modes.append("plain" if engine.last_report.policy_plain else "speculative")
    assert {"plain", "speculative"} <= set(modes) and sum(s.stats.draft_tokens for s in states) > 0
    counts = torch.zeros(VOCAB**TOKENS, dtype=torch.float64)
    for state in states:
        counts[sum(t * VOCAB ** (TOKENS - 1 - i) for i, t in enumerate(state.output_ids))] += 1
    p_value = chi_square_p_value(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"sampled distribution differs from the target's (p = {p_value:.2e})"


@pytest.fixture(scope="module")
def tiny_vocab_glm(tmp_path_factory):
    """GLM-5.2 (MLA, a shared indexer layer, MoE) on the 5-token vocabulary, index_topk 2: the later tokens
    attend to a sparse selection."""
    from test_glm_moe_dsa import random_glm

    folder = tmp_path_factory.mktemp("tiny_vocab_glm")
    random_glm(seed=2, vocab_size=VOCAB, num_hidden_layers=2, index_topk=2, indexer_types=["full", "shared"],
               first_k_dense_replace=1).save_pretrained(folder)
    target = load_target(folder)
    drafter = random_drafter(
        tiny_draft_config(target_layers=2, vocab=VOCAB, hidden=32, head_dim=8, intermediate_size=64,
                          target_layer_ids=(0, 1), block_size=4), seed=5, std=0.3)
    return target, drafter


@pytest.fixture(scope="module")
def tiny_vocab_glm5(tmp_path_factory):
    """GLM-5.3-Flash (KDA, pooled DSA with a tail, mHC, clamped MoE) on the 5-token vocabulary: every verify
    block is rolled back by the KDA replay."""
    from test_glm5_next import random_glm5

    folder = tmp_path_factory.mktemp("tiny_vocab_glm5")
    random_glm5(seed=2, vocab_size=VOCAB, num_hidden_layers=2, index_topk=2, index_kpool=2,
                layer_types=["linear_attention", "deepseek_sparse_attention"], indexer_types=["full"] * 2,
                mlp_layer_types=["dense", "sparse"]).save_pretrained(folder)
    target = load_target(folder)
    drafter = random_drafter(
        tiny_draft_config(target_layers=2, vocab=VOCAB, hidden=32, head_dim=8, intermediate_size=64,
                          target_layer_ids=(0, 1), block_size=4), seed=5, std=0.3)
    return target, drafter


@pytest.mark.parametrize("family", ["tiny_vocab_glm", "tiny_vocab_glm5"])
def test_glm_families_first_tokens_follow_the_target_distribution(family, request):
    target, drafter = request.getfixturevalue(family)
    params = SETTINGS["t1_top_p0.9"]
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=N, max_model_len=16,
                             draft_sampling=DraftSampling.SPARSE, sparse_top_k=2)
    counts = sample_counts(target, proposer, params)
    p_value = chi_square_p_value(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"sampled distribution differs from the target's (p = {p_value:.2e})"
