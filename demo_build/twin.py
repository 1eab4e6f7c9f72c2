"""A realistic-size twin of the demo pair: the demo target and its DFlash and DFlash 2 drafters widened and
deepened to a published shape (Qwen3-1.7B's, Qwen3-4B's), computing the demo's function up to rounding, so that
acceptance is the demo's and a step costs what the published model's does.

    python -m demo_build.twin --config benchmarks/published_configs/qwen3-1.7b.json --out /tmp/twin-1.7b \\
        [--demo models/demo] [--taps 5] [--draft-layers 5] [--max-position-embeddings N]

writes OUT/target (a Qwen3 checkpoint with the demo's tokenizer), OUT/draft and OUT/draft2 (the drafters in the
published layouts, conditioned on the twin's layers).

How the twin keeps the demo's function:
- Widths are zero-padded: hidden channels past the demo's, MLP rows, attention heads (an extra head's q, k, v rows
  and o columns are zero), vocabulary rows. Extra layers have zero o_proj and down_proj, so each adds exactly
  nothing to the residual; the demo's layers are spread evenly among them and the drafters' taps follow them.
- An RMSNorm over a padded width is rescaled by sqrt(demo width / twin width), so its real outputs are the demo's.
  Norm weights are stored in float32, so the rescaling is exact; the projections stay the demo's bfloat16 values.
- A wider head keeps the demo's rotary frequencies: the demo's dims i and i + d/2 sit at i and i + D/2 of the
  twin's head of D, and rope_theta is the demo's raised to D/d. The key norm carries sqrt(d/D), which makes the
  twin's 1/sqrt(D) attention scale give the demo's attention logits.
- Padded vocabulary rows must never win or be sampled: channel `demo hidden` of every real token's embedding
  holds a tiny marker (2^-16, too small to move any norm), the final norms weigh it by 2^20, and the padded rows
  of the (tied) head weigh it by -2^10, so their logits sit about -16384 / rms(final hidden) below zero.
"""

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.checkpoint_io import load_tensors, write_checkpoint
from shared.draft_config import default_target_layer_ids

MARKER = 2.0**-16  # the marker channel's value in every real token's embedding row
MARKER_GAIN = 2.0**20  # the final norms' weight on the marker channel
PAD_ROW_WEIGHT = -(2.0**10)  # a padded vocabulary row's weight on the marker channel
NORM_DTYPE = torch.float32


class TwinError(ValueError):
    """A published shape the demo pair cannot be widened to."""


@dataclass(frozen=True)
class Widths:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int

    @classmethod
    def of(cls, config: dict) -> "Widths":
        heads = config["num_attention_heads"]
        return cls(config["hidden_size"], config["intermediate_size"], heads,
                   config.get("num_key_value_heads", heads), config.get("head_dim", config["hidden_size"] // heads),
                   config["vocab_size"], config["num_hidden_layers"])

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def check_widths(demo: Widths, twin: Widths) -> None:
    """Raise TwinError naming the first width of `twin` too small to hold `demo`."""
    needs = [("hidden_size", twin.hidden, demo.hidden + 1, "the demo's plus the marker channel"),
             ("intermediate_size", twin.intermediate, demo.intermediate, "the demo's"),
             ("num_key_value_heads", twin.kv_heads, demo.kv_heads, "the demo's"),
             ("query heads per key head", twin.group, demo.group, "the demo's"),
             ("head_dim", twin.head_dim, demo.head_dim, "the demo's"),
             ("vocab_size", twin.vocab, demo.vocab, "the demo's"),
             ("num_hidden_layers", twin.layers, demo.layers, "the demo's")]
    for name, have, want, what in needs:
        if have < want:
            raise TwinError(f"{name} {have} is below {want} ({what}): choose a larger published shape")
    if twin.heads % twin.kv_heads or twin.head_dim % 2 or demo.head_dim % 2:
        raise TwinError("the twin's heads must be a multiple of its key heads, and head dims even")


def spread(count: int, slots: int) -> list[int]:
    """Indices of `count` items spread evenly over `slots`, first and last included."""
    if count == 1:
        return [0]
    return [round(k * (slots - 1) / (count - 1)) for k in range(count)]


def head_dim_index(demo_dim: int, twin_dim: int) -> torch.Tensor:
    """[demo_dim]: where each of a demo head's dims sits in a twin head (rotary halves kept apart)."""
    half = demo_dim // 2
    i = torch.arange(demo_dim)
    return torch.where(i < half, i, i - half + twin_dim // 2)


def head_rows(demo: Widths, twin: Widths, query: bool) -> torch.Tensor:
    """[heads * demo head_dim]: the twin row of each row of a demo q projection (query) or k / v projection.
    A demo query head keeps its place inside its key head's group."""
    count = demo.heads if query else demo.kv_heads
    h = torch.arange(count)
    twin_head = (h // demo.group) * twin.group + h % demo.group if query else h
    return (twin_head[:, None] * twin.head_dim + head_dim_index(demo.head_dim, twin.head_dim)[None]).reshape(-1)


def place(shape, source: torch.Tensor, rows: torch.Tensor | None = None,
          cols: torch.Tensor | None = None) -> torch.Tensor:
    """A zero tensor of `shape` (and source's dtype) holding source [r, c] at rows x cols (default: the first)."""
    out = source.new_zeros(shape)
    rows = torch.arange(source.shape[0]) if rows is None else rows
    if source.dim() == 1:
        out[rows] = source
        return out
    cols = torch.arange(source.shape[1]) if cols is None else cols
    out[rows[:, None], cols[None, :]] = source
    return out


def hidden_norm(weight: torch.Tensor, twin_hidden: int, marker_gain: float = 0.0) -> torch.Tensor:
    """An RMSNorm weight over the demo's hidden width, for the twin's: rescaled real channels, zero padding, and
    `marker_gain` on the marker channel (the final norms)."""
    demo_hidden = weight.shape[0]
    out = torch.zeros(twin_hidden, dtype=NORM_DTYPE)
    out[:demo_hidden] = weight.to(NORM_DTYPE) * math.sqrt(demo_hidden / twin_hidden)
    out[demo_hidden] = marker_gain
    return out


def head_norm(weight: torch.Tensor, twin_dim: int, scale: float) -> torch.Tensor:
    """A q_norm / k_norm weight [demo head_dim] for the twin's head: the demo's values at their dims, times scale."""
    out = torch.zeros(twin_dim, dtype=NORM_DTYPE)
    out[head_dim_index(weight.shape[0], twin_dim)] = weight.to(NORM_DTYPE) * scale
    return out


def widen_conv(layer: dict, name: str, demo: Widths, twin: Widths) -> dict:
    """A DFlash 2 dynamic convolution: the demo's taps on its channels, the identity on the padding; the kernel
    projection's rows [tap set, offset, group] keep the demo's groups first."""
    base = layer[f"{name}.base_kernel"]  # [2, kernel, demo hidden]
    projection = layer[f"{name}.kernel_projection.weight"]  # [2 * kernel * demo groups, demo hidden]
    sets, kernel, _ = base.shape
    groups = projection.shape[0] // (sets * kernel)
    group_size = demo.hidden // groups
    if twin.hidden % group_size:
        raise TwinError(f"hidden_size {twin.hidden} is not a multiple of the convolution's group of {group_size}")
    twin_base = torch.zeros(sets, kernel, twin.hidden, dtype=base.dtype)
    twin_base[:, 0] = 1.0
    twin_base[:, :, :demo.hidden] = base
    twin_groups = twin.hidden // group_size
    twin_projection = projection.new_zeros(sets, kernel, twin_groups, twin.hidden)
    twin_projection[:, :, :groups, :demo.hidden] = projection.view(sets, kernel, groups, demo.hidden)
    return {f"{name}.base_kernel": twin_base,
            f"{name}.kernel_projection.weight": twin_projection.view(-1, twin.hidden)}


def widen_layer(layer: dict, demo: Widths, twin: Widths) -> dict:
    """A demo decoder layer's tensors (names from input_layernorm.weight on) at the twin's widths."""
    q_rows, kv_rows = head_rows(demo, twin, True), head_rows(demo, twin, False)
    q_out, kv_out = twin.heads * twin.head_dim, twin.kv_heads * twin.head_dim
    h, i = twin.hidden, twin.intermediate
    out = {
        "input_layernorm.weight": hidden_norm(layer["input_layernorm.weight"], h),
        "post_attention_layernorm.weight": hidden_norm(layer["post_attention_layernorm.weight"], h),
        "self_attn.q_proj.weight": place((q_out, h), layer["self_attn.q_proj.weight"], q_rows),
        "self_attn.k_proj.weight": place((kv_out, h), layer["self_attn.k_proj.weight"], kv_rows),
        "self_attn.v_proj.weight": place((kv_out, h), layer["self_attn.v_proj.weight"], kv_rows),
        "self_attn.o_proj.weight": place((h, q_out), layer["self_attn.o_proj.weight"], None, q_rows),
        "self_attn.q_norm.weight": head_norm(layer["self_attn.q_norm.weight"], twin.head_dim, 1.0),
        "self_attn.k_norm.weight": head_norm(layer["self_attn.k_norm.weight"], twin.head_dim,
                                             math.sqrt(demo.head_dim / twin.head_dim)),
        "mlp.gate_proj.weight": place((i, h), layer["mlp.gate_proj.weight"]),
        "mlp.up_proj.weight": place((i, h), layer["mlp.up_proj.weight"]),
        "mlp.down_proj.weight": place((h, i), layer["mlp.down_proj.weight"]),
    }
    for conv in ("attention_conv", "mlp_conv"):
        if f"{conv}.base_kernel" in layer:
            out.update(widen_conv(layer, conv, demo, twin))
    return out


def identity_layer(like: dict) -> dict:
    """A layer shaped as `like` (a widened layer) that adds nothing: zero projections, unit norms, identity
    convolutions."""
    out = {}
    for name, tensor in like.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones_like(tensor)
        elif name.endswith("base_kernel"):
            out[name] = torch.zeros_like(tensor)
            out[name][:, 0] = 1.0
        else:
            out[name] = torch.zeros_like(tensor)
    return out


def layer_tensors(tensors: dict, prefix: str) -> dict:
    return {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}


def vocab_rows(weight: torch.Tensor, twin: Widths) -> torch.Tensor:
    """An embedding or head [demo vocab, demo hidden] at [twin vocab, twin hidden], with the marker channel."""
    demo_vocab, demo_hidden = weight.shape
    out = place((twin.vocab, twin.hidden), weight)
    out[:demo_vocab, demo_hidden] = MARKER
    out[demo_vocab:, demo_hidden] = PAD_ROW_WEIGHT
    return out


def widen_target(tensors: dict, demo: Widths, twin: Widths) -> tuple[dict, list[int]]:
    """The twin target's tensors (HF names) and where each demo layer went."""
    check_widths(demo, twin)
    where = spread(demo.layers, twin.layers)
    out = {"model.embed_tokens.weight": vocab_rows(tensors["model.embed_tokens.weight"], twin),
           "model.norm.weight": hidden_norm(tensors["model.norm.weight"], twin.hidden, MARKER_GAIN)}
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = vocab_rows(tensors["lm_head.weight"], twin)
    widened = {k: widen_layer(layer_tensors(tensors, f"model.layers.{k}."), demo, twin) for k in range(demo.layers)}
    source = dict(zip(where, widened.values()))
    for index in range(twin.layers):
        layer = source[index] if index in source else identity_layer(widened[0])
        for name, t in layer.items():
            out[f"model.layers.{index}.{name}"] = t
    return out, where


def twin_taps(demo_taps: list[int], where: list[int], twin_layers: int, count: int) -> list[int]:
    """The twin drafter's taps: the demo's taps at their layers' new places, then the published default rule's
    taps (and any other layer) up to `count`, in layer order."""
    taps = [where[t] for t in demo_taps]
    if count < len(taps):
        raise TwinError(f"--taps {count} is below the demo drafter's {len(taps)} taps")
    for candidate in [*default_target_layer_ids(twin_layers, count), *range(twin_layers)]:
        if len(taps) == count:
            break
        if candidate not in taps:
            taps.append(candidate)
    return sorted(taps)


def widen_drafter(tensors: dict, config: dict, demo: Widths, twin: Widths, where: list[int], taps: int,
                  layers: int, max_positions: int) -> tuple[dict, dict]:
    """A demo drafter's (tensors, config.json) conditioned on the twin target: the demo's layers first, identity
    layers up to `layers`, `taps` tapped twin layers (the demo's among them)."""
    dflash = dict(config["dflash_config"])
    demo_taps = list(dflash["target_layer_ids"])
    new_taps = twin_taps(demo_taps, where, twin.layers, taps)
    demo_layers = config["num_hidden_layers"]
    if layers < demo_layers:
        raise TwinError(f"--draft-layers {layers} is below the demo drafter's {demo_layers} layers")
    h = twin.hidden
    fc = tensors["fc.weight"]  # [demo hidden, demo taps * demo hidden]
    twin_fc = fc.new_zeros(h, len(new_taps) * h)
    for slot, tap in enumerate(demo_taps):
        column = new_taps.index(where[tap]) * h
        twin_fc[:demo.hidden, column:column + demo.hidden] = fc[:, slot * demo.hidden:(slot + 1) * demo.hidden]
    out = {"fc.weight": twin_fc, "hidden_norm.weight": hidden_norm(tensors["hidden_norm.weight"], h),
           "norm.weight": hidden_norm(tensors["norm.weight"], h, MARKER_GAIN)}
    widened = [widen_layer(layer_tensors(tensors, f"layers.{k}."), demo, twin) for k in range(demo_layers)]
    widened += [identity_layer(widened[0]) for _ in range(layers - demo_layers)]
    for index, layer in enumerate(widened):
        out.update({f"layers.{index}.{name}": t for name, t in layer.items()})
    if "candidate_selector.hidden_projection.weight" in tensors:
        projection = tensors["candidate_selector.hidden_projection.weight"]  # [rank, demo hidden]
        out["candidate_selector.hidden_projection.weight"] = place((projection.shape[0], h), projection)
        for name in ("predecessor_codebook", "successor_codebook"):
            book = tensors[f"candidate_selector.{name}"]  # [demo vocab, rank]
            out[f"candidate_selector.{name}"] = place((twin.vocab, book.shape[1]), book)
    dflash["target_layer_ids"] = new_taps
    twin_config = dict(config, hidden_size=h, intermediate_size=twin.intermediate, num_hidden_layers=layers,
                       num_attention_heads=twin.heads, num_key_value_heads=twin.kv_heads, head_dim=twin.head_dim,
                       rope_theta=widened_theta(config["rope_theta"], demo, twin), vocab_size=twin.vocab,
                       layer_types=["full_attention"] * layers, num_target_layers=twin.layers,
                       max_position_embeddings=max_positions, dflash_config=dflash)
    return out, twin_config


def widened_theta(theta: float, demo: Widths, twin: Widths) -> float:
    """rope_theta for the twin's head_dim with the demo's frequencies: theta ** (D / d)."""
    return float(theta) ** (twin.head_dim / demo.head_dim)


def twin_target_config(demo_config: dict, published: dict, max_positions: int) -> dict:
    """The twin target's config.json: the demo's (tokens, norms' eps, tied head), the published widths."""
    demo, twin = Widths.of(demo_config), Widths.of(published)
    return dict(demo_config, hidden_size=twin.hidden, intermediate_size=twin.intermediate,
                num_hidden_layers=twin.layers, num_attention_heads=twin.heads, num_key_value_heads=twin.kv_heads,
                head_dim=twin.head_dim, vocab_size=twin.vocab, max_position_embeddings=max_positions,
                rope_theta=widened_theta(demo_config["rope_theta"], demo, twin))


def write_twin(demo_dir: Path, published: dict, out: Path, taps: int, draft_layers: int,
               max_positions: int | None = None) -> dict:
    """Write OUT/target, OUT/draft and OUT/draft2 (those of the demo's drafters that exist). Returns a summary."""
    demo_config = json.loads((demo_dir / "target" / "config.json").read_text())
    positions = max_positions or demo_config["max_position_embeddings"]
    demo, twin = Widths.of(demo_config), Widths.of(published)
    tensors, where = widen_target(load_tensors(demo_dir / "target"), demo, twin)
    write_checkpoint(out / "target", twin_target_config(demo_config, published, positions), tensors)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (demo_dir / "target" / name).is_file():
            shutil.copy(demo_dir / "target" / name, out / "target" / name)
    summary = {"target": parameters(tensors), "layers": where, "drafters": {}}
    del tensors
    for name in ("draft", "draft2"):
        folder = demo_dir / name
        if not (folder / "config.json").is_file():
            continue
        config = json.loads((folder / "config.json").read_text())
        drafter, drafter_config = widen_drafter(load_tensors(folder), config, demo, twin, where, taps, draft_layers,
                                                positions)
        write_checkpoint(out / name, drafter_config, drafter)
        summary["drafters"][name] = {"parameters": parameters(drafter),
                                     "taps": drafter_config["dflash_config"]["target_layer_ids"]}
    return summary


def parameters(tensors: dict) -> int:
    return sum(t.numel() for t in tensors.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_build.twin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a published Qwen3 / Llama config.json (its widths)")
    parser.add_argument("--out", required=True, help="the folder to write (target/, draft/, draft2/)")
    parser.add_argument("--demo", default="models/demo", help="the demo pair to widen")
    parser.add_argument("--taps", type=int, default=5,
                        help="target layers each drafter reads (the demo's, then the published default rule's)")
    parser.add_argument("--draft-layers", type=int, default=5,
                        help="drafter layers (the demo's, then layers that add nothing)")
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="the twin's context (default: the demo's, the positions it was trained on)")
    args = parser.parse_args(argv)
    try:
        published = json.loads(Path(args.config).read_text())
        summary = write_twin(Path(args.demo), published, Path(args.out), args.taps, args.draft_layers,
                             args.max_position_embeddings)
    except (TwinError, OSError, KeyError, json.JSONDecodeError) as error:
        print(f"python -m demo_build.twin: {error}", file=sys.stderr)
        return 2
    drafters = ", ".join(f"{name} {d['parameters'] / 1e9:.2f}B (taps {d['taps']})"
                         for name, d in summary["drafters"].items())
    print(f"{args.out}: target {summary['target'] / 1e9:.2f}B parameters, the demo's layers at {summary['layers']}; "
          f"drafters: {drafters}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
