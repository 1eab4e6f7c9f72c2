"""Target model settings read from an HF config.json (Qwen3 and Llama decoder families)."""

from dataclasses import dataclass

from shared.checkpoint_shapes import decoder_layer_shapes
from shared.config_values import config_int
from shared.errors import ConfigError
from shared.rope_settings import RopeSettings

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}


@dataclass(frozen=True)
class TargetConfig:
    family: str  # "qwen3" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSettings
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...]

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @classmethod
    def from_dict(cls, config: dict) -> "TargetConfig":
        family = None
        for arch in config.get("architectures") or []:
            family = family or ARCHITECTURES.get(arch)
        if family is None:
            family = MODEL_TYPES.get(config.get("model_type"))
        if family is None:
            raise ConfigError(
                f"unknown target architecture {config.get('architectures')!r} / model_type "
                f"{config.get('model_type')!r}: supported are {', '.join(ARCHITECTURES)}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if config.get("use_sliding_window"):
            raise ConfigError("config.json: sliding-window targets are not supported (use_sliding_window is true)")
        hidden = config_int(config, "hidden_size")
        heads = config_int(config, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        return cls(
            family=family,
            vocab_size=config_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=config_int(config, "intermediate_size"),
            num_layers=config_int(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeSettings.from_config(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            checkpoint_dtype=str(dtype),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict:
        """An HF config.json for this target (what transformers writes, in the legacy rope style)."""
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.family]
        eos = list(self.eos_token_ids)
        return {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.checkpoint_dtype,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            **self.rope.to_config(),
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The HF checkpoint's tensor names and shapes: the loading table."""
        h = self.hidden_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            shapes.update(decoder_layer_shapes(
                f"model.layers.{i}.", h, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim,
                self.attention_bias, self.mlp_bias, self.qk_norm,
            ))
        return shapes
