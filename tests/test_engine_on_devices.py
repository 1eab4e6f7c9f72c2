"""The serving loop as a whole on each device this machine has: the target and the drafter loaded there, an
in-process proposer (DFlash and DFlash 2), greedy and sampled requests batched together. On CPU this repeats what
the other tests check piece by piece; on a GPU (benchmarks/gpu_session.sh runs it) it is the engine's first run
there."""

import pytest
import torch
from conftest import tiny_draft_config
from greedy_check import assert_same_or_near_tie

from draft_worker.dflash2_model import upgrade_to_dflash2
from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import LocalProposer
from shared.draft_config import DFlash2Settings
from shared.generation_request import GenerationRequest
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA device"))]
PROMPTS = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66, 67, 68], [100, 2]]
NEW_TOKENS = 40


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_serves_greedy_and_sampled_requests_on_the_device(qwen3_pair, device, version):
    _, cpu_target, _, folder = qwen3_pair
    target = load_target(folder, device=device)
    drafter = random_drafter(tiny_draft_config(block_size=8), seed=1, std=0.2)
    if version == 2:
        drafter = upgrade_to_dflash2(drafter, DFlash2Settings(conv_kernel_size=2, conv_group_size=16,
                                                              selector_rank=8, selector_top_k=4))
    drafter = drafter.to(device)

    def engine(with_drafts: bool) -> SpeculativeEngine:
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=6,
                                 max_model_len=256) if with_drafts else None
        return SpeculativeEngine(target, proposer, max_requests=6, max_model_len=256)

    greedy = [GenerationRequest(tuple(p), NEW_TOKENS) for p in PROMPTS]
    plain = engine(False).generate(greedy)
    sampled = [GenerationRequest(tuple(p), NEW_TOKENS, SamplingParams(temperature=1.0, top_p=0.9, seed=i))
               for i, p in enumerate(PROMPTS[:2])]
    speculative = engine(True).generate([GenerationRequest(tuple(p), NEW_TOKENS) for p in PROMPTS] + sampled)
    for prompt, got, want in zip(PROMPTS, speculative, plain):
        assert len(got.token_ids) == NEW_TOKENS
        assert got.stats.draft_tokens > 0
        assert_same_or_near_tie(cpu_target, prompt, got.token_ids, want.token_ids)  # the gap judged on CPU
    for result in speculative[len(PROMPTS):]:
        assert len(result.token_ids) == NEW_TOKENS
        assert all(0 <= t < cpu_target.config.vocab_size for t in result.token_ids)
        assert result.stats.draft_tokens > 0
    assert sum(r.stats.accepted_tokens for r in speculative) > 0  # drafts were verified, not only proposed
