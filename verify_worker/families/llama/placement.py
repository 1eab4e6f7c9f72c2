"""What a Qwen3/Llama rank holds once loaded and packed (the memory plan's figures): the loader's dtypes, and
TargetModel.pack's stores, counted on the meta skeleton."""

from dataclasses import dataclass

import torch

from shared.dtype_choice import kv_cache_dtype, resolve_dtype
from shared.packed_linear import float32_kernels_run, kernel_layout, layout_for, packed_size
from verify_worker.families.llama.config import TargetConfig
from verify_worker.families.llama.model import TargetModel
from verify_worker.families.placement import Placement, add_bytes
from verify_worker.parallel.group import TensorParallel

# the projections each layer's pack() fuses into one product, by their names in the layer
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
RESTORING_LAYOUTS = ("bf16", "amx", "transposed")  # layouts whose PackedLinear holds a copy, not the weight itself


@dataclass(frozen=True)
class LlamaDtypes:
    compute: torch.dtype  # weights as loaded, activations
    kv: torch.dtype  # the KV cache's elements
    layout: str | None  # TargetModel.pack's layout (None: the modules stay as loaded)


def llama_dtypes(cfg: TargetConfig, dtype: str, device: str, pack: bool = True,
                 batch_invariant: bool = False) -> LlamaDtypes:
    """The loader's choices for --dtype `dtype` on `device` (load_llama follows them)."""
    kernels = pack and not batch_invariant and float32_kernels_run(device)
    compute = resolve_dtype(dtype, cfg.checkpoint_dtype, device, kernels)
    layout = kernel_layout(dtype, cfg.checkpoint_dtype, device) if pack else None
    if layout == "auto":
        layout = layout_for(device, compute)
    return LlamaDtypes(compute, kv_cache_dtype(dtype, cfg.checkpoint_dtype, compute, kernels), layout)


def llama_placement(config: dict, tp: TensorParallel, dtype: str, device: str) -> Placement:
    """This rank's tensors once load_llama(pack=True) has run: the loaded parameters, each layer's projections
    replaced by their fused packed products, and the lm_head's packed copy beside the embedding (tied) or the
    lm_head (untied). Loading holds every projection in the compute dtype before packing stores its copy."""
    cfg = TargetConfig.from_dict(config)
    chosen = llama_dtypes(cfg, dtype, device)
    with torch.device("meta"):
        model = TargetModel(cfg, tp).to(chosen.compute)
    model.kv_dtype = chosen.kv
    exact = cfg.checkpoint_dtype == "bfloat16"  # a bfloat16 checkpoint's values round-trip: kernel tiles hold them
    loaded: dict[str, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        add_bytes(loaded, tensor.dtype, tensor.numel() * tensor.itemsize)
    if chosen.layout is None:
        return Placement(model, chosen.compute, loaded, sum(loaded.values()))
    placed, packed = dict(loaded), 0
    products = [[layer.get_submodule(name).weight for name in group]
                for layer in model.model.layers for group in FUSED_GROUPS]
    head = model.lm_head_weight
    if chosen.layout in RESTORING_LAYOUTS:
        products.append([head])
    for weights in products:
        for weight in weights:
            if weight is not head:
                add_bytes(placed, weight.dtype, -weight.numel() * weight.itemsize)
        stored, size = packed_size(sum(w.shape[0] for w in weights), weights[0].shape[1], chosen.layout,
                                   chosen.compute, exact)
        add_bytes(placed, stored, size)
        packed += size
    if cfg.qk_norm:  # each layer's q and k norm weights side by side, one row per head
        local = model.local
        add_bytes(placed, chosen.compute, cfg.num_layers * (local.num_heads + local.num_kv_heads) * cfg.head_dim
                  * chosen.compute.itemsize)
    placed = {name: size for name, size in placed.items() if size}
    return Placement(model, chosen.compute, placed, sum(loaded.values()) + packed)
