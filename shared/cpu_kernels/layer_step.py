"""The tensors of decoder_layer.cpp's two calls (CpuKernels.layer_attention / layer_mlp_out), checked once: a
layer's weights when the model is packed, a step's inputs and scratch once per forward (the C++ code trusts
them, so a mismatch is refused here, before any memory is touched)."""

from dataclasses import dataclass

import torch

from shared.cpu_kernels.library import TILE, check_arguments


@dataclass(frozen=True)
class DenseLayerWeights:
    """One packed dense decoder layer: bfloat16 weight tiles ([ceil(out / 16), in, 16], bf16_gemm.cpp's layout)
    and float32 norm weights. qk_norm [heads + kv_heads, dim] or None (no q/k norms); next_norm: the norm after
    the layer (the next layer's input norm, or the model's final one)."""

    index: int
    hidden: int
    heads: int
    kv_heads: int
    dim: int
    qkv: torch.Tensor
    qk_norm: torch.Tensor | None
    qk_eps: float
    o: torch.Tensor
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    gate_up_width: int
    down: torch.Tensor
    next_norm: torch.Tensor
    next_eps: float

    def __post_init__(self):
        width = (self.heads + 2 * self.kv_heads) * self.dim
        intermediate = self.gate_up_width // 2
        ok = (self.dim % 8 == 0 and self.dim <= 256 and self.kv_heads > 0 and self.heads % self.kv_heads == 0
              and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (self.qkv, self.o, self.gate_up,
                                                                                self.down))
              and _tiles_of(self.qkv, self.hidden, width) and _tiles_of(self.o, self.heads * self.dim, self.hidden)
              and _tiles_of(self.gate_up, self.hidden, self.gate_up_width) and self.gate_up_width % 2 == 0
              and _tiles_of(self.down, intermediate, self.hidden)
              and all(n.shape == (self.hidden,) and n.dtype == torch.float32 and n.is_contiguous()
                      for n in (self.post_norm, self.next_norm))
              and (self.qk_norm is None or (self.qk_norm.shape == (self.heads + self.kv_heads, self.dim)
                                            and self.qk_norm.dtype == torch.float32 and self.qk_norm.is_contiguous())))
        check_arguments(ok, "layer weights", self.qkv, self.o, self.gate_up, self.down, self.post_norm,
                        self.next_norm)

    @property
    def qk_norm_ptr(self) -> int:
        return 0 if self.qk_norm is None else self.qk_norm.data_ptr()


def _tiles_of(tiles: torch.Tensor, in_features: int, out_features: int) -> bool:
    return tiles.dim() == 3 and tiles.shape == (-(-out_features // TILE), in_features, TILE)


@dataclass(frozen=True)
class LayerStepInputs:
    """What every layer of one forward shares: batch rows of seq tokens each, attending over the first `keys`
    positions of their slots; cos, sin [batch, seq, dim] float32; slots [batch] and positions [batch, seq]
    int64; visible [batch, seq, keys] uint8; caches: each layer's (keys, values) [slots, kv_heads, capacity,
    dim]."""

    batch: int
    seq: int
    keys: int
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              layers: list[DenseLayerWeights]) -> "LayerStepInputs":
        """mask [batch, 1, seq, keys] bool (shared.attention.visibility_mask)."""
        batch, seq = positions.shape
        length = mask.shape[-1]
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        visible = mask.expand(batch, 1, seq, length)[:, 0].contiguous().view(torch.uint8)  # [batch, seq, keys]
        caches = list(zip(keys, values))
        ok = (cos.dtype == sin.dtype == torch.float32 and slots.shape == (batch,) and len(caches) == len(layers)
              and all(cos.shape == sin.shape == (batch, seq, layer.dim) for layer in layers)
              and all(k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
                      and k.shape == v.shape and k.dim() == 4 and k.shape[1] == layer.kv_heads
                      and k.shape[3] == layer.dim
                      for (k, v), layer in zip(caches, layers)))
        check_arguments(ok, "layer step", cos, sin, slots, positions, mask)
        return cls(batch, seq, length, cos, sin, slots, positions, visible, caches)


@dataclass(frozen=True)
class LayerScratch:
    """Buffers every layer of one forward reuses: qkv [rows, (heads + 2 kv_heads) * dim], q and attended
    [rows * heads * dim], projected [rows, hidden], h_next [rows, hidden] (the post-attention norm)."""

    qkv: torch.Tensor
    q: torch.Tensor
    attended: torch.Tensor
    projected: torch.Tensor
    h_next: torch.Tensor

    @classmethod
    def for_rows(cls, rows: int, layers: list[DenseLayerWeights]) -> "LayerScratch":
        width = max((layer.heads + 2 * layer.kv_heads) * layer.dim for layer in layers)
        attended = max(layer.heads * layer.dim for layer in layers)
        hidden = layers[0].hidden

        def buffer(*shape):
            return torch.empty(*shape, dtype=torch.float32)

        return cls(buffer(rows, width), buffer(rows * attended), buffer(rows * attended), buffer(rows, hidden),
                   buffer(rows, hidden))
