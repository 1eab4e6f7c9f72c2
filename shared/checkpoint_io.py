"""Reading and writing HF-layout checkpoint folders: config.json plus one or more *.safetensors files."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.errors import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {str(folder)!r}")
    return files


def tensor_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder, read from the headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if name in shapes:
                        raise CheckpointError(f"tensor {name!r} appears in more than one file of {str(folder)!r}")
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {str(path)!r}: {exc}") from None
    return shapes


def check_tensor_names(
    folder: str | Path,
    expected: dict[str, tuple[int, ...]],
    optional: frozenset[str] = frozenset(),
) -> dict[str, tuple[int, ...]]:
    """Strict check: every expected tensor present with its shape, nothing unexpected. Names the culprit."""
    found = tensor_shapes(folder)
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise CheckpointError(f"{str(folder)!r} is missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{str(folder)!r} has unexpected tensor(s): {', '.join(unexpected[:8])}")
    for name, shape in found.items():
        if tuple(expected[name]) != shape:
            raise CheckpointError(
                f"tensor {name!r} in {str(folder)!r} has shape {list(shape)}, expected {list(expected[name])}"
            )
    return found


def load_tensors(
    folder: str | Path, names: set[str] | None = None, dtype: torch.dtype | None = None, device="cpu"
) -> dict[str, torch.Tensor]:
    """Load (a subset of) the folder's tensors, cast to dtype and moved to device."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if names is not None and name not in names:
                    continue
                tensor = handle.get_tensor(name)
                out[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    return out


def load_tensor_slices(
    folder: str | Path, slices: dict, dtype: torch.dtype | None = None, device="cpu"
) -> dict[str, torch.Tensor]:
    """Load every tensor of the folder, reading only slices[name] (an object with dim, start, stop and
    padded) of the tensors it names: a tensor-parallel rank never holds another rank's part in memory."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                cut = slices.get(name)
                if cut is None:
                    tensor = handle.get_tensor(name)
                else:
                    view = handle.get_slice(name)
                    index = (slice(None),) * cut.dim + (slice(cut.start, cut.stop),)
                    tensor = view[index]
                    if cut.padded is not None and tensor.shape[cut.dim] < cut.padded:
                        pad = list(tensor.shape)
                        pad[cut.dim] = cut.padded - tensor.shape[cut.dim]
                        tensor = torch.cat([tensor, tensor.new_zeros(pad)], cut.dim)
                out[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    return out


def write_checkpoint(folder: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(contiguous, str(folder / "model.safetensors"), metadata={"format": "pt"})
