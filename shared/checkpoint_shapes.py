"""Checkpoint tensor names and shapes that both roles' configs list (torch-free)."""


def decoder_layer_shapes(prefix: str, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, attention_bias: bool = False, mlp_bias: bool = False,
                         qk_norm: bool = True) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of one Qwen3/Llama-style decoder layer (HF names after prefix)."""
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    projections = {"q": (q_out, hidden), "k": (kv_out, hidden), "v": (kv_out, hidden), "o": (hidden, q_out)}
    mlp = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    shapes = {prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,)}
    for name, shape in projections.items():
        shapes[prefix + f"self_attn.{name}_proj.weight"] = shape
        if attention_bias:
            shapes[prefix + f"self_attn.{name}_proj.bias"] = shape[:1]
    for name, shape in mlp.items():
        shapes[prefix + f"mlp.{name}_proj.weight"] = shape
        if mlp_bias:
            shapes[prefix + f"mlp.{name}_proj.bias"] = shape[:1]
    if qk_norm:
        shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
    return shapes
