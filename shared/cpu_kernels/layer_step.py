"""The arguments of decoder_layer.cpp's one call (CpuKernels.decoder_stack), checked once: the layers' weights
when the model is packed, a step's inputs and scratch once per forward (the C++ code trusts them, so a mismatch
is refused here, before any memory is touched). The ctypes structures mirror the C++ structs field by field."""

import ctypes
from dataclasses import dataclass

import torch

from shared.cpu_kernels.arguments import cache_pages, caches_fit, carve, check_arguments, pointer_array, tiles_of

_pointer, _count, _real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class StackLayer(ctypes.Structure):
    _fields_ = [("qkv", _pointer), ("qk_norm", _pointer), ("qk_eps", _real), ("o", _pointer), ("post_norm", _pointer),
                ("post_eps", _real), ("gate_up", _pointer), ("down", _pointer), ("next_norm", _pointer),
                ("next_eps", _real)]


class StackShape(ctypes.Structure):
    _fields_ = [("layers", _count), ("hidden", _count), ("heads", _count), ("kv_heads", _count), ("dim", _count),
                ("intermediate", _count), ("amx", _count), ("scale", _real), ("first_norm", _pointer),
                ("first_eps", _real)]


class StackStep(ctypes.Structure):
    _fields_ = [("batch", _count), ("seq", _count), ("keys", _count), ("kv_bf16", _count), ("pages", _pointer),
                ("cos", _pointer), ("sin", _pointer), ("slots", _pointer), ("positions", _pointer),
                ("visible", _pointer), ("k_caches", _pointer), ("v_caches", _pointer), ("taps", _pointer),
                ("tap_stride", _count)]


class StackScratch(ctypes.Structure):
    _fields_ = [("qkv", _pointer), ("q", _pointer), ("attended", _pointer), ("projected", _pointer),
                ("gate_up", _pointer), ("act", _pointer)]


@dataclass(frozen=True)
class DenseLayerWeights:
    """One packed dense decoder layer: bfloat16 weight tiles ([ceil(out / 16), in, 16], bf16_gemm.cpp's layout)
    and float32 norm weights. qk_norm [heads + kv_heads, dim] or None (no q/k norms); next_norm: the norm after
    the layer (the next layer's input norm, or the model's final one)."""

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
              and tiles_of(self.qkv, self.hidden, width) and tiles_of(self.o, self.heads * self.dim, self.hidden)
              and tiles_of(self.gate_up, self.hidden, self.gate_up_width) and self.gate_up_width % 2 == 0
              and tiles_of(self.down, intermediate, self.hidden)
              and all(n.shape == (self.hidden,) and n.dtype == torch.float32 and n.is_contiguous()
                      for n in (self.post_norm, self.next_norm))
              and (self.qk_norm is None or (self.qk_norm.shape == (self.heads + self.kv_heads, self.dim)
                                            and self.qk_norm.dtype == torch.float32 and self.qk_norm.is_contiguous())))
        check_arguments(ok, "layer weights", self.qkv, self.o, self.gate_up, self.down, self.post_norm,
                        self.next_norm)

    @property
    def qk_norm_ptr(self) -> int:
        return 0 if self.qk_norm is None else self.qk_norm.data_ptr()


@dataclass(frozen=True)
class StackWeights:
    """Every layer of a packed dense decoder, as decoder_layer.cpp takes them: the layers (alike in shape) and the
    first layer's input norm [hidden] float32. Holds the tensors the C structures point into."""

    layers: list[DenseLayerWeights]
    first_norm: torch.Tensor
    first_eps: float
    c_layers: ctypes.Array
    c_shape: StackShape

    @classmethod
    def of(cls, layers: list[DenseLayerWeights], first_norm: torch.Tensor, first_eps: float,
           amx: bool = False) -> "StackWeights | None":
        """None where the layers differ in shape (one call runs one shape). amx: the weight tiles are in the "amx"
        layout (CpuKernels.bf16_tiles), multiplied in bfloat16."""
        shape = {(w.hidden, w.heads, w.kv_heads, w.dim, w.gate_up_width, w.qk_norm is None) for w in layers}
        if len(shape) != 1:
            return None
        first = layers[0]
        check_arguments(first_norm.shape == (first.hidden,) and first_norm.dtype == torch.float32
                        and first_norm.is_contiguous(), "stack weights", first_norm)
        c_layers = (StackLayer * len(layers))(*(StackLayer(
            w.qkv.data_ptr(), w.qk_norm_ptr, w.qk_eps, w.o.data_ptr(), w.post_norm.data_ptr(), w.post_eps,
            w.gate_up.data_ptr(), w.down.data_ptr(), w.next_norm.data_ptr(), w.next_eps) for w in layers))
        c_shape = StackShape(len(layers), first.hidden, first.heads, first.kv_heads, first.dim,
                             first.gate_up_width // 2, amx, first.dim ** -0.5, first_norm.data_ptr(), first_eps)
        return cls(layers, first_norm, first_eps, c_layers, c_shape)


@dataclass(frozen=True)
class StackStepInputs:
    """One forward's arguments (the C structures and the tensors they point into): batch rows of seq tokens each,
    attending over the first `keys` positions of their slots. taps [batch * seq, len(tap_layers) * hidden]: the
    tapped layers' outputs side by side, in tap_layers' order (None without taps)."""

    c_step: StackStep
    c_scratch: StackScratch
    slots: torch.Tensor
    positions: torch.Tensor
    first_keys: torch.Tensor
    taps: torch.Tensor | None
    held: tuple

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], stack: StackWeights,
              tap_layers: tuple[int, ...], table: torch.Tensor | None = None) -> "StackStepInputs":
        """cos, sin [batch, seq, dim] float32; slots [batch]; positions [batch, seq]; mask [batch, 1, seq, keys]
        bool (shared.attention.visibility_mask); keys, values: each layer's cache [pages, kv_heads, page_size,
        dim], float32 or bfloat16 (all alike), read through table [slots, pages_per_slot] (None: a page a slot)."""
        batch, seq = positions.shape
        length = mask.shape[-1]
        layers = stack.layers
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        visible = mask.expand(batch, 1, seq, length)[:, 0].contiguous().view(torch.uint8)  # [batch, seq, keys]
        dim, kv_heads = layers[0].dim, layers[0].kv_heads
        ok = (cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (batch, seq, dim)
              and slots.shape == (batch,) and len(keys) == len(values) == len(layers)
              and all(t in range(len(layers)) for t in tap_layers) and len(set(tap_layers)) == len(tap_layers)
              and caches_fit(keys, values, kv_heads, dim))
        check_arguments(ok, "stack step", cos, sin, slots, positions, mask)
        hidden, rows = layers[0].hidden, batch * seq
        taps = torch.empty(rows, len(tap_layers) * hidden, dtype=torch.float32) if tap_layers else None
        tap_pointers = [0] * len(layers)
        for order, layer in enumerate(tap_layers):
            tap_pointers[layer] = taps.data_ptr() + order * hidden * 4  # bytes
        k_caches, v_caches, c_taps = pointer_array(keys), pointer_array(values), pointer_array(tap_pointers)
        pages, table = cache_pages(keys[0], table)
        c_step = StackStep(batch, seq, length, keys[0].dtype == torch.bfloat16, ctypes.addressof(pages),
                           cos.data_ptr(), sin.data_ptr(),
                           slots.data_ptr(), positions.data_ptr(), visible.data_ptr(), ctypes.addressof(k_caches),
                           ctypes.addressof(v_caches), ctypes.addressof(c_taps), len(tap_layers) * hidden)
        c_scratch, buffer = _scratch(rows, layers[0])
        return cls(c_step, c_scratch, slots, positions, keys[0], taps,
                   (cos, sin, visible, keys, values, k_caches, v_caches, c_taps, buffer, pages, table))


def _scratch(rows: int, layer: DenseLayerWeights) -> tuple[StackScratch, torch.Tensor]:
    """The buffers every layer of a forward of `rows` rows reuses, carved from one allocation (the returned
    tensor): qkv [rows, (heads + 2 kv_heads) * dim], q and attended [rows, heads * dim], projected [rows, hidden],
    gate_up [rows, 2 * intermediate], act [rows, intermediate]."""
    widths = [(layer.heads + 2 * layer.kv_heads) * layer.dim, layer.heads * layer.dim, layer.heads * layer.dim,
              layer.hidden, layer.gate_up_width, layer.gate_up_width // 2]
    pointers, buffer = carve(rows, widths)
    return StackScratch(*pointers), buffer
