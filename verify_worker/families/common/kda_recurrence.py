"""The KDA recurrence of a step's rows, as a backend chosen once when the model is packed: PyTorch's ops one token
at a time (every device; the CPU oracle), or flash-linear-attention's fused recurrent Triton kernel (`fla-core`,
the optional `gpu` extra; what vLLM and SGLang run for KDA decode and verify). Both keep each row's arithmetic
independent of the batch and of the block length: the kernel walks a row's tokens one after another with the
state in float32, so a verify block gives the state and outputs of as many one-token steps, bit for bit.

Shapes: state [b, heads, dk, dv] float32; q, k [b, s, heads, dk]; v [b, s, heads, dv]; decay = exp(g) and g
[b, s, heads, dk]; beta [b, s, heads]; live [b, s] (a row's real tokens; the others leave its state as it is).

Prompt chunks (`run_prompt`) may take a chunked form instead: fla's `chunk_kda` on CUDA, used only where a check on
the device at pack (chunked_form_fault) finds it close to the recurrence, a row's bits the same alone and beside a
longer row, and a prompt's the same in one forward or split at a multiple of its chunk (the engine starts every
prompt chunk at a multiple of `prefill_align`). PyTorch's recurrence has no chunked form (docs/decisions/0025).
"""

import logging

import torch

from verify_worker.families.common.backend_choice import gpu_backend_or
from verify_worker.families.common.kda import delta_step, delta_update, l2_normalize

FLA_CHUNK = 64  # chunk_kda's chunk: prompt chunks start at its multiples when it is used


class TorchRecurrence:
    """delta_step token by token over the rows' (slot, head) states."""

    name = "torch"
    prefill_align = 1

    def run_prompt(self, state, q, k, v, decay, g, beta, live) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(state, q, k, v, decay, g, beta, live)

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
    leave the state unchanged exactly (S * exp(0) + k * 0). chunked: prompt chunks through chunk_kda (set by
    recurrence_for where the device's check holds)."""

    name = "fla"

    def __init__(self, chunked: bool = False):
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # the optional gpu extra: fla-core (Triton)

        self.kernel, self.chunk_kernel, self.chunked = fused_recurrent_kda, chunk_kda, chunked

    @property
    def prefill_align(self) -> int:
        return FLA_CHUNK if self.chunked else 1

    def run(self, state, q, k, v, decay, g, beta, live) -> tuple[torch.Tensor, torch.Tensor | None]:
        g, beta = masked_gates(g, beta, live)
        queries = q if q is not None else torch.zeros_like(k)
        out, final = self.kernel(queries.float().contiguous(), k.float().contiguous(), v.float().contiguous(), g,
                                 beta, scale=1.0, initial_state=state.float().contiguous(), output_final_state=True)
        return final, (out if q is not None else None)

    def run_prompt(self, state, q, k, v, decay, g, beta, live) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.chunked:
            return self.run(state, q, k, v, decay, g, beta, live)
        g, beta = masked_gates(g, beta, live)
        out, final = self.chunk_kernel(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), g,
                                       beta, scale=1.0, initial_state=state.float().contiguous(),
                                       output_final_state=True)
        return final, out


def masked_gates(g: torch.Tensor, beta: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta (float32, contiguous) zeroed past each row's real tokens: those tokens change no state."""
    keep = live[:, :, None].float()  # [b, s, 1]
    return (g.float() * keep[..., None]).contiguous(), (beta.float() * keep).contiguous()


def chunked_form_fault(recurrence, device, heads: int = 2, dim: int = 128) -> str | None:
    """Why the recurrence's chunked form may not take prompt chunks on device (None: it may): on small random
    inputs of the layer's heads and head dim it must be within 1e-4 of the recurrence (states and outputs), give a
    row the same bits alone as beside a longer row, and a prompt the same bits in one forward as split at a
    multiple of FLA_CHUNK."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    lengths = (150, 70)
    seq = max(lengths)
    q, k = l2_normalize(randn(2, seq, heads, dim)) * dim**-0.5, l2_normalize(randn(2, seq, heads, dim))
    v, g = randn(2, seq, heads, dim), -5 * torch.sigmoid(randn(2, seq, heads, dim))
    beta, state = torch.sigmoid(randn(2, seq, heads)), randn(2, heads, dim, dim) * 0.1
    live = torch.arange(seq, device=device)[None] < torch.tensor(lengths, device=device)[:, None]

    def prompt(rows, end):  # rows' first end tokens from their states
        return recurrence.run_prompt(state[rows], q[rows, :end], k[rows, :end], v[rows, :end], None, g[rows, :end],
                                     beta[rows, :end], live[rows, :end])

    try:
        final, out = recurrence.run_prompt(state, q, k, v, None, g, beta, live)
        want_final, want_out = recurrence.run(state, q, k, v, g.exp(), g, beta, live)
        error = float((final - want_final).abs().max() / want_final.abs().max())
        if not error <= 1e-4:
            return f"its state is {error:.2g} (relative) from the recurrence's"
        real = live[:, :, None, None]  # a padded token's output is not meaningful
        error = float(((out - want_out) * real).abs().max() / (want_out * real).abs().max())
        if not error <= 1e-4:
            return f"its outputs are {error:.2g} (relative) from the recurrence's"
        alone_final, alone_out = prompt(slice(1, 2), lengths[1])
        if not (torch.equal(alone_final, final[1:2]) and torch.equal(alone_out, out[1:2, :lengths[1]])):
            return "a row's bits change beside a longer row"
        split = 2 * FLA_CHUNK
        first_final, first_out = prompt(slice(0, 1), split)
        second_final, second_out = recurrence.run_prompt(first_final, q[:1, split:], k[:1, split:], v[:1, split:],
                                                         None, g[:1, split:], beta[:1, split:], live[:1, split:])
        if not (torch.equal(second_final, final[:1]) and torch.equal(torch.cat([first_out, second_out], 1), out[:1])):
            return f"a prompt's bits change when split at {split} tokens"
    except Exception as error:  # noqa: BLE001 - any failure of the kernel leaves the recurrence, which is exact
        return f"{type(error).__name__}: {error}"
    return None


def recurrence_for(device: torch.device | str, shapes: tuple[int, int] = (2, 128), parallel: bool = False):
    """"fla" on CUDA where fla-core is installed, else "torch". fla's chunked form takes prompt chunks where
    chunked_form_fault finds no fault at shapes (the layer's heads, head dim), and not under tensor parallelism
    (each rank would decide alone, and the engine's alignment is rank 0's)."""
    recurrence = gpu_backend_or(device, FlaRecurrence, TorchRecurrence)
    if recurrence.name == FlaRecurrence.name:
        recurrence.chunked = True
        fault = "tensor parallelism (the ranks would decide alone)" if parallel else \
            chunked_form_fault(recurrence, device, *shapes)
        recurrence.chunked = fault is None
        log = logging.getLogger("dflash.kda")
        if fault is None:
            log.info("KDA prompt chunks through fla's chunk_kda (prompt chunks start at multiples of %d)", FLA_CHUNK)
        else:
            log.warning("KDA prompt chunks through the recurrence: fla's chunk_kda did not hold on %s (%s)", device,
                        fault)
    return recurrence
