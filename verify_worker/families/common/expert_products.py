"""How the routed experts multiply their rows, as a backend chosen once when the model is packed. Rows come sorted
by expert; each expert's rows are multiplied by its own weight read in place (no copy of a weight per row).
- `LoopProducts` (every device; the CPU path): expert by expert, one row per batched-matmul entry (linear_rows),
  reading the expert counts on the host.
- `TritonProducts` (CUDA with Triton): one launch of cuda_ext/grouped_rows over every expert, with no host
  synchronisation; its sums have an order fixed by the weight shapes, never by the rows.
Both keep a row's result independent of the other rows of the call.

Shapes: x [rows, K] sorted by expert, weights [experts, N, K], counts [experts] -> [rows, N] in x's dtype.
"""

import torch

from verify_worker.families.common.row_invariant import linear_rows


class LoopProducts:
    name = "torch"

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], weights.shape[1])  # [rows, N]
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                out[start:start + count] = linear_rows(x[start:start + count], weights[expert])
                start += count
        return out


class TritonProducts:
    name = "triton"

    def __init__(self):
        from cuda_ext.grouped_rows.kernel import grouped_rows  # Triton (the optional gpu extra)

        self.kernel = grouped_rows

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, weights, counts)


def expert_products_for(device: torch.device | str, choice: str = "auto"):
    """"triton" on CUDA where Triton is installed ("auto"), else "torch"."""
    if choice == "torch" or (choice == "auto" and torch.device(device).type != "cuda"):
        return LoopProducts()
    try:
        return TritonProducts()
    except ImportError:
        if choice == "triton":
            raise
        return LoopProducts()
