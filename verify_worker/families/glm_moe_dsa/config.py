"""GLM-5.2 (`glm_moe_dsa`, GlmMoeDsaForCausalLM) settings from its config.json, as published.

Keys as transformers 5.24 declares them, plus what the published checkpoints carry and vLLM reads
(`index_topk_freq` / `index_skip_topk_offset` / `index_topk_pattern`, `indexer_rope_interleave`,
`moe_router_dtype`, `quantization_config`). Facts: ../shared/docs/glm-targets.md section 4.
"""

from dataclasses import dataclass

from shared.config_values import config_int
from shared.errors import ConfigError
from shared.target_facts import eos_ids
from verify_worker.families.common.config_parts import Fp8Settings, indexer_schedule

ARCHITECTURE = "GlmMoeDsaForCausalLM"
# the q/kv latent norms: transformers builds them with its RMSNorm default, not rms_norm_eps (vLLM uses
# rms_norm_eps); we follow transformers, the oracle
LATENT_NORM_EPS = 1e-6
INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm


def mlp_schedule(config: dict, num_layers: int) -> tuple[str, ...]:
    types = config.get("mlp_layer_types")
    if types is None:
        dense = min(config_int(config, "first_k_dense_replace", 3, minimum=0), num_layers)
        types = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    types = tuple(types)
    if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                          f"{num_layers} layers, got {list(types)!r}")
    return types


@dataclass(frozen=True)
class GlmMoeDsaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...]
    fp8: Fp8Settings | None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, config: dict) -> "GlmMoeDsaConfig":
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {config.get('hidden_act')!r} is not supported (only 'silu')")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ConfigError("config.json: attention_bias / mlp_bias are not supported for glm_moe_dsa")
        rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json: rope type {rope_type!r} is not supported for glm_moe_dsa (the published "
                              "checkpoints use 'default')")
        if config.get("indexer_rope_interleave") is False:
            raise ConfigError("config.json: indexer_rope_interleave false is not supported (GLM-5.2 interleaves)")
        if config.get("moe_router_dtype", "float32") != "float32":
            raise ConfigError(f"config.json: moe_router_dtype {config.get('moe_router_dtype')!r} is not supported "
                              "(the router runs in float32)")
        layers = config_int(config, "num_hidden_layers", 78)
        heads = config_int(config, "num_attention_heads", 64)
        kv_heads = config.get("num_key_value_heads", heads)
        if kv_heads != heads:
            raise ConfigError(f"config.json: MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} "
                              f"and {heads}")
        experts, groups = config_int(config, "n_routed_experts", 256), config_int(config, "n_group", 1)
        if experts % groups:
            raise ConfigError(f"config.json: n_group {groups} does not divide n_routed_experts {experts}")
        topk_group = config_int(config, "topk_group", 1)
        per_token = config_int(config, "num_experts_per_tok", 8)
        if topk_group > groups or per_token > topk_group * (experts // groups):
            raise ConfigError(f"config.json: num_experts_per_tok {per_token} cannot be chosen from topk_group "
                              f"{topk_group} of {groups} expert groups")
        rope_dim = config_int(config, "qk_rope_head_dim", 64)
        index_dim = config_int(config, "index_head_dim", 128)
        if rope_dim % 2 or index_dim < rope_dim:
            raise ConfigError(f"config.json: qk_rope_head_dim {rope_dim} must be even and at most index_head_dim "
                              f"{index_dim}")
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        return cls(
            vocab_size=config_int(config, "vocab_size", 154880),
            hidden_size=config_int(config, "hidden_size", 6144),
            intermediate_size=config_int(config, "intermediate_size", 12288),
            moe_intermediate_size=config_int(config, "moe_intermediate_size", 2048),
            num_layers=layers,
            num_heads=heads,
            q_lora_rank=config_int(config, "q_lora_rank", 2048),
            kv_lora_rank=config_int(config, "kv_lora_rank", 512),
            qk_nope_head_dim=config_int(config, "qk_nope_head_dim", 192),
            qk_rope_head_dim=rope_dim,
            v_head_dim=config_int(config, "v_head_dim", 256),
            n_routed_experts=experts,
            n_shared_experts=config_int(config, "n_shared_experts", 1, minimum=0),
            num_experts_per_tok=per_token,
            n_group=groups,
            topk_group=topk_group,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
            index_topk=config_int(config, "index_topk", 2048),
            index_head_dim=index_dim,
            index_n_heads=config_int(config, "index_n_heads", 32),
            indexer_types=indexer_schedule(config, layers),
            mlp_layer_types=mlp_schedule(config, layers),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config_int(config, "max_position_embeddings", 202752),
            checkpoint_dtype=str(dtype),
            eos_token_ids=eos_ids(config),
            fp8=Fp8Settings.from_config(config),
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensor names and shapes (bf16 layout; an FP8 checkpoint adds weight_scale_inv
        tensors, and stores per-expert tensors, which the loader stacks)."""
        h, heads = self.hidden_size, self.num_heads
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_a_proj.weight": (self.q_lora_rank, h),
                p + "self_attn.q_a_layernorm.weight": (self.q_lora_rank,),
                p + "self_attn.q_b_proj.weight": (heads * self.qk_head_dim, self.q_lora_rank),
                p + "self_attn.kv_a_proj_with_mqa.weight": (self.kv_lora_rank + self.qk_rope_head_dim, h),
                p + "self_attn.kv_a_layernorm.weight": (self.kv_lora_rank,),
                p + "self_attn.kv_b_proj.weight": (heads * (self.qk_nope_head_dim + self.v_head_dim),
                                                   self.kv_lora_rank),
                p + "self_attn.o_proj.weight": (h, heads * self.v_head_dim),
            })
            if self.indexer_types[i] == "full":
                d = self.index_head_dim
                shapes.update({
                    p + "self_attn.indexer.wq_b.weight": (self.index_n_heads * d, self.q_lora_rank),
                    p + "self_attn.indexer.wk.weight": (d, h),
                    p + "self_attn.indexer.k_norm.weight": (d,), p + "self_attn.indexer.k_norm.bias": (d,),
                    p + "self_attn.indexer.weights_proj.weight": (self.index_n_heads, h),
                })
            if self.mlp_layer_types[i] == "dense":
                shapes.update(_mlp_shapes(p + "mlp.", h, self.intermediate_size))
            else:
                e, m = self.n_routed_experts, self.moe_intermediate_size
                shapes.update({p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,)})
                for expert in range(e):
                    shapes.update(_mlp_shapes(p + f"mlp.experts.{expert}.", h, m))
                if self.n_shared_experts:
                    shapes.update(_mlp_shapes(p + "mlp.shared_experts.", h, m * self.n_shared_experts))
        return shapes


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inner, hidden), prefix + "up_proj.weight": (inner, hidden),
            prefix + "down_proj.weight": (hidden, inner)}
