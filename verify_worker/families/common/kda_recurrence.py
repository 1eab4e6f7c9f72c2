"""The KDA recurrence of a step's rows, as a backend chosen once when the model is packed: PyTorch's ops one token
at a time (every device; the CPU oracle), or flash-linear-attention's fused recurrent Triton kernel (`fla-core`,
the optional `gpu` extra; what vLLM and SGLang run for KDA decode and verify). Both keep each row's arithmetic
independent of the batch and of the block length: the kernel walks a row's tokens one after another with the
state in float32, so a verify block gives the state and outputs of as many one-token steps, bit for bit.

Shapes: state [b, heads, dk, dv] float32; q, k [b, s, heads, dk]; v [b, s, heads, dv]; decay = exp(g) and g
[b, s, heads, dk]; beta [b, s, heads]; live [b, s] (a row's real tokens; the others leave its state as it is).
"""

import torch

from verify_worker.families.common.backend_choice import gpu_backend_or
from verify_worker.families.common.kda import delta_step, delta_update


class TorchRecurrence:
    """delta_step token by token over the rows' (slot, head) states."""

    name = "torch"

    def run(self, state, q, k, v, decay, g, beta, live) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the state after each row's real tokens, outputs [b, s, heads, dv] or None when q is None)."""
        batch, seq, heads, dk = k.shape
        dv = v.shape[-1]
        current = state.reshape(batch * heads, dk, dv)
        outputs = []
        for t in range(seq):
            if q is None:
                stepped = delta_update(current, k[:, t].reshape(-1, dk), v[:, t].reshape(-1, dv),
                                       decay[:, t].reshape(-1, dk), beta[:, t].reshape(-1))
            else:
                stepped, out = delta_step(current, q[:, t].reshape(-1, dk), k[:, t].reshape(-1, dk),
                                          v[:, t].reshape(-1, dv), decay[:, t].reshape(-1, dk),
                                          beta[:, t].reshape(-1))
                outputs.append(out.view(batch, heads, dv))
            current = torch.where(live[:, t].repeat_interleave(heads)[:, None, None], stepped, current)
        out = torch.stack(outputs, 1) if q is not None else None
        return current.view(batch, heads, dk, dv), out


class FlaRecurrence:
    """fla's fused_recurrent_kda over the block: g and beta are zeroed past a row's real tokens, so those tokens
    leave the state unchanged exactly (S * exp(0) + k * 0)."""

    name = "fla"

    def __init__(self):
        from fla.ops.kda import fused_recurrent_kda  # the optional gpu extra: fla-core (Triton)

        self.kernel = fused_recurrent_kda

    def run(self, state, q, k, v, decay, g, beta, live) -> tuple[torch.Tensor, torch.Tensor | None]:
        keep = live[:, :, None].float()  # [b, s, 1]
        g = (g.float() * keep[..., None]).contiguous()
        beta = (beta.float() * keep).contiguous()
        queries = q if q is not None else torch.zeros_like(k)
        out, final = self.kernel(queries.float().contiguous(), k.float().contiguous(), v.float().contiguous(), g,
                                 beta, scale=1.0, initial_state=state.float().contiguous(), output_final_state=True)
        return final, (out if q is not None else None)


def recurrence_for(device: torch.device | str):
    """"fla" on CUDA where fla-core is installed, else "torch"."""
    return gpu_backend_or(device, FlaRecurrence, TorchRecurrence)
