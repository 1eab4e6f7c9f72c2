"""Which weights a published FP8 block checkpoint keeps FP8 in the model, decided from config.json alone (the memory
plan reads no tensor): every weight a module can keep FP8 (fp8_weights.fp8_capable), except the modules the
quantization_config leaves unconverted and the weights whose tensor-parallel slices are not whole blocks (the loader
dequantizes those, as it does any FP8 tensor it cannot keep: checkpoint_reader.kept_fp8).
"""

import torch

from verify_worker.families.common.config_parts import Fp8Settings
from verify_worker.families.common.fp8_weights import fp8_capable, keep_fp8
from verify_worker.families.common.slices import Slice, whole_blocks

TEXT_PREFIX = "model.language_model."  # GLM-5.3-Flash's text tower as published


def published_fp8(model: torch.nn.Module, fp8: Fp8Settings | None, plan: dict[str, Slice]) -> torch.nn.Module:
    """model (meta) with the weights an FP8 checkpoint of its config would keep FP8 turned FP8; unchanged for a
    checkpoint without FP8 settings."""
    if fp8 is None:
        return model
    capable = fp8_capable(model)
    for name in published_names(model, fp8, plan):
        module, attribute = capable[name]
        keep_fp8(module, attribute, fp8.block)
    return model


def published_names(model: torch.nn.Module, fp8: Fp8Settings, plan: dict[str, Slice]) -> list[str]:
    """The state-dict names of the weights a published FP8 checkpoint of this config keeps FP8 on this rank."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return [name for name in fp8_capable(model)
            if converted(name, fp8.not_converted) and aligned(name, shapes[name], plan, fp8.block)]


def converted(name: str, not_converted: tuple[str, ...]) -> bool:
    published = [m.replace(TEXT_PREFIX, "model.", 1) for m in not_converted]
    return not any(name == m or name.startswith(m + ".") for m in published)


def aligned(name: str, shape: tuple[int, ...], plan: dict[str, Slice], block: tuple[int, int]) -> bool:
    """Every rank's slice is whole blocks (checkpoint_reader.aligned_cut; for stacked experts: expert 0's, and
    gate|up halves of whole row blocks)."""
    if name.endswith(".experts.gate_up_proj"):
        cut = plan.get(name[: -len("gate_up_proj")] + "0.gate_proj.weight")
        if (shape[1] // 2) % block[0]:
            return False
    elif name.endswith(".experts.down_proj"):
        cut = plan.get(name[: -len("down_proj")] + "0.down_proj.weight")
    else:
        cut = plan.get(name)
    return whole_blocks(cut, block)
