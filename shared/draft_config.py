"""DFlash drafter settings, read from and written to the published config.json layout."""

import dataclasses
from dataclasses import dataclass, field

from shared.checkpoint_shapes import decoder_layer_shapes
from shared.config_values import config_int
from shared.errors import ConfigError
from shared.rope_settings import RopeSettings

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
KINDS = {DFLASH_ARCHITECTURE: "dflash", DFLASH2_ARCHITECTURE: "dflash2"}


@dataclass(frozen=True)
class DFlash2Settings:
    """The DFlash 2 additions' dflash_config keys (published defaults)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # Not a published key: candidates of a SAMPLED walk (0 = selector_top_k). A selector trained to match the
    # target's distribution over the whole vocabulary (dflash-train-drafter --selector-soft-weight) proposes
    # better from more candidates; a hard-trained one from its top-K only.
    selector_sample_top_k: int = 0

    @property
    def sample_top_k(self) -> int:
        return self.selector_sample_top_k or self.selector_top_k


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The published default tap rule: [N // 2] for one tap, else evenly from layer 1 to layer N - 3."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + k * span / (num_taps - 1))) for k in range(num_taps)]


def _int(config: dict, key: str, minimum: int = 1) -> int:
    return config_int(config, key, minimum=minimum, where="drafter config.json")


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    rope: RopeSettings = RopeSettings()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dflash2: DFlash2Settings | None = None  # None = DFlash (v1)
    extra: dict = field(default_factory=dict, compare=False)  # other published keys, kept for round trips

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (one anchor plus at least one draft), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ConfigError(
                f"target_layer_ids {list(self.target_layer_ids)} must be non-empty ids of the "
                f"{self.num_target_layers} target layers"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    @property
    def architecture(self) -> str:
        return DFLASH_ARCHITECTURE if self.dflash2 is None else DFLASH2_ARCHITECTURE

    @property
    def kind(self) -> str:
        return KINDS[self.architecture]

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer: int) -> bool:
        """Sliding-window layers are causal inside the block unless is_causal says otherwise."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_window(layer) is not None

    def layer_window(self, layer: int) -> int | None:
        if self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, config: dict) -> "DraftConfig":
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in KINDS), None)
        if arch is None:
            raise ConfigError(f"unknown drafter architecture {archs!r}: supported are {sorted(KINDS)}")
        dflash = config.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError("drafter config.json: dflash_config must be a JSON object")

        def value(key, default=None):
            return dflash.get(key, config.get(key, default))

        num_layers = _int(config, "num_hidden_layers")
        num_target_layers = _int(config, "num_target_layers")
        ids = value("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(num_target_layers, num_layers)
        mask = value("mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise ConfigError(f"drafter config.json: dflash_config.mask_token_id must be an integer, got {mask!r}")
        block_size = value("block_size", 16)
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise ConfigError(f"drafter config.json: block_size must be an integer, got {block_size!r}")
        hidden = _int(config, "hidden_size")
        heads = _int(config, "num_attention_heads")
        softcap = value("final_logit_softcapping")
        dflash2 = None
        if arch == DFLASH2_ARCHITECTURE:
            defaults = DFlash2Settings()
            dflash2 = DFlash2Settings(**{
                key: _int({key: value(key, getattr(defaults, key))}, key)
                for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")},
                selector_sample_top_k=_int({"selector_sample_top_k": value("selector_sample_top_k", 0)},
                                           "selector_sample_top_k", minimum=0))
            if hidden % dflash2.conv_group_size:
                raise ConfigError(f"drafter config.json: conv_group_size {dflash2.conv_group_size} does not divide "
                                  f"hidden_size {hidden}")
        known = {
            "architectures", "dflash_config", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers",
            "block_size", "rms_norm_eps", "max_position_embeddings", "layer_types", "sliding_window", "is_causal",
            "attention_bias", "rope_theta", "rope_scaling", "rope_parameters", "model_type",
        }
        return cls(
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=_int(config, "vocab_size"),
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=mask,
            block_size=block_size,
            rope=RopeSettings.from_config(config),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            layer_types=tuple(config.get("layer_types") or ()),
            sliding_window=config.get("sliding_window"),
            is_causal=config.get("is_causal"),
            attention_bias=bool(config.get("attention_bias", False)),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            dflash2=dflash2,
            extra={k: v for k, v in config.items() if k not in known},
        )

    def to_dict(self) -> dict:
        """The published layout: DFlashDraftModel, model_type qwen3, block_size at the top level and in
        dflash_config, mask_token_id and target_layer_ids in dflash_config."""
        dflash: dict = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.dflash2 is not None:
            dflash.update({k: v for k, v in dataclasses.asdict(self.dflash2).items()
                           if k != "selector_sample_top_k" or v})  # the extension key only when set
        out = {
            **self.extra,
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "dflash_config": dflash,
            **self.rope.to_config(),
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Published tensor names (no "model." prefix, no embedding, no lm_head) and their shapes."""
        h = self.hidden_size
        shapes = {"fc.weight": (h, self.num_taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for i in range(self.num_layers):
            shapes.update(decoder_layer_shapes(
                f"layers.{i}.", h, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim,
                self.attention_bias, mlp_bias=False, qk_norm=True,
            ))
        if self.dflash2 is not None:
            d2 = self.dflash2
            groups = h // d2.conv_group_size
            for i in range(self.num_layers):
                for conv in ("attention_conv", "mlp_conv"):
                    shapes[f"layers.{i}.{conv}.base_kernel"] = (2, d2.conv_kernel_size, h)
                    shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * d2.conv_kernel_size * groups, h)
            shapes["candidate_selector.predecessor_codebook"] = (self.vocab_size, d2.selector_rank)
            shapes["candidate_selector.successor_codebook"] = (self.vocab_size, d2.selector_rank)
            shapes["candidate_selector.hidden_projection.weight"] = (d2.selector_rank, h)
        return shapes
