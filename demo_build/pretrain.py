"""Pretraining of the demo target (Qwen3 architecture) with a wall-clock budget, resumable."""

import math
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from shared.checkpoint_io import write_checkpoint
from shared.layers import normal_init
from shared.rope_settings import RopeSettings
from verify_worker.families.llama.config import TargetConfig
from verify_worker.families.llama.model import TargetModel


def demo_target_config(vocab_size: int, eos_id: int) -> TargetConfig:
    return TargetConfig(
        family="qwen3", vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope=RopeSettings(theta=10000.0), tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, max_position_embeddings=1024, checkpoint_dtype="bfloat16",
        eos_token_ids=(eos_id,),
    )


def lm_loss(model: TargetModel, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of batch [b, s+1]."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand(inputs.shape[0], -1)
    hidden = model(inputs, positions, None, None).hidden  # [b, s, hidden]
    logits = hidden @ model.lm_head_weight.T  # [b, s, vocab]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def random_windows(ids: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=generator)
    return torch.stack([ids[s: s + length + 1] for s in starts.tolist()])


def pretrain(train_ids: torch.Tensor, val_ids: torch.Tensor, cfg: TargetConfig, state_path: Path, minutes: float,
             batch: int = 16, length: int = 256, peak_lr: float = 2e-3, log=print) -> TargetModel:
    model = TargetModel(cfg)
    normal_init(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    elapsed, step = 0.0, 0
    generator = torch.Generator().manual_seed(1)
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        elapsed, step = state["elapsed"], state["step"]
        generator.set_state(state["generator"])
        log(f"resumed pretraining at step {step}, {elapsed / 60:.1f} of {minutes} minutes")
    budget = minutes * 60
    model.train()
    last_save = time.monotonic()
    while elapsed < budget:
        started = time.monotonic()
        frac = elapsed / budget
        lr = peak_lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, random_windows(train_ids, batch, length, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed += time.monotonic() - started
        if step % 20 == 0:
            log(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {batch * length / (time.monotonic() - started):.0f} "
                f"tok/s elapsed {elapsed / 60:.1f} min")
        if time.monotonic() - last_save > 300 or elapsed >= budget:
            val = validation_loss(model, val_ids, length)
            log(f"step {step} validation loss {val:.3f}")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "elapsed": elapsed,
                        "step": step, "generator": generator.get_state(), "val_loss": val}, state_path)
            last_save = time.monotonic()
            model.train()
    return model.eval()


@torch.no_grad()
def validation_loss(model: TargetModel, val_ids: torch.Tensor, length: int, batches: int = 8) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(123)
    losses = [lm_loss(model, random_windows(val_ids, 8, length, generator)).item() for _ in range(batches)]
    return sum(losses) / len(losses)


def export_target(model: TargetModel, cfg: TargetConfig, folder: Path) -> None:
    tensors = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items() if name != "lm_head.weight"}
    write_checkpoint(folder, cfg.to_dict(), tensors)
