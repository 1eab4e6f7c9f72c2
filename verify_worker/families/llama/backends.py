"""The ways the Qwen3 / Llama decoder stack computes a step over a cache, one backend each, chosen once when the
model is packed (TargetModel.pack); training and scoring (no cache) and an unpacked model take the eager one.

- EagerLayers: PyTorch ops layer by layer: the loaded modules, the projections packed for PyTorch's GEMM, or the
  rows layout (every product, norm and the attention over the cache through cuda_ext's row kernels, set on the
  modules by pack: --batch-invariant on a GPU).
- KernelLayers: the C++ CPU kernels op by op (float32 on CPU): each residual add fused with the next norm; q/k
  norms, rotary and the cache write in one call; row-by-row attention.
- WholeStack: the same kernels with every layer in one call (shared/cpu_kernels/decoder_layer.cpp): the same ops
  on the same values in the same order, so the same bits, without the per-layer calls between them.

Each has `accepts(x)` (whether it computes this input) and `run(model, x, rope, cache, slots, read_slots,
positions, kv_len, mask, tap_layers)`, and says how the caller prepares the keys: `invariant_keys` (key
lengths in whole chunks, see shared.attention.batch_invariant_attention) and `needs_mask` (the rows layout's
attention takes positions instead of a mask)."""

from dataclasses import dataclass

import torch

from shared.attention import batch_invariant_attention, cached_attention
from shared.cpu_kernels.layer_step import DenseLayerWeights, StackStepInputs, StackWeights
from shared.packed_linear import common_layout
from verify_worker.families.interface import TargetOutput


def tapped_in_order(taps: dict[int, torch.Tensor], tap_layers: tuple[int, ...]) -> torch.Tensor | None:
    """The tapped layers' outputs side by side, in the drafter's order: [b, s, len(tap_layers) * hidden]."""
    return torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None


@dataclass(frozen=True)
class EagerLayers:
    """PyTorch ops, layer by layer. invariant: attention through batch_invariant_attention (bfloat16 on CPU, where
    the fused kernel's roundings depend on the block's shape, and the rows layout without a cache); rows: the rows
    layout over a cache (its row attention takes positions, no mask)."""

    invariant: bool
    rows: bool

    @classmethod
    def of(cls, x: torch.Tensor, rows_layout: bool, cached: bool) -> "EagerLayers":
        invariant = rows_layout or (x.device.type == "cpu" and x.dtype == torch.bfloat16)
        return cls(invariant=invariant, rows=rows_layout and cached)

    @property
    def invariant_keys(self) -> bool:
        return self.invariant

    @property
    def needs_mask(self) -> bool:
        return not self.rows

    def accepts(self, x: torch.Tensor) -> bool:
        return True

    def run(self, model, x, rope, cache, slots, read_slots, positions, kv_len, mask, tap_layers) -> TargetOutput:
        attend = batch_invariant_attention if self.invariant else cached_attention
        cos, sin = rope
        taps = {}
        for index, layer in enumerate(model.model.layers):
            x = layer(x, cos, sin, cache, slots, read_slots, positions, kv_len, mask, attend)
            if index in tap_layers:
                taps[index] = x
        return TargetOutput(hidden=model.model.norm(x), taps=tapped_in_order(taps, tap_layers))


class KernelLayers:
    """The C++ CPU kernels (float32 on CPU), op by op."""

    invariant_keys = False
    needs_mask = True

    def __init__(self, kernels):
        self.kernels = kernels

    @staticmethod
    def accepts(x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.device.type == "cpu"

    def run(self, model, x, rope, cache, slots, read_slots, positions, kv_len, mask, tap_layers) -> TargetOutput:
        kernels, layers = self.kernels, model.model.layers
        h = kernels.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)  # [b, s, hidden]
        taps = {}
        for index, layer in enumerate(layers):
            attention = self._attention(layer.self_attn, h, rope, cache, slots, read_slots, positions, kv_len, mask)
            post = layer.post_attention_layernorm
            x, h = kernels.add_rms_norm(x, attention, post.weight, post.eps)
            following = layers[index + 1].input_layernorm if index + 1 < len(layers) else model.model.norm
            x, h = kernels.add_rms_norm(x, layer.mlp(h), following.weight, following.eps)
            if index in tap_layers:
                taps[index] = x
        return TargetOutput(hidden=h, taps=tapped_in_order(taps, tap_layers))

    def _attention(self, attention, x, rope, cache, slots, read_slots, positions, kv_len, mask) -> torch.Tensor:
        """A packed attention layer over the cache: x [b, s, hidden] -> [b, s, hidden]."""
        cos, sin = rope
        qkv = attention.qkv_proj(x)  # [b, s, (heads + 2 kv_heads) * dim]
        norm = getattr(attention, "qk_norm_weight", None)
        eps = attention.q_norm.eps if attention.q_norm is not None else 0.0
        index, dim = attention.layer_index, attention.head_dim
        q = self.kernels.qk_rotary_cache(qkv, attention.num_heads, attention.num_kv_heads, dim, norm, eps, cos, sin,
                                         cache.keys[index], cache.values[index], slots, positions, cache.page_table)
        if dim % 8 or dim > 256:  # a head size the kernel does not take: PyTorch's attention over the keys read
            keys, values = cache.read(index, read_slots, kv_len)  # [b, kv_heads, kv_len, dim]
            return attention.o_proj(self.kernels.attention(q, keys, values, mask, dim**-0.5))
        return attention.o_proj(self.kernels.cache_attention(q, cache.keys[index], cache.values[index],
                                                             cache.page_table, slots, mask, dim**-0.5))


class WholeStack(KernelLayers):
    """The C++ CPU kernels with every layer in one call; the threads of model.pool (share_kernel_threads)."""

    def __init__(self, kernels, weights: StackWeights):
        super().__init__(kernels)
        self.weights = weights

    @classmethod
    def of(cls, model, kernels) -> "WholeStack | None":
        """The packed layers as decoder_layer.cpp takes them, or None where a layer is not a plain dense one on the
        bfloat16 tiles (a bias, a tensor-parallel all-reduce, weights that are not exact in bfloat16, head sizes
        the attention kernel does not take, layers of different shapes): those run op by op."""
        result, layers = [], model.model.layers
        for index, layer in enumerate(layers):
            attention, mlp = layer.self_attn, layer.mlp
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(linear is None or linear.kernels is None or linear.bias is not None or linear.reduce is not None
                   for linear in linears):
                return None
            dim = attention.head_dim
            if dim % 8 or dim > 256 or attention.num_heads % attention.num_kv_heads:
                return None
            norm = getattr(attention, "qk_norm_weight", None)
            post = layer.post_attention_layernorm
            following = layers[index + 1].input_layernorm if index + 1 < len(layers) else model.model.norm
            result.append(DenseLayerWeights(
                hidden=model.config.hidden_size, heads=attention.num_heads,
                kv_heads=attention.num_kv_heads, dim=dim, qkv=attention.qkv_proj.weight,
                qk_norm=None if norm is None else norm.float().contiguous(),
                qk_eps=attention.q_norm.eps if attention.q_norm is not None else 0.0, o=attention.o_proj.weight,
                post_norm=post.weight.detach().float().contiguous(), post_eps=post.eps, gate_up=mlp.gate_up_proj.weight,
                gate_up_width=mlp.gate_up_proj.out_features, down=mlp.down_proj.weight,
                next_norm=following.weight.detach().float().contiguous(), next_eps=following.eps,
            ))
        first = layers[0].input_layernorm
        layout = common_layout(layers.modules())
        if layout is None:
            return None
        weights = StackWeights.of(result, first.weight.detach().float().contiguous(), first.eps, amx=layout == "amx")
        return cls(kernels, weights)

    def run(self, model, x, rope, cache, slots, read_slots, positions, kv_len, mask, tap_layers) -> TargetOutput:
        cos, sin = rope
        batch, seq, hidden = x.shape
        step = StackStepInputs.build(cos, sin, slots, positions, mask, cache.keys, cache.values, self.weights,
                                     tap_layers, cache.page_table)
        _, h = self.kernels.decoder_stack(x.reshape(batch * seq, hidden), self.weights, step, model.pool)
        tapped = None if step.taps is None else step.taps.view(batch, seq, -1)  # in the drafter's order
        return TargetOutput(hidden=h.view(batch, seq, hidden), taps=tapped)
