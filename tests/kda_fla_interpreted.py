"""Run by tests/test_glm5_next.py (test_fla_kda_equals_its_one_token_steps_...) with TRITON_INTERPRET=1 (Triton's
interpreter: fla's KDA kernel on CPU tensors), and by benchmarks/gpu_session.sh on a GPU (DFLASH_KDA_DEVICE=cuda,
the compiled kernel): fla's fused recurrent KDA kernel as the glm5_next family's recurrence, against the PyTorch
recurrence (the CPU oracle) and against itself one token at a time; then the family on its CUDA kernels (that
recurrence and cuda_ext/grouped_rows for the experts) against the CPU family. Prints one JSON object of findings;
the test asserts on them.

    TRITON_INTERPRET=1 python tests/kda_fla_interpreted.py CHECKPOINT_FOLDER
    DFLASH_KDA_DEVICE=cuda python tests/kda_fla_interpreted.py --write-checkpoint FOLDER   # writes it first
"""

import json
import os
import sys

import torch
from greedy_check import assert_same_or_near_tie
from scripted_proposer import ScriptedProposer

from verify_worker.engine import SpeculativeEngine
from verify_worker.families.common.kernel_set import TritonKernels, use_kernels
from verify_worker.families.common.kda import l2_normalize
from verify_worker.families.common.kda_recurrence import FlaRecurrence, TorchRecurrence
from verify_worker.request import GenerationRequest
from verify_worker.target_loader import load_target


DEVICE = os.environ.get("DFLASH_KDA_DEVICE", "cpu")


def inputs(batch=2, seq=5, heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE)

    q = l2_normalize(randn(batch, seq, heads, dim)) * dim**-0.5
    k = l2_normalize(randn(batch, seq, heads, dim))
    v = randn(batch, seq, heads, dim)
    g = -5.0 * torch.sigmoid(randn(batch, seq, heads, dim))  # the lower-bounded gate, as GLM-5.3-Flash's
    decay = torch.exp(g)
    beta = torch.sigmoid(randn(batch, seq, heads))
    state = 0.3 * randn(batch, heads, dim, dim)
    live = (torch.arange(seq)[None] < torch.tensor([seq, 3])[:, None]).to(DEVICE)  # row 1: 3 real, then padding
    return state, q, k, v, decay, g, beta, live


def recurrence_findings() -> dict:
    state, q, k, v, decay, g, beta, live = inputs()
    fla, oracle = FlaRecurrence(), TorchRecurrence()
    fla_state, fla_out = fla.run(state, q, k, v, decay, g, beta, live)
    torch_state, torch_out = oracle.run(state, q, k, v, decay, g, beta, live)
    mask = live[:, :, None, None]
    # one token at a time, each call starting from the last one's state
    current, outs = state, []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        current, out = fla.run(current, q[:, step], k[:, step], v[:, step], decay[:, step], g[:, step],
                               beta[:, step], live[:, step])
        outs.append(out)
    stepwise_out = torch.cat(outs, 1)
    # row 1's real tokens alone: padding must leave its state as it was
    real = slice(0, 3)
    alone_state, _ = fla.run(state[1:], q[1:, real], k[1:, real], v[1:, real], decay[1:, real], g[1:, real],
                             beta[1:, real], live[1:, real])
    return {
        "fla_vs_torch_output": float(((fla_out - torch_out) * mask).abs().max()),
        "fla_vs_torch_state": float((fla_state - torch_state).abs().max()),
        "block_equals_steps_output": bool(torch.equal(fla_out * mask, stepwise_out * mask)),
        "block_equals_steps_state": bool(torch.equal(fla_state, current)),
        "padding_leaves_state": bool(torch.equal(fla_state[1:], alone_state)),
        "replay_equals_forward_state": bool(torch.equal(fla.run(state, None, k, v, decay, g, beta, live)[0],
                                                        fla_state)),
    }


def model_findings(folder: str) -> dict:
    oracle = load_target(folder)  # packed for the CPU: PyTorch's recurrence
    target = load_target(folder, device=DEVICE).use_recurrence(FlaRecurrence())
    use_kernels(target, TritonKernels())  # the experts as on CUDA too (cuda_ext/grouped_rows)
    prompts = [[5, 17, 3, 99, 42, 8, 61], [77, 12]]
    requests = [GenerationRequest(tuple(p), 6, request_id=f"r{i}") for i, p in enumerate(prompts)]
    plain = SpeculativeEngine(target, None, max_requests=2, max_model_len=64).generate(requests)
    sequences = {r.request_id: list(r.prompt_ids) + p.token_ids for r, p in zip(requests, plain)}
    wrong = ScriptedProposer(sequences, block_size=4, num_layers=oracle.config.num_layers)  # right and wrong drafts
    wrong.target_layer_ids = (0, oracle.config.num_layers - 1)  # taps that exist at any depth
    spec = SpeculativeEngine(target, wrong, max_requests=2, max_model_len=64).generate(requests)
    want = SpeculativeEngine(oracle, None, max_requests=2, max_model_len=64).generate(requests)
    for prompt, got, expected in zip(prompts, plain, want):
        assert_same_or_near_tie(oracle, prompt, got.token_ids, expected.token_ids)
    return {
        "backend": target.recurrence_name,
        "kernels": sorted({m.glm_kernels.name for m in target.modules() if hasattr(m, "glm_kernels")}),
        "speculative_equals_plain": [r.token_ids for r in spec] == [r.token_ids for r in plain],
        "committed_per_step": sum(r.stats.committed_tokens for r in spec) / sum(r.stats.verify_steps for r in spec),
        "plain_equals_oracle_or_near_tie": True,  # assert_same_or_near_tie raised otherwise
        "tokens_equal_oracle": [r.token_ids for r in plain] == [r.token_ids for r in want],
    }


if __name__ == "__main__":
    folder = sys.argv[-1]
    if "--write-checkpoint" in sys.argv:
        from test_glm5_next import random_glm5

        random_glm5().save_pretrained(folder)
    print(json.dumps({"device": DEVICE, **recurrence_findings(), **model_findings(folder)}))
