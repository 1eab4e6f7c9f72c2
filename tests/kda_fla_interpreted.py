"""Run by tests/test_glm5_next.py (test_fla_kda_equals_its_one_token_steps_...) with TRITON_INTERPRET=1 (Triton's
interpreter: fla's KDA kernel on CPU tensors), and by benchmarks/gpu_session.sh on a GPU (DFLASH_KDA_DEVICE=cuda,
the compiled kernel): fla's fused recurrent KDA kernel as the glm5_next family's recurrence, against the PyTorch
recurrence (the CPU oracle) and against itself one token at a time; then the family on its CUDA kernels (that
recurrence and cuda_ext/grouped_rows for the experts) against the CPU family; on a GPU also fla's chunk_kda for
prompt chunks (chunked_form_fault, and the family on it). Prints one JSON object of findings; the test asserts on
them.

    TRITON_INTERPRET=1 python tests/kda_fla_interpreted.py CHECKPOINT_FOLDER
    DFLASH_KDA_DEVICE=cuda python tests/kda_fla_interpreted.py --write-checkpoint FOLDER   # writes it first
"""

import json
import os
import sys

import torch
from family_exactness import exactness_findings

from verify_worker.families.common.kernel_set import TritonKernels, use_kernels
from verify_worker.families.common.kda import l2_normalize
from verify_worker.families.common.kda_recurrence import FlaRecurrence, TorchRecurrence, chunked_form_fault
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
    oracle = load_target(folder)  # packed for the CPU: PyTorch's recurrence and products
    target = load_target(folder, device=DEVICE).use_recurrence(FlaRecurrence())
    use_kernels(target, TritonKernels())  # the rest of the family's CUDA kernels too (kernel_set.py)
    found = {"backend": target.recurrence_name, **exactness_findings(target, oracle)}
    if DEVICE == "cuda":  # chunk_kda for prompt chunks (not under the interpreter: its autotuner wants a driver)
        found["chunk_kda_fault"] = chunked_form_fault(FlaRecurrence(chunked=True), DEVICE)
        if found["chunk_kda_fault"] is None:  # prompts of 150 and 70 tokens, prefilled 128 tokens a step at most
            target.use_recurrence(FlaRecurrence(chunked=True))
            generator = torch.Generator().manual_seed(3)
            vocab = oracle.config.vocab_size
            prompts = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in (150, 70)]
            found.update({f"chunked_{k}": v for k, v in exactness_findings(target, oracle, prompts=prompts,
                                                                            max_prefill_tokens=128).items()})
    return found


if __name__ == "__main__":
    folder = sys.argv[-1]
    if "--write-checkpoint" in sys.argv:
        from test_glm5_next import random_glm5

        random_glm5().save_pretrained(folder)
    print(json.dumps({"device": DEVICE, **recurrence_findings(), **model_findings(folder)}))
