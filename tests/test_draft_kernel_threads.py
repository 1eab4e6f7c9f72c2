"""The drafter's C++ projections and head shared between threads (LocalProposer.share_kernel_threads) draft the
same tokens as one thread, call after call."""

import pytest
import torch

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from draft_worker.server import load_target_head
from shared.cpu_kernels.library import cpu_kernels
from shared.demo_models import default_pair
from shared.proposals import DraftItem
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")


def test_a_drafter_sharing_threads_drafts_the_same_tokens():
    pair = default_pair()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the draft worker's PyTorch threads on 2 cores: the drafter on the C++ kernels
    try:
        embed, head = load_target_head(pair.target, torch.float32, "cpu")
        proposers = [LocalProposer(load_drafter(pair.draft, dtype=torch.float32, device="cpu"), embed, head)
                     for _ in range(2)]
        proposers[1].share_kernel_threads(2)
        assert proposers[0].pool is None and proposers[1].pool is not None and proposers[1].lm_head.pool is not None
        width = len(proposers[0].target_layer_ids) * embed.shape[1]
        features = torch.randn(40, width, generator=torch.Generator().manual_seed(0))
        drafted = []
        for proposer in proposers:
            with torch.inference_mode():
                first = proposer.propose([DraftItem("r", 0, features[:37], 5, 7, SamplingParams(temperature=0.0), 0)])
                then = proposer.propose([DraftItem("r", 37, features[37:], 9, 7, SamplingParams(temperature=0.0), 0)])
            drafted.append([first[0].tokens, then[0].tokens])
        assert all(torch.equal(a, b) for a, b in zip(*drafted))
    finally:
        torch.set_num_threads(before)
