"""Loading and saving DFlash drafters in the published checkpoint layout."""

from pathlib import Path

import torch

from draft_worker.dflash2_model import DFlash2DraftModel
from draft_worker.draft_model import DFlashDraftModel
from shared.checkpoint_io import check_tensor_names, load_tensors, write_checkpoint
from shared.config_json import read_config
from shared.draft_config import DraftConfig
from shared.layers import normal_init
from shared.rope import inverse_frequencies


def drafter_class(cfg: DraftConfig) -> type[DFlashDraftModel]:
    """DFlashDraftModel or DFlash2DraftModel, as the config's architectures say."""
    return DFlash2DraftModel if cfg.dflash2 is not None else DFlashDraftModel


def load_drafter(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDraftModel:
    """A DFlash or DFlash 2 drafter, chosen by the checkpoint's config."""
    cfg = DraftConfig.from_dict(read_config(folder))
    check_tensor_names(folder, cfg.tensor_shapes())
    tensors = load_tensors(folder, dtype=dtype, device=device)
    with torch.device("meta"):
        model = drafter_class(cfg)(cfg)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(device)
    return model.eval().requires_grad_(False)


def save_drafter(model: DFlashDraftModel, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    tensors = {name: t.to(dtype or t.dtype) for name, t in model.state_dict().items()}
    config = model.config.to_dict()
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    write_checkpoint(folder, config, tensors)


def random_drafter(cfg: DraftConfig, seed: int = 0, std: float = 0.02) -> DFlashDraftModel:
    """A drafter with random weights (tests, the random demo pair); norms start at one, DFlash 2 convolutions
    at the identity plus the same noise."""
    model = drafter_class(cfg)(cfg)
    normal_init(model, seed, std)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("base_kernel"):
                param[:, 0] += 1.0
    return model.eval().requires_grad_(False)
