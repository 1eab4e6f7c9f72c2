"""The arguments of draft_block.cpp's one call (CpuKernels.draft_block), checked once: a packed drafter's weights
when it is packed, a block's inputs and scratch once per draft (the C++ code trusts them, so a mismatch is refused
here, before any memory is touched). The ctypes structures mirror the C++ structs field by field."""

import ctypes
from dataclasses import dataclass

import torch

from shared.cpu_kernels.arguments import cache_pages, caches_fit, carve, check_arguments, pointer_array, tiles_of

_pointer, _count, _real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DraftConv(ctypes.Structure):
    _fields_ = [("projection", _pointer), ("base", _pointer)]


class DraftLayer(ctypes.Structure):
    _fields_ = [("q", _pointer), ("q_norm", _pointer), ("q_eps", _real), ("kv", _pointer), ("k_norm", _pointer),
                ("k_eps", _real), ("o", _pointer), ("post_norm", _pointer), ("post_eps", _real), ("gate_up", _pointer),
                ("down", _pointer), ("next_norm", _pointer), ("next_eps", _real), ("attention_conv", DraftConv),
                ("mlp_conv", DraftConv)]


class DraftShape(ctypes.Structure):
    _fields_ = [("layers", _count), ("hidden", _count), ("heads", _count), ("kv_heads", _count), ("dim", _count),
                ("intermediate", _count), ("conv_kernel", _count), ("conv_group", _count), ("amx", _count),
                ("scale", _real), ("first_norm", _pointer), ("first_eps", _real), ("features_width", _count),
                ("fc", _pointer), ("context_norm", _pointer), ("context_eps", _real)]


class DraftContext(ctypes.Structure):
    _fields_ = [("rows", _count), ("kv_bf16", _count), ("pages", _pointer),
                *((name, _pointer) for name in ("features", "cos", "sin", "slots", "positions", "k_caches",
                                                "v_caches", "context", "normed", "kv"))]


class DraftStep(ctypes.Structure):
    _fields_ = [("batch", _count), ("seq", _count), ("keys", _count), ("kv_bf16", _count), ("pages", _pointer),
                ("cos", _pointer), ("sin", _pointer), ("slots", _pointer), ("positions", _pointer),
                ("visible", _pointer), ("k_caches", _pointer), ("v_caches", _pointer)]


class DraftScratch(ctypes.Structure):
    _fields_ = [(name, _pointer) for name in ("filtered", "projected", "dynamic", "q_rows", "q", "attended", "kv",
                                              "gate_up", "act")]


@dataclass(frozen=True)
class ConvWeights:
    """A DFlash 2 dynamic convolution: kernel_projection as bfloat16 tiles (out 2 * kernel * hidden / group) and
    base [2, kernel, hidden] float32."""

    projection: torch.Tensor
    base: torch.Tensor


@dataclass(frozen=True)
class DraftLayerWeights:
    """One packed drafter layer: bfloat16 weight tiles ([ceil(out / 16), in, 16], bf16_gemm.cpp's layout), float32
    norms (q_norm [heads, dim] and k_norm [kv_heads, dim]: the head norm repeated per head), the convs of a DFlash 2
    layer (None: a DFlash layer). next_norm: the norm after the layer (the next layer's input norm, or the
    drafter's final one)."""

    q: torch.Tensor
    q_norm: torch.Tensor
    q_eps: float
    kv: torch.Tensor
    k_norm: torch.Tensor
    k_eps: float
    o: torch.Tensor
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    down: torch.Tensor
    next_norm: torch.Tensor
    next_eps: float
    attention_conv: ConvWeights | None
    mlp_conv: ConvWeights | None


@dataclass(frozen=True)
class ContextWeights:
    """The drafter's context projection: fc as bfloat16 tiles (in taps * hidden, out hidden) and the hidden norm
    [hidden] float32 after it."""

    fc: torch.Tensor
    norm: torch.Tensor
    eps: float


@dataclass(frozen=True)
class DraftBlockWeights:
    """Every layer of a packed drafter as draft_block.cpp takes them, the first layer's input norm [hidden] and the
    context projection (None: no one-call ingest). Holds the tensors the C structures point into."""

    layers: list[DraftLayerWeights]
    first_norm: torch.Tensor
    context: ContextWeights | None
    c_layers: ctypes.Array
    c_shape: DraftShape

    @classmethod
    def of(cls, layers: list[DraftLayerWeights], first_norm: torch.Tensor, first_eps: float, heads: int,
           kv_heads: int, dim: int, intermediate: int, conv_kernel: int = 0,
           conv_group: int = 0, amx: bool = False, context: ContextWeights | None = None) -> "DraftBlockWeights":
        """amx: the weight tiles are in the "amx" layout (CpuKernels.bf16_tiles), multiplied in bfloat16."""
        hidden = first_norm.shape[0]
        width = context.fc.shape[1] if context is not None else 0
        ok = (dim % 8 == 0 and dim <= 256 and kv_heads > 0 and heads % kv_heads == 0
              and first_norm.dtype == torch.float32 and first_norm.is_contiguous()
              and all(_layer_fits(w, hidden, heads, kv_heads, dim, intermediate, conv_kernel, conv_group)
                      for w in layers)
              and (context is None or (context.fc.dtype == torch.bfloat16 and context.fc.is_contiguous()
                                       and tiles_of(context.fc, width, hidden) and context.norm.shape == (hidden,)
                                       and context.norm.dtype == torch.float32 and context.norm.is_contiguous())))
        check_arguments(ok, "draft block weights", first_norm, *(t for w in layers for t in (w.q, w.kv, w.o)))
        c_layers = (DraftLayer * len(layers))(*(DraftLayer(
            w.q.data_ptr(), w.q_norm.data_ptr(), w.q_eps, w.kv.data_ptr(), w.k_norm.data_ptr(), w.k_eps, w.o.data_ptr(),
            w.post_norm.data_ptr(), w.post_eps, w.gate_up.data_ptr(), w.down.data_ptr(), w.next_norm.data_ptr(),
            w.next_eps, _c_conv(w.attention_conv), _c_conv(w.mlp_conv)) for w in layers))
        c_shape = DraftShape(len(layers), hidden, heads, kv_heads, dim, intermediate, conv_kernel, conv_group, amx,
                             dim ** -0.5, first_norm.data_ptr(), first_eps, width,
                             *((context.fc.data_ptr(), context.norm.data_ptr(), context.eps) if context
                               else (0, 0, 0.0)))
        return cls(layers, first_norm, context, c_layers, c_shape)


def _c_conv(conv: ConvWeights | None) -> DraftConv:
    return DraftConv(0, 0) if conv is None else DraftConv(conv.projection.data_ptr(), conv.base.data_ptr())


def _layer_fits(w: DraftLayerWeights, hidden: int, heads: int, kv_heads: int, dim: int, intermediate: int,
                conv_kernel: int, conv_group: int) -> bool:
    tiles = ((w.q, hidden, heads * dim), (w.kv, hidden, 2 * kv_heads * dim), (w.o, heads * dim, hidden),
             (w.gate_up, hidden, 2 * intermediate), (w.down, intermediate, hidden))
    convs = [c for c in (w.attention_conv, w.mlp_conv) if c is not None]
    if convs:  # a DFlash 2 layer has both
        if len(convs) != 2 or conv_kernel < 1 or conv_group < 1 or hidden % conv_group:
            return False
        width = 2 * conv_kernel * (hidden // conv_group)
        tiles += tuple((c.projection, hidden, width) for c in convs)
        if not all(c.base.shape == (2, conv_kernel, hidden) and c.base.dtype == torch.float32
                   and c.base.is_contiguous() for c in convs):
            return False
    elif conv_kernel:
        return False
    norms = ((w.q_norm, (heads, dim)), (w.k_norm, (kv_heads, dim)), (w.post_norm, (hidden,)),
             (w.next_norm, (hidden,)))
    return (all(t.dtype == torch.bfloat16 and t.is_contiguous() and tiles_of(t, i, o) for t, i, o in tiles)
            and all(n.shape == shape and n.dtype == torch.float32 and n.is_contiguous() for n, shape in norms))


@dataclass(frozen=True)
class DraftStepInputs:
    """One block's arguments (the C structures and the tensors they point into): batch blocks of seq rows,
    attending over the first `keys` positions of their slots."""

    c_step: DraftStep
    c_scratch: DraftScratch
    slots: torch.Tensor
    positions: torch.Tensor
    first_keys: torch.Tensor
    held: tuple

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              masks: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
              weights: DraftBlockWeights) -> "DraftStepInputs":
        """cos, sin [batch, seq, dim] float32; slots [batch]; positions [batch, seq]; masks: per layer [batch, 1,
        seq, keys] bool (shared.attention.visibility_mask; one length for all); keys, values: each layer's cache
        [slots, kv_heads, capacity, dim], float32 or bfloat16 (all alike)."""
        batch, seq = positions.shape
        shape = weights.c_shape
        length = masks[0].shape[-1]
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        converted = {id(m): m.expand(batch, 1, seq, length)[:, 0].contiguous().view(torch.uint8) for m in masks}
        visible = [converted[id(m)] for m in masks]  # [batch, seq, keys] per layer; a shared mask converted once
        ok = (cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (batch, seq, shape.dim)
              and slots.shape == (batch,) and len(masks) == len(keys) == len(values) == shape.layers
              and all(m.shape[-1] == length for m in masks) and caches_fit(keys, values, shape.kv_heads, shape.dim))
        check_arguments(ok, "draft step", cos, sin, slots, positions, *masks)
        c_visible = pointer_array(visible)
        k_caches, v_caches = pointer_array(keys), pointer_array(values)
        pages, table = cache_pages(keys[0], None)
        c_step = DraftStep(batch, seq, length, keys[0].dtype == torch.bfloat16, ctypes.addressof(pages),
                           cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), positions.data_ptr(),
                           ctypes.addressof(c_visible), ctypes.addressof(k_caches), ctypes.addressof(v_caches))
        c_scratch, buffer = _scratch(batch * seq, shape)
        return cls(c_step, c_scratch, slots, positions, keys[0],
                   (cos, sin, visible, keys, values, c_visible, k_caches, v_caches, buffer, pages, table))


@dataclass(frozen=True)
class DraftContextInputs:
    """One ingest's arguments (the C structure and the tensors it points into): context rows at their own slots
    and positions."""

    c_context: DraftContext
    slots: torch.Tensor
    positions: torch.Tensor
    first_keys: torch.Tensor
    held: tuple

    @classmethod
    def build(cls, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              weights: DraftBlockWeights) -> "DraftContextInputs":
        """features [rows, taps * hidden] float32; cos, sin [rows, dim] float32; slots, positions [rows]; keys,
        values: each layer's cache [slots, kv_heads, capacity, dim], float32 or bfloat16 (all alike)."""
        shape = weights.c_shape
        rows = features.shape[0]
        features, cos, sin = features.contiguous(), cos.contiguous(), sin.contiguous()
        slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        ok = (weights.context is not None and features.dtype == cos.dtype == sin.dtype == torch.float32
              and features.shape == (rows, shape.features_width) and cos.shape == sin.shape == (rows, shape.dim)
              and slots.shape == positions.shape == (rows,) and len(keys) == len(values) == shape.layers
              and caches_fit(keys, values, shape.kv_heads, shape.dim))
        check_arguments(ok, "draft ingest", features, cos, sin, slots, positions)
        k_caches, v_caches = pointer_array(keys), pointer_array(values)
        (context, normed, kv), buffer = carve(rows, [shape.hidden, shape.hidden, 2 * shape.kv_heads * shape.dim])
        pages, table = cache_pages(keys[0], None)
        c_context = DraftContext(rows, keys[0].dtype == torch.bfloat16, ctypes.addressof(pages),
                                 features.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                 positions.data_ptr(), ctypes.addressof(k_caches), ctypes.addressof(v_caches),
                                 context, normed, kv)
        return cls(c_context, slots, positions, keys[0],
                   (features, cos, sin, keys, values, k_caches, v_caches, buffer, pages, table))


def _scratch(rows: int, shape: DraftShape) -> tuple[DraftScratch, torch.Tensor]:
    """The buffers every layer of a block of `rows` rows reuses, carved from one allocation (the returned tensor),
    in DraftScratch's order."""
    attention = shape.heads * shape.dim
    dynamic = 2 * shape.conv_kernel * (shape.hidden // shape.conv_group) if shape.conv_kernel else 0
    widths = [shape.hidden, shape.hidden, dynamic, attention, attention, attention, 2 * shape.kv_heads * shape.dim,
              2 * shape.intermediate, shape.intermediate]
    pointers, buffer = carve(rows, widths)
    return DraftScratch(*pointers), buffer
