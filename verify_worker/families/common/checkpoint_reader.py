"""Reading a checkpoint into a family's model (built on the meta device): renames, skipped parts (vision towers, MTP
layers), this rank's slices, per-expert tensors stacked, FP8 block weights kept FP8 where the model can multiply
them so and dequantized otherwise. Every name and shape is checked against the model's table from the files'
headers before a tensor is read; then each tensor is read on its own and copied straight into its place on the
device (host memory holds one tensor at a time, never the model), with a progress line. The GLM families' loaders
are built from this."""

import logging
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from shared.checkpoint_io import safetensors_files
from shared.errors import CheckpointError
from verify_worker.families.common.config_parts import Fp8Settings
from verify_worker.families.common.fp8_blocks import dequantize, scale_grid
from verify_worker.families.common.fp8_layout import published_names
from verify_worker.families.common.fp8_weights import FP8, SCALE_SUFFIX, fp8_capable, keep_fp8
from verify_worker.families.common.slices import Slice, whole_blocks

SCALE = ".weight_scale_inv"
LAYER = re.compile(r"model\.layers\.(\d+)\.")
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
REMAP_BYTES = 1 << 28  # files are reopened after this many bytes read (their mapped pages leave host memory)
PROGRESS_STEPS = 10  # progress lines per load


@dataclass(frozen=True)
class Stored:
    """One tensor in a checkpoint file (and, for FP8 blocks, its scales)."""
    path: Path
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name (BF16, F8_E4M3...)
    scale: "Stored | None" = None


@dataclass(frozen=True)
class Part:
    """What one stored tensor fills: the rank's cut of it, into `target` at `slot` (stacked experts)."""
    stored: Stored
    cut: Slice | None
    target: str
    slot: tuple = ()
    scale_slot: tuple = ()


def load_checkpoint(model: torch.nn.Module, folder: str | Path, rename: Callable[[str], str | None],
                    num_layers: int, plan: dict[str, Slice], fp8: Fp8Settings | None, device,
                    compute: torch.dtype, float32_kept: tuple[str, ...], log: logging.Logger) -> torch.nn.Module:
    """Fill `model` (on the meta device) from the checkpoint in `folder`. rename maps a checkpoint name to ours (None:
    a part the verify worker does not use); layers past num_layers (MTP) are skipped; plan names the slices this rank
    reads (of our names). FP8 weights (with a `weight_scale_inv`) stay FP8 where the model's module can keep them
    (fp8_weights.fp8_capable) and the ranks' slices are whole blocks; the others are dequantized to the
    compute dtype. Tensors land in `compute` (float32 for names ending in float32_kept), each in a fresh
    allocation: a GEMM's roundings depend on its operands' alignment. Where the checkpoint keeps other weights FP8
    than a published one would (what the memory plan counted), the log says so."""
    started = time.monotonic()
    fp8_block = fp8.block if fp8 is not None else None
    stored = index_checkpoint(folder, rename, num_layers, fp8_block, log)
    parts = plan_parts(stored, plan, model, fp8_block)
    capable = fp8_capable(model)
    kept = kept_fp8(parts, capable, fp8_block)
    if fp8 is not None:
        planned = set(published_names(model, fp8, plan))
        if planned != set(kept):
            more, fewer = sorted(set(kept) - planned), sorted(planned - set(kept))
            log.warning("the memory plan counted the FP8 weights of a published checkpoint; this one keeps %d more "
                        "(e.g. %s) and %d fewer (e.g. %s) FP8", len(more), more[:1], len(fewer), fewer[:1])
    for name in kept:
        module, attribute = capable[name]
        keep_fp8(module, attribute, fp8_block)
    table = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    check_names(folder, parts, kept, table)
    state = {name: torch.empty(shape, dtype=final_dtype(name, dtype, compute, float32_kept), device=device)
             for name, (shape, dtype) in table.items()}
    check_shapes(folder, parts, kept, state)
    total = sum(part_bytes(part) for part in parts)
    reader, done, next_line = Reader(), 0, 1
    for part in parts:
        fill(reader, part, part.target in kept, state, fp8_block)
        done += part_bytes(part)
        if done * PROGRESS_STEPS >= next_line * total:
            log.info("loading %s: %.2f / %.2f GiB read (%d%%), %.0f s", folder, done / 2**30, total / 2**30,
                     100 * done // max(total, 1), time.monotonic() - started)
            next_line = done * PROGRESS_STEPS // max(total, 1) + 1
    model.load_state_dict(state, strict=True, assign=True)
    dequantized = len({p.target for p in parts if p.stored.scale is not None} - set(kept))
    log.info("loaded %s in %.1f s: %d tensor(s) kept FP8, %d FP8 tensor(s) dequantized; peak host memory of the "
             "process %.2f GiB", folder, time.monotonic() - started, len(kept), dequantized, peak_host_bytes() / 2**30)
    return model


def index_checkpoint(folder, rename, num_layers: int, fp8_block, log) -> dict[str, Stored]:
    """Our name -> the stored tensor (headers only: nothing is read)."""
    found, scales, unused, mtp, skipped = {}, {}, [], set(), set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                entry = Stored(path, name, tuple(view.get_shape()), view.get_dtype())
                if name.endswith(SCALE):
                    scales[name[: -len(SCALE)] + ".weight"] = entry
                    continue
                ours = rename(name)
                layer = LAYER.match(ours or "")
                if ours is None:
                    unused.append(name)
                    skipped.add(name)
                elif layer and int(layer.group(1)) >= num_layers:
                    mtp.add(int(layer.group(1)))
                    skipped.add(name)
                else:
                    found[name] = (ours, entry)
    if unused:
        log.info("skipping %d tensor(s) the verify worker does not use (e.g. %s)", len(unused), unused[0])
    if mtp:
        log.info("skipping the multi-token-prediction layer(s) %s (not used for verification)", sorted(mtp))
    if scales and fp8_block is None:
        raise CheckpointError(f"{str(folder)!r} has FP8 scales ({next(iter(scales.values())).name}) but its "
                              "config.json has no quantization_config")
    out = {}
    for name, (ours, entry) in found.items():
        scale = scales.get(name)
        if scale is not None and entry.dtype != "F8_E4M3":
            raise CheckpointError(f"{name} has a weight_scale_inv but is {entry.dtype}, not F8_E4M3 (quant_method "
                                  f"fp8 stores e4m3 blocks)")
        if scale is not None:
            grid = scale_grid(entry.shape, fp8_block) if len(entry.shape) == 2 else None
            if scale.shape != grid:
                raise CheckpointError(f"{name}: scale grid {list(scale.shape)} does not fit a {list(entry.shape)} "
                                      f"weight in blocks of {list(fp8_block)} (expected "
                                      f"{list(grid) if grid else 'a 2-D weight'})")
            entry = Stored(entry.path, entry.name, entry.shape, entry.dtype, scale)
        elif entry.dtype.startswith("F8"):
            raise CheckpointError(f"{str(folder)!r}: FP8 tensor {name} has no weight_scale_inv")
        out[ours] = entry
    orphans = [scale.name for weight, scale in scales.items() if weight not in found and weight not in skipped]
    if orphans:
        raise CheckpointError(f"{str(folder)!r} has {orphans[0]} but no {orphans[0][: -len(SCALE)]}.weight")
    return out


def plan_parts(stored: dict[str, Stored], plan: dict[str, Slice], model, block: tuple[int, int] | None) -> list[Part]:
    """Every stored tensor's place in the model, in file order; per-expert tensors go to their expert's slot of the
    stacks experts.gate_up_proj [E, 2I, H] (gate then up) and experts.down_proj [E, H, I], as transformers stacks
    them (I: the model's own width, so a mis-shaped expert is caught by the shape checks)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    widths = {name: shape[-1] for name, shape in shapes.items() if name.endswith(".down_proj")}
    parts, experts = [], {}
    for ours, entry in sorted(stored.items(), key=lambda item: (str(item[1].path), item[1].name)):
        cut = plan.get(ours)
        match = EXPERT.fullmatch(ours)
        if match is None:
            parts.append(Part(entry, cut, ours))
            continue
        prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, set()).add((expert, kind))
        if kind == "down":
            parts.append(Part(entry, cut, prefix + ".down_proj", (expert,), (expert,)))
            continue
        inner = widths.get(prefix + ".down_proj", 0)
        first = 0 if kind == "gate" else inner
        rows = (first // block[0], -(-(first + inner) // block[0])) if entry.scale else (0, 0)  # kept: whole blocks
        parts.append(Part(entry, cut, prefix + ".gate_up_proj", (expert, slice(first, first + inner)),
                          (expert, slice(*rows))))
    for prefix, found in experts.items():
        count = shapes.get(prefix + ".down_proj", (0,))[0]
        missing = [f"{prefix}.{e}.{kind}_proj.weight" for e in range(count) for kind in ("gate", "up", "down")
                   if (e, kind) not in found]
        if missing:
            raise CheckpointError(f"missing tensor(s): {', '.join(missing[:8])}")
        extra = sorted({e for e, _ in found} - set(range(count)))
        if extra:
            raise CheckpointError(f"unexpected tensor(s): {prefix}.{extra[0]}.*")
    return parts


def kept_fp8(parts: list[Part], capable: dict, block: tuple[int, int] | None) -> list[str]:
    """The model tensors that stay FP8: every part of them FP8 blocks, the module able to keep them, the ranks'
    slices whole blocks (aligned_cut; a stacked gate|up needs whole row blocks per expert half, else its scale
    grids do not concatenate)."""
    by_target: dict[str, list[Part]] = {}
    for part in parts:
        by_target.setdefault(part.target, []).append(part)
    kept = []
    for target, group in by_target.items():
        if target not in capable or any(p.stored.scale is None for p in group):
            continue
        if all(aligned_cut(p, block) for p in group):
            kept.append(target)
    return kept


def aligned_cut(part: Part, block: tuple[int, int]) -> bool:
    """Whole blocks on every rank: a cut of a whole number of blocks (then every rank's starts on a boundary, and
    every rank decides alike, as the memory plan assumes)."""
    slot = part.slot
    if not whole_blocks(part.cut, block):
        return False
    if len(slot) == 2:  # a gate|up half: it must start and end on row blocks
        return slot[1].start % block[0] == 0 and slot[1].stop % block[0] == 0
    return True


def check_names(folder, parts: list[Part], kept: list[str], table: dict) -> None:
    provided = {p.target for p in parts} | {name + SCALE_SUFFIX for name in kept}
    missing, unexpected = sorted(set(table) - provided), sorted(provided - set(table))
    if missing:
        raise CheckpointError(f"{str(folder)!r} is missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{str(folder)!r} has unexpected tensor(s): {', '.join(unexpected[:8])}")


def check_shapes(folder, parts: list[Part], kept: list[str], state: dict[str, torch.Tensor]) -> None:
    for part in parts:
        cut = part.cut
        if cut is not None and cut.whole is not None and part.stored.shape[cut.dim] != cut.whole:
            raise CheckpointError(f"tensor {part.stored.name!r} in {str(folder)!r} has shape "
                                  f"{list(part.stored.shape)}: {cut.whole} along dimension {cut.dim} expected")
        local = local_shape(part)
        want = tuple(state[part.target][part.slot].shape)
        if local != want:
            name = part.target if not part.slot else part.stored.name
            raise CheckpointError(f"tensor {name!r} in {str(folder)!r} has shape {list(local)}, expected "
                                  f"{list(want)}")


def local_shape(part: Part) -> tuple[int, ...]:
    shape, cut = list(part.stored.shape), part.cut
    if cut is not None:
        shape[cut.dim] = cut.padded or cut.stop - cut.start
    return tuple(shape)


def final_dtype(name: str, table_dtype: torch.dtype, compute: torch.dtype, float32_kept) -> torch.dtype:
    if table_dtype == FP8 or name.endswith(SCALE_SUFFIX):
        return table_dtype
    return torch.float32 if name.endswith(float32_kept) else compute


ELEMENT_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "I16": 2, "F32": 4,
                 "I32": 4, "F64": 8, "I64": 8}


def part_bytes(part: Part) -> int:
    size = ELEMENT_BYTES.get(part.stored.dtype, 4)
    count = 1
    for n in local_shape(part):
        count *= n
    return count * size


class Reader:
    """Open checkpoint files, dropped (and their mappings with them) after every REMAP_BYTES read."""

    def __init__(self):
        self.handles, self.read = {}, 0

    def handle(self, path: Path):
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt")
        return self.handles[path]

    def count(self, tensor: torch.Tensor) -> None:
        self.read += tensor.numel() * tensor.element_size()
        if self.read >= REMAP_BYTES:
            self.handles, self.read = {}, 0


def fill(reader: Reader, part: Part, keep: bool, state: dict[str, torch.Tensor], block) -> None:
    """Read one stored tensor (its cut) and copy it into its place: kept FP8 with its scales, dequantized, or cast."""
    entry = part.stored
    tensor = read_slice(reader.handle(entry.path), entry.name, part.cut)
    reader.count(tensor)
    if entry.scale is not None:
        scale = read_scale(reader.handle(entry.scale.path), entry.scale.name, part.cut, block)
        if keep:
            state[part.target + SCALE_SUFFIX][part.scale_slot].copy_(scale)
        else:
            offset = (0, 0) if part.cut is None else (part.cut.start, 0) if part.cut.dim == 0 else (0, part.cut.start)
            tensor = dequantize(tensor, scale, block, entry.name, offset)
    state[part.target][part.slot].copy_(tensor)


def read_slice(handle, name: str, cut: Slice | None) -> torch.Tensor:
    if cut is None:
        return handle.get_tensor(name)
    tensor = handle.get_slice(name)[(slice(None),) * cut.dim + (slice(cut.start, cut.stop),)]
    if cut.padded is not None and tensor.shape[cut.dim] < cut.padded:
        pad = list(tensor.shape)
        pad[cut.dim] = cut.padded - tensor.shape[cut.dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], cut.dim)
    return tensor


def read_scale(handle, name: str, cut: Slice | None, block: tuple[int, int]) -> torch.Tensor:
    """The scales of the blocks that cover the cut (all of them without one)."""
    if cut is None:
        return handle.get_tensor(name)
    first, last = cut.start // block[cut.dim], -(-cut.stop // block[cut.dim])
    return handle.get_slice(name)[(slice(None),) * cut.dim + (slice(first, last),)]


def peak_host_bytes() -> int:
    """The process's peak resident memory so far: Linux's VmHWM (getrusage's maxrss would count a parent's memory
    at the fork), else getrusage's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
