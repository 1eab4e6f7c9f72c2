"""Reading a checkpoint into a family's own tensor names: renames, skipped parts (vision towers, MTP layers),
this rank's slices, FP8 block weights dequantized, per-expert tensors stacked; then the strict checks against the
model's table and the placement in fresh, aligned memory. The GLM families' loaders are built from these."""

import logging
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from shared.checkpoint_io import safetensors_files
from shared.errors import CheckpointError
from verify_worker.families.common.fp8_blocks import dequantize, scale_grid
from verify_worker.families.common.row_invariant import aligned
from verify_worker.families.common.slices import Slice

SCALE = ".weight_scale_inv"
LAYER = re.compile(r"model\.layers\.(\d+)\.")
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def read_checkpoint(folder: str | Path, rename: Callable[[str], str | None], num_layers: int, plan: dict[str, Slice],
                    fp8_block: tuple[int, int] | None, log: logging.Logger) -> dict[str, torch.Tensor]:
    """Our name -> tensor for every tensor the model uses. rename maps a checkpoint name to ours (None: a part the
    verify worker does not use); layers past num_layers (MTP) are skipped; plan names the slices this rank reads
    (of our names); FP8 weights (with a `weight_scale_inv`) are dequantized to float32 with the scales that cover
    the part read."""
    where, unused, mtp = {}, [], set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                ours = rename(name)
                layer = LAYER.match(ours or "")
                if ours is None:
                    unused.append(name)
                elif layer and int(layer.group(1)) >= num_layers:
                    mtp.add(int(layer.group(1)))
                else:
                    where[name] = path
    if unused:
        log.info("skipping %d tensor(s) the verify worker does not use (e.g. %s)", len(unused), unused[0])
    if mtp:
        log.info("skipping the multi-token-prediction layer(s) %s (not used for verification)", sorted(mtp))
    scales = {name[: -len(SCALE)] + ".weight": name for name in where if name.endswith(SCALE)}
    if scales and fp8_block is None:
        raise CheckpointError(f"{str(folder)!r} has FP8 scales ({next(iter(scales.values()))}) but its config.json "
                              "has no quantization_config")
    out = {}
    for name, path in where.items():
        if name.endswith(SCALE):
            continue
        ours = rename(name)
        cut = plan.get(ours)
        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(name) if cut is None else read_slice(handle.get_slice(name), cut)
            if name in scales:
                tensor = dequantize_slice(tensor, handle.get_slice(name).get_shape(), where[scales[name]],
                                          scales[name], cut, fp8_block)
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise CheckpointError(f"{str(folder)!r}: FP8 tensor {name} has no weight_scale_inv")
        out[ours] = tensor
    orphans = [scale for weight, scale in scales.items() if weight not in where]
    if orphans:
        raise CheckpointError(f"{str(folder)!r} has {orphans[0]} but no {orphans[0][: -len(SCALE)]}.weight")
    return out


def read_slice(view, cut: Slice) -> torch.Tensor:
    tensor = view[(slice(None),) * cut.dim + (slice(cut.start, cut.stop),)]
    if cut.padded is not None and tensor.shape[cut.dim] < cut.padded:
        pad = list(tensor.shape)
        pad[cut.dim] = cut.padded - tensor.shape[cut.dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], cut.dim)
    return tensor


def dequantize_slice(weight: torch.Tensor, full_shape, scale_path: Path, scale_name: str, cut: Slice | None,
                     block: tuple[int, int]) -> torch.Tensor:
    """weight (the whole stored tensor, or the slice `cut` of it) times the scales of the blocks that cover it."""
    name = scale_name[: -len(SCALE)] + ".weight"
    with safe_open(str(scale_path), framework="pt") as handle:
        view = handle.get_slice(scale_name)
        grid = tuple(view.get_shape())
        if len(full_shape) != 2 or grid != scale_grid(tuple(full_shape), block):
            raise CheckpointError(f"{name}: scale grid {list(grid)} does not fit a {list(full_shape)} weight in "
                                  f"blocks of {list(block)} (expected {list(scale_grid(tuple(full_shape), block))})")
        if cut is None:
            return dequantize(weight, view[:, :], block, name)
        first, last = cut.start // block[cut.dim], -(-cut.stop // block[cut.dim])
        scale = view[(slice(None),) * cut.dim + (slice(first, last),)]
        offset = (cut.start, 0) if cut.dim == 0 else (0, cut.start)
        return dequantize(weight, scale, block, name, offset)


def stack_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down -> experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    per_expert: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            per_expert.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
    for prefix, parts in per_expert.items():
        missing = [f"{prefix}.{e}.{kind}_proj.weight" for e in range(num_experts)
                   for kind in ("gate", "up", "down") if (e, kind) not in parts]
        if missing:
            raise CheckpointError(f"missing tensor(s): {', '.join(missing[:8])}")
        extra = sorted({e for e, _ in parts} - set(range(num_experts)))
        if extra:
            raise CheckpointError(f"unexpected tensor(s): {prefix}.{extra[0]}.*")
        experts = range(num_experts)
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]])
                                                     for e in experts])
        out[prefix + ".down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    return out


def placed(folder: str | Path, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], device,
           compute: torch.dtype, float32_kept: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The state dict to load: strict against the model's table (a missing, unexpected or mis-shaped tensor is a
    CheckpointError naming it), in the compute dtype (float32 for names ending in float32_kept), each tensor in a
    fresh allocation: a tensor read from a file may sit at any offset, and a GEMM's roundings depend on its
    operands' alignment (the same weights read from two files would differ in the last bits)."""
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{str(folder)!r} is missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{str(folder)!r} has unexpected tensor(s): {', '.join(unexpected[:8])}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {name!r} in {str(folder)!r} has shape {list(tensor.shape)}, expected "
                                  f"{list(expected[name])}")
    return {name: aligned(t.to(device=device, dtype=torch.float32 if name.endswith(float32_kept) else compute))
            for name, t in tensors.items()}
