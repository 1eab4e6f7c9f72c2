"""Which family serves a checkpoint: looked up by config.json's "architectures" (else its "model_type")."""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from shared.errors import ConfigError
from verify_worker.families.glm5_next import loader as glm5_next
from verify_worker.families.glm_moe_dsa import loader as glm_moe_dsa
from verify_worker.families.interface import TargetFamily
from verify_worker.families.llama.loader import llama_skeleton, load_llama
from verify_worker.families.llama.placement import llama_placement
from verify_worker.families.placement import Placement
from verify_worker.parallel.group import TensorParallel

Loader = Callable[[str | Path, dict, str, str, TensorParallel, bool], TargetFamily]
Skeleton = Callable[[dict, TensorParallel, torch.dtype], TargetFamily]
Placer = Callable[[dict, TensorParallel, str, str], Placement]


@dataclass(frozen=True)
class FamilyEntry:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    load: Loader  # (folder, config, device, dtype, tp, pack) -> the loaded target
    skeleton: Skeleton  # (config, tp, dtype) -> this rank's model on the meta device
    place: Placer  # (config, tp, --dtype, device) -> what this rank holds once loaded (the memory plan's figures)
    float32_kept: tuple[str, ...] = ()  # parameter names (substrings) the loader keeps float32 in any dtype
    batch_invariant: bool = False  # load(..., batch_invariant=True): rows that never depend on the batch, on a GPU too


def known_families() -> tuple[FamilyEntry, ...]:
    return (
        FamilyEntry("llama", ("Qwen3ForCausalLM", "LlamaForCausalLM"), ("qwen3", "llama"), load_llama,
                    llama_skeleton, llama_placement, batch_invariant=True),
        FamilyEntry("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), ("glm_moe_dsa",), glm_moe_dsa.load_glm_moe_dsa,
                    glm_moe_dsa.glm_moe_dsa_skeleton, glm_moe_dsa.glm_moe_dsa_placement, glm_moe_dsa.FLOAT32_KEPT),
        FamilyEntry("glm5_next", ("Glm5NextForConditionalGeneration",), ("glm5_next",), glm5_next.load_glm5_next,
                    glm5_next.glm5_next_skeleton, glm5_next.glm5_next_placement, glm5_next.FLOAT32_KEPT),
    )


def family_for(config: dict) -> FamilyEntry:
    families = known_families()
    for arch in config.get("architectures") or []:
        for family in families:
            if arch in family.architectures:
                return family
    for family in families:
        if config.get("model_type") in family.model_types:
            return family
    supported = ", ".join(a for f in families for a in f.architectures)
    raise ConfigError(f"unknown target architecture {config.get('architectures')!r} / model_type "
                      f"{config.get('model_type')!r}: supported are {supported}")
