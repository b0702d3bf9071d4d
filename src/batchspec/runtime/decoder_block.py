"""One pre-norm decoder block of a Llama / Qwen2 model: attention (`attention.py`), then the SwiGLU MLP.

Projections are fused on load: q, k and v into `wqkv`, gate and up into `w_gate_up`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchspec.runtime.attention import AttentionMetadata, attention
from batchspec.runtime.config import ModelConfig
from batchspec.runtime.layer_weights import LayerWeights


def mlp(h: torch.Tensor, layer: LayerWeights, lin: Callable[..., torch.Tensor]) -> torch.Tensor:
    """SwiGLU MLP of the normed packed tokens h (T, hidden): (T, hidden)."""
    gate, up = lin(h, layer.w_gate_up).chunk(2, dim=-1)  # (T, intermediate) each
    # Under MKL the float32 down projection keeps F.linear's operand order: its 1536-long reductions over the
    # large MLP activations of models like SmolLM2 are where the two orders' rounding differs most (measured:
    # max logit difference to transformers 1.1e-4 with the fast order here, 6e-5 without), for ~5 % speed.
    act = F.silu(gate) * up
    return lin(act, layer.w_down, reference_order=True)


def decoder_block(x: torch.Tensor, layer: LayerWeights, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  meta: AttentionMetadata, config: ModelConfig, lin: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The residual stream x (T, hidden) through one block: x + attention(norm(x)), then + mlp(norm(x)).

    cache_k, cache_v: this layer's (S, KV, max_len, D) cache, which gets the tokens' keys and values.
    lin: `linear.linear` bound to the model's backend, packed weights and batch invariance.
    """
    h = F.rms_norm(x, (config.hidden_size,), layer.attn_norm, config.rms_norm_eps)
    x = x + attention(h, layer, cache_k, cache_v, meta, config, lin, dtype=x.dtype)
    h = F.rms_norm(x, (config.hidden_size,), layer.mlp_norm, config.rms_norm_eps)
    return x + mlp(h, layer, lin)
