"""What one rank of a target family holds once loaded, from config.json alone: the memory plan's figures, each
family's own (its loader's dtypes, its packing), so that the plan counts what the loader will place."""

from dataclasses import dataclass

import torch

from verify_worker.families.interface import TargetFamily


@dataclass(frozen=True)
class Placement:
    model: TargetFamily  # this rank's model on the meta device; its state_bytes_per_slot is the loaded model's
    compute: torch.dtype  # the dtype it computes in (activations, the drafter's feature rows)
    weights: dict[str, int]  # dtype name -> bytes this rank holds once loaded and packed
    load_peak: int  # the most bytes its weights take at once while loading (loaded tensors beside packed copies)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def add_bytes(into: dict[str, int], dtype: torch.dtype, count: int) -> None:
    key = dtype_name(dtype)
    into[key] = into.get(key, 0) + count


def tensor_bytes(model: torch.nn.Module, kept: tuple[str, ...] = ()) -> dict[str, int]:
    """Bytes of the model's parameters and buffers by dtype: a parameter whose name contains one of `kept` counted
    float32, a floating buffer float32 (the loaders keep a router's bias and compute rotary frequencies so)."""
    out: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        placed = torch.float32 if any(part in name for part in kept) else parameter.dtype
        add_bytes(out, placed, parameter.numel() * placed.itemsize)
    for buffer in model.buffers():
        placed = torch.float32 if buffer.is_floating_point() else buffer.dtype
        add_bytes(out, placed, buffer.numel() * placed.itemsize)
    return out


def in_place(model: TargetFamily, compute: torch.dtype, kept: tuple[str, ...] = ()) -> Placement:
    """A family whose loader places each tensor once, in the skeleton's dtype (or float32 for `kept` names), and
    whose packing keeps those tensors."""
    weights = tensor_bytes(model, kept)
    return Placement(model, compute, weights, sum(weights.values()))
