"""Kimi delta attention (KDA) maths, the recurrent form: one token at a time, state [N, Dk, Dv] per (slot, head)
in float32. Verify blocks and one-token decoding both run this step, so they agree bit for bit; every product is
a batched one-row matmul or an elementwise op, so a row's result does not depend on the batch."""

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (the FLA form transformers matches)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_update(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                 beta: torch.Tensor) -> torch.Tensor:
    """One token's update. state [N, Dk, Dv]; k, decay (= exp(g)) [N, Dk]; v [N, Dv]; beta [N].

    S <- S * decay[:, None]; delta = (v - S^T k) * beta; S <- S + k delta^T.
    """
    state = state * decay[..., None]
    remembered = torch.bmm(k[:, None], state)[:, 0]  # [N, Dv]
    delta = (v - remembered) * beta[:, None]
    return state + k[..., None] * delta[:, None]


def delta_step(state, q, k, v, decay, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_update, then the token's output S^T q [N, Dv] (q [N, Dk])."""
    state = delta_update(state, k, v, decay, beta)
    return state, torch.bmm(q[:, None], state)[:, 0]


def causal_conv(window: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution. window [b, C, K-1] (the last inputs before these), inputs [b, s, C], weight
    [C, K] -> [b, s, C] (before the activation), each output a fixed-order sum of K products."""
    kernel = weight.shape[-1]
    seq = inputs.shape[1]
    series = torch.cat([window.transpose(1, 2), inputs], 1).float()  # [b, K-1+s, C]
    weight = weight.float()
    out = series[:, 0:seq] * weight[:, 0]
    for j in range(1, kernel):
        out = out + series[:, j: j + seq] * weight[:, j]
    return out
