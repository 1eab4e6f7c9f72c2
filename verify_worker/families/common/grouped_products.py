"""Grouped products, as a backend chosen once when the model is packed: rows sorted by group, each group's rows times
its own weight read in place (no copy of a weight per row). The MoE experts' rows are grouped by expert, the
absorbed MLA's per-head products by head.
- `LoopProducts` (every device; the CPU path): group by group, one row per batched-matmul entry (linear_rows),
  reading the group counts on the host.
- `TritonProducts` (CUDA with Triton): one launch of cuda_ext/grouped_rows over every group, with no host
  synchronisation; its sums have an order fixed by the weight shapes, never by the rows.
Both keep a row's result independent of the other rows of the call.

Shapes: x [rows, K] sorted by group, weights [groups, N, K], counts [groups] -> [rows, N] in x's dtype.
"""

import torch

from verify_worker.families.common.row_invariant import linear_rows


class LoopProducts:
    name = "torch"

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], weights.shape[1])  # [rows, N]
        start = 0
        for group, count in enumerate(counts.tolist()):
            if count:
                out[start:start + count] = linear_rows(x[start:start + count], weights[group])
                start += count
        return out


class TritonProducts:
    name = "triton"

    def __init__(self):
        from cuda_ext.grouped_rows.kernel import grouped_rows  # Triton (the optional gpu extra)

        self.kernel = grouped_rows

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, weights, counts)


def grouped_products_for(device: torch.device | str, choice: str = "auto"):
    """"triton" on CUDA where Triton is installed ("auto"), else "torch"."""
    if choice == "torch" or (choice == "auto" and torch.device(device).type != "cuda"):
        return LoopProducts()
    try:
        return TritonProducts()
    except ImportError:
        if choice == "triton":
            raise
        return LoopProducts()


def use_grouped_products(model: torch.nn.Module, products) -> None:
    """Every module of model that multiplies through grouped products (a `products` attribute) uses `products`."""
    for module in model.modules():
        if hasattr(module, "products"):
            module.products = products
