"""Which family serves a checkpoint: looked up by config.json's "architectures" (else its "model_type")."""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shared.errors import ConfigError
from verify_worker.families.glm5_next.loader import load_glm5_next
from verify_worker.families.glm_moe_dsa.loader import load_glm_moe_dsa
from verify_worker.families.interface import TargetFamily
from verify_worker.families.llama.loader import load_llama
from verify_worker.parallel.group import TensorParallel

Loader = Callable[[str | Path, dict, str, str, TensorParallel, bool], TargetFamily]


@dataclass(frozen=True)
class FamilyEntry:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    load: Loader  # (folder, config, device, dtype, tp, pack) -> the loaded target
    batch_invariant: bool = False  # load(..., batch_invariant=True): rows that never depend on the batch, on a GPU too


def known_families() -> tuple[FamilyEntry, ...]:
    return (
        FamilyEntry("llama", ("Qwen3ForCausalLM", "LlamaForCausalLM"), ("qwen3", "llama"), load_llama,
                    batch_invariant=True),
        FamilyEntry("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), ("glm_moe_dsa",), load_glm_moe_dsa),
        FamilyEntry("glm5_next", ("Glm5NextForConditionalGeneration",), ("glm5_next",), load_glm5_next),
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
