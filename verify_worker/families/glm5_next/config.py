"""GLM-5.3-Flash (`glm5_next`: Glm5NextForConditionalGeneration) text settings from its config.json.

The text model's keys live under "text_config" (a flat text-only config is accepted too). Spellings as published
and as transformers 5.24 reads them: `layer_types` "linear_attention" / "deepseek_sparse_attention" (also
"indexed_attention", "full_attention"), `linear_attn_config` {num_heads, head_dim, short_conv_kernel_size,
gate_lower_bound}, and the keys vLLM reads that transformers does not declare (`mhc`, `mla_use_nope`,
`topk_method`, `scoring_func`). Facts: ../shared/docs/glm-targets.md sections 0-2.
"""

from dataclasses import dataclass

from shared.config_values import config_int
from shared.errors import ConfigError
from shared.target_facts import eos_ids, text_config
from verify_worker.families.common.config_parts import indexer_schedule

ARCHITECTURE = "Glm5NextForConditionalGeneration"
INDEXED = ("deepseek_sparse_attention", "indexed_attention", "full_attention")


def layer_schedule(config: dict, num_layers: int) -> tuple[str, ...]:
    """Per layer "linear" (KDA) or "indexed" (MLA + DSA); default: indexed iff i % 4 == 3."""
    types = config.get("layer_types")
    if types is None:
        return tuple("indexed" if i % 4 == 3 else "linear" for i in range(num_layers))
    if len(types) != num_layers:
        raise ConfigError(f"config.json: layer_types must name each of the {num_layers} layers, got {len(types)}")
    out = []
    for kind in types:
        if kind == "linear_attention":
            out.append("linear")
        elif kind in INDEXED:
            out.append("indexed")
        else:
            raise ConfigError(f"config.json: layer type {kind!r} is not one of linear_attention, "
                              f"{', '.join(INDEXED)}")
    return tuple(out)


@dataclass(frozen=True)
class Glm5NextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # "linear" (KDA) or "indexed" (MLA + DSA)
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]  # per layer; read on indexed layers only
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    index_kpool: int
    always_select_tail: bool
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim  # NoPE: no rotary part

    @property
    def qk_rope_head_dim(self) -> int:
        return 0

    @property
    def linear_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @classmethod
    def from_dict(cls, config: dict) -> "Glm5NextConfig":
        text = text_config(config)
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {text.get('hidden_act')!r} is not supported (only 'silu')")
        if text.get("attention_bias"):
            raise ConfigError("config.json: attention_bias is not supported for glm5_next")
        if text.get("mhc") is False:
            raise ConfigError("config.json: mhc false is not supported (GLM-5.3-Flash mixes hyper-connection streams)")
        if text.get("qk_rope_head_dim", 0):
            raise ConfigError(f"config.json: qk_rope_head_dim {text['qk_rope_head_dim']} is not supported: "
                              "GLM-5.3-Flash attends without RoPE (mla_use_nope)")
        for key, allowed in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if text.get(key, allowed) != allowed:
                raise ConfigError(f"config.json: {key} {text[key]!r} is not supported (only {allowed!r})")
        layers = config_int(text, "num_hidden_layers", 45)
        heads = config_int(text, "num_attention_heads", 64)
        if text.get("num_key_value_heads", heads) != heads:
            raise ConfigError("config.json: MLA needs num_key_value_heads == num_attention_heads")
        linear = text.get("linear_attn_config") or {}
        if not isinstance(linear, dict):
            raise ConfigError("config.json: linear_attn_config must be a JSON object")
        lower = linear.get("gate_lower_bound", text.get("linear_lower_bound", -5.0))
        if lower is None and linear.get("safe_gate", True):
            lower = -5.0
        kpool, topk = config_int(text, "index_kpool", 16), config_int(text, "index_topk", 2048)
        if topk % kpool:
            raise ConfigError(f"config.json: index_topk {topk} must be a multiple of index_kpool {kpool}")
        experts, groups = config_int(text, "n_routed_experts", 288), config_int(text, "n_group", 1)
        if experts % groups:
            raise ConfigError(f"config.json: n_group {groups} does not divide n_routed_experts {experts}")
        layer_types = layer_schedule(text, layers)
        indexer_types = indexer_schedule({**text, "indexer_types": text.get("indexer_types")}, layers) \
            if any(t == "indexed" for t in layer_types) else ("full",) * layers
        for i, kind in enumerate(layer_types):  # transformers passes a selection only from a full layer to the next
            if kind == "indexed" and indexer_types[i] == "shared" and (
                    i == 0 or layer_types[i - 1] != "indexed" or indexer_types[i - 1] != "full"):
                raise ConfigError(f"config.json: layer {i}'s indexer is 'shared' but layer {i - 1} is not a full "
                                  "indexed layer (a shared layer reuses the selection of the layer right before it)")
        mlp = text.get("mlp_layer_types") or ["dense"] * min(3, layers) + ["sparse"] * max(layers - 3, 0)
        if len(mlp) != layers or any(t not in ("dense", "sparse") for t in mlp):
            raise ConfigError(f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} "
                              "layers")
        dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
        return cls(
            vocab_size=config_int(text, "vocab_size", 154880),
            hidden_size=config_int(text, "hidden_size", 4096),
            intermediate_size=config_int(text, "intermediate_size", 12288),
            moe_intermediate_size=config_int(text, "moe_intermediate_size", 2048),
            num_layers=layers,
            layer_types=layer_types,
            mlp_layer_types=tuple(mlp),
            indexer_types=indexer_types,
            num_heads=heads,
            q_lora_rank=config_int(text, "q_lora_rank", 1536),
            kv_lora_rank=config_int(text, "kv_lora_rank", 512),
            qk_nope_head_dim=config_int(text, "qk_nope_head_dim", 256),
            v_head_dim=config_int(text, "v_head_dim", 256),
            n_routed_experts=experts,
            n_shared_experts=config_int(text, "n_shared_experts", 1, minimum=0),
            num_experts_per_tok=config_int(text, "num_experts_per_tok", 8),
            n_group=groups,
            topk_group=config_int(text, "topk_group", 1),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 2.5)),
            swiglu_limit=float(text.get("swiglu_limit", 10.0)),
            index_topk=topk,
            index_head_dim=config_int(text, "index_head_dim", 128),
            index_n_heads=config_int(text, "index_n_heads", 32),
            index_kpool=kpool,
            always_select_tail=bool(text.get("index_kpool_always_select_tail", True)),
            linear_num_heads=config_int(linear, "num_heads", text.get("linear_num_heads", 64)),
            linear_head_dim=config_int(linear, "head_dim", text.get("linear_head_dim", 128)),
            conv_kernel=config_int(linear, "short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
            gate_lower_bound=None if lower is None else float(lower),
            hc_mult=config_int(text, "hc_mult", 4),
            hc_eps=float(text.get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=config_int(text, "hc_sinkhorn_iters", 20),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            max_position_embeddings=config_int(text, "max_position_embeddings", 1048576),
            checkpoint_dtype=str(dtype or "bfloat16"),
            eos_token_ids=eos_ids(text) or eos_ids(config),
        )
