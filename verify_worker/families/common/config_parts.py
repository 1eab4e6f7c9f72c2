"""Config pieces the GLM families read alike (torch-free): the DSA indexer schedule and FP8 block settings."""

from dataclasses import dataclass

from shared.config_values import config_int
from shared.errors import ConfigError


def indexer_schedule(config: dict, num_layers: int) -> tuple[str, ...]:
    """Per layer "full" (runs its indexer) or "shared" (reuses the previous layer's selection)."""
    types = config.get("indexer_types")
    if types is None:
        pattern = config.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) \
                else list(pattern)
        else:
            freq = max(config_int(config, "index_topk_freq", 1), 1)
            offset = config_int(config, "index_skip_topk_offset", 2, minimum=0)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"config.json: indexer_types must list 'full' or 'shared' for each of the {num_layers} "
                          f"layers, got {list(types)!r}")
    if types and types[0] != "full":
        raise ConfigError("config.json: the first layer's indexer must be 'full' (a shared layer reuses the "
                          "selection of the layer before it)")
    return types


@dataclass(frozen=True)
class Fp8Settings:
    block: tuple[int, int]  # (rows, columns) of one weight_scale_inv entry
    not_converted: tuple[str, ...]  # modules_to_not_convert, as listed (informational: scales decide)

    @classmethod
    def from_config(cls, config: dict) -> "Fp8Settings | None":
        quant = config.get("quantization_config")
        if quant is None:
            return None
        if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
            raise ConfigError(f"config.json: quantization_config {quant!r} is not supported (only quant_method "
                              "'fp8' with weight_block_size)")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"config.json: FP8 format {quant.get('fmt')!r} is not supported (only e4m3)")
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"config.json: quantization_config.weight_block_size must be [rows, columns], "
                              f"got {block!r}")
        return cls((block[0], block[1]), tuple(quant.get("modules_to_not_convert") or ()))
