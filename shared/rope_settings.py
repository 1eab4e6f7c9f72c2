"""Rotary settings read from either config style (torch-free: the draft worker's and the verify worker's
configs both carry them)."""

from dataclasses import dataclass

from shared.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSettings:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: dict) -> "RopeSettings":
        """Read rope settings from top-level rope_theta/rope_scaling or from the newer rope_parameters."""
        legacy = config.get("rope_scaling") or {}
        params = config.get("rope_parameters") or {}
        if not isinstance(legacy, dict) or not isinstance(params, dict):
            raise ConfigError("rope_scaling and rope_parameters must be JSON objects")
        merged = {**legacy, **params}
        theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        settings = cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
            ) if rope_type == "llama3" else 8192,
        )
        if settings.theta <= 0 or settings.factor <= 0:
            raise ConfigError(f"rope_theta and rope factor must be positive, got {settings}")
        return settings

    def to_config(self) -> dict:
        """The rope keys of a config.json, in the legacy top-level style that every reader accepts."""
        out: dict = {"rope_theta": self.theta, "rope_scaling": None}
        if self.rope_type == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": self.factor}
        elif self.rope_type == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        return out
