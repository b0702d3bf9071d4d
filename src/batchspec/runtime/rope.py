"""Rotary position embeddings (RoPE) in Hugging Face's rotate-half layout, with Llama 3.1's and linear scaling."""

from __future__ import annotations

import math

import torch

from batchspec.runtime.config import ModelConfig, rope_type


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), computed exactly as transformers does so that logits agree to float precision."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_type(config.rope_scaling)
    scaling = config.rope_scaling or {}
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(config: ModelConfig, max_pos: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (P, D) of every position below `max_pos`, in `dtype` on `device` (computed in float32)."""
    inv_freq = rope_inv_freq(config)
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D), the rotate-half layout
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
