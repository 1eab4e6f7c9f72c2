"""Rotary position embedding: the pure maths (the settings are shared.rope_settings)."""

import math

import torch

from shared.rope_settings import RopeSettings


def inverse_frequencies(settings: RopeSettings, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, float32 [head_dim // 2]."""
    inv_freq = 1.0 / (settings.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if settings.rope_type == "linear":
        return inv_freq / settings.factor
    if settings.rope_type == "llama3":
        old_len = settings.original_max_position_embeddings
        low_wavelen = old_len / settings.low_freq_factor
        high_wavelen = old_len / settings.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / settings.factor, inv_freq)
        smooth = (old_len / wavelen - settings.low_freq_factor) / (
            settings.high_freq_factor - settings.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / settings.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotary_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin tables for absolute positions [batch, seq] -> two tensors [batch, seq, head_dim]."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [batch, seq, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [batch, seq, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by cos/sin [batch, seq, head_dim]."""
    cos = cos[:, None]  # [batch, 1, seq, head_dim]
    sin = sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
