"""One decoder block's weights, as the runtime stores them (fused projections)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchspec.runtime.quantized import QuantizedWeight


@dataclass
class LayerWeights:
    """One block's weights. The four matrices may be in oneDNN's packed layout (`Transformer.pack_weights`) or
    weight-only int8 or int4 (`Transformer.quantize_weights`); `linear.dense` gives their values either way."""

    attn_norm: torch.Tensor  # (hidden,)
    wqkv: torch.Tensor | QuantizedWeight  # ((H + 2*KV) * D, hidden)
    bqkv: torch.Tensor | None  # ((H + 2*KV) * D,) — Qwen2 only
    wo: torch.Tensor | QuantizedWeight  # (hidden, H * D)
    mlp_norm: torch.Tensor  # (hidden,)
    w_gate_up: torch.Tensor | QuantizedWeight  # (2 * intermediate, hidden)
    w_down: torch.Tensor | QuantizedWeight  # (hidden, intermediate)

    MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")

    def map_matrices(self, fn) -> LayerWeights:
        """A copy with `fn` applied to each of the four matrices (the norms and bias shared)."""
        return replace(self, **{name: fn(getattr(self, name)) for name in self.MATRICES})
