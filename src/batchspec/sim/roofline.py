"""Analytic roofline cost models for target sizes one CPU cannot run: 70B / 405B Llama targets on 8 GPUs with a
Llama-3.2-1B draft, every constant with its source or marked as an assumption."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchspec.errors import BatchspecError
from batchspec.sim.linear_cost import from_dict


# ---------------------------------------------------------------------------------------------------------------
# Analytic roofline models: 70B / 405B Llama targets on 8 GPUs, Llama-3.2-1B draft
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float  # memory bandwidth
    bf16_flops_per_s: float  # dense tensor-core peak
    fp8_flops_per_s: float
    link_bytes_per_s: float  # GPU-to-GPU, one direction


# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): 3.35 TB/s HBM3; BF16 1,979 TFLOPS and FP8 3,958 TFLOPS
# "with sparsity", i.e. 989 / 1,979 TFLOPS dense; NVLink 900 GB/s total bandwidth = 450 GB/s each direction.
H100_SXM = Gpu("H100 SXM 80GB", hbm_bytes_per_s=3.35e12, bf16_flops_per_s=989e12, fp8_flops_per_s=1979e12,
               link_bytes_per_s=450e9)


@dataclass(frozen=True)
class LlamaShape:
    """Architecture numbers from each model's config.json on the Hugging Face Hub (meta-llama/...)."""

    name: str
    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    weight_bytes: float  # bytes per parameter as served: 2 (bf16) or 1 (fp8)

    @property
    def matmul_params(self) -> float:
        """Parameters read and multiplied per token: attention + MLP of every layer, plus the LM head."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.heads * head_dim + 2 * self.hidden * self.kv_heads * head_dim
        return self.layers * (attention + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * 2  # K and V, bf16 cache


LLAMA_31_70B = LlamaShape("Llama-3.1-70B bf16", 80, 8192, 64, 8, 28672, 128256, weight_bytes=2)
# bf16 405B (811 GB) does not fit 8 x 80 GB; Meta ships Llama-3.1-405B-Instruct-FP8 for one 8xH100 node.
LLAMA_31_405B_FP8 = LlamaShape("Llama-3.1-405B fp8", 126, 16384, 128, 8, 53248, 128256, weight_bytes=1)
LLAMA_32_1B = LlamaShape("Llama-3.2-1B bf16", 16, 2048, 32, 8, 8192, 128256, weight_bytes=2)


@dataclass(frozen=True)
class RooflineCostModel:
    """forward = overhead + max(bytes / bandwidth, FLOPs / peak) + tensor-parallel all-reduces.

    Bytes: all matmul weights once per forward plus the KV cache read; FLOPs: 2 per weight per token plus attention.
    The efficiencies and overheads are assumptions (no source can give them for every stack); edit them through
    `--save-cost-model` + `--cost-model FILE`.
    """

    name: str
    gpu: Gpu
    target: LlamaShape
    draft: LlamaShape
    target_gpus: int = 8  # tensor parallel over the node
    draft_gpus: int = 1  # a 1B draft fits one GPU; tensor parallelism would only add all-reduces
    bandwidth_efficiency: float = 0.8  # assumption: achieved / peak HBM bandwidth of large weight reads
    flops_efficiency: float = 0.6  # assumption: achieved / peak tensor-core FLOPs of large GEMMs
    target_forward_overhead_s: float = 1e-3  # assumption: launch, scheduling and sampling per target forward
    draft_forward_overhead_s: float = 2e-4  # assumption: CUDA-graph replay of a small model
    allreduce_latency_s: float = 8e-6  # assumption: one small NVLink all-reduce
    select_s_per_step: float = 5e-5  # Tetris top-C at B=64, K'=8 as measured on CPU here (README); GPU similar
    step_overhead_s: float = 5e-4  # assumption: per-step bookkeeping outside the forwards
    kind: str = "roofline"

    def _forward_s(self, shape: LlamaShape, gpus: int, batch: int, tokens: int, context: int, overhead: float) -> float:
        head_dim = shape.hidden // shape.heads
        memory_bytes = shape.matmul_params * shape.weight_bytes + (context + tokens) * shape.kv_bytes_per_token
        attention_flops = 4 * shape.layers * shape.heads * head_dim * tokens * (context / max(batch, 1))
        flops = 2 * shape.matmul_params * tokens + attention_flops
        peak = self.gpu.fp8_flops_per_s if shape.weight_bytes == 1 else self.gpu.bf16_flops_per_s
        memory_s = memory_bytes / (gpus * self.gpu.hbm_bytes_per_s * self.bandwidth_efficiency)
        compute_s = flops / (gpus * peak * self.flops_efficiency)
        allreduce_s = 0.0
        if gpus > 1:  # two all-reduces per layer (after attention and MLP), ring: 2 (g-1)/g of the bf16 activations
            ring = 2 * (gpus - 1) / gpus * tokens * shape.hidden * 2 / self.gpu.link_bytes_per_s
            allreduce_s = 2 * shape.layers * (self.allreduce_latency_s + ring)
        return overhead + max(memory_s, compute_s) + allreduce_s

    def target_s(self, batch: int, tokens: int, context: int) -> float:
        return self._forward_s(self.target, self.target_gpus, batch, tokens, context, self.target_forward_overhead_s)

    def draft_s(self, batch: int, context: int) -> float:
        return self._forward_s(self.draft, self.draft_gpus, batch, batch, context, self.draft_forward_overhead_s)

    def prefill_s(self, tokens: int, requests: int) -> tuple[float, float]:
        """All admitted prompts in one forward; attention as if each prompt had the mean length."""
        return (self._forward_s(self.target, self.target_gpus, requests, tokens, tokens,
                                self.target_forward_overhead_s),
                self._forward_s(self.draft, self.draft_gpus, requests, tokens, tokens, self.draft_forward_overhead_s))

    def select_s(self, sorts: bool) -> float:
        return self.select_s_per_step if sorts else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str) -> RooflineCostModel:
        parts = {"gpu": Gpu, "target": LlamaShape, "draft": LlamaShape}
        nested = {}
        for key, part in parts.items():
            if not isinstance(data.get(key), dict):
                raise BatchspecError(f"{where}: {key} must be a JSON object with fields "
                                     f"{', '.join(f.name for f in dataclasses.fields(part))}")
            nested[key] = from_dict(part, data[key], f"{where}: {key}")
        flat = from_dict(cls, {**{k: v for k, v in data.items() if k not in parts}, **{k: 0 for k in parts}}, where)
        model = dataclasses.replace(flat, **nested)
        if not (0 < model.bandwidth_efficiency <= 1 and 0 < model.flops_efficiency <= 1):
            raise BatchspecError(f"{where}: bandwidth_efficiency and flops_efficiency must be in (0, 1]")
        if model.target_gpus < 1 or model.draft_gpus < 1 or min(
                model.gpu.hbm_bytes_per_s, model.gpu.bf16_flops_per_s, model.gpu.fp8_flops_per_s,
                model.gpu.link_bytes_per_s) <= 0:
            raise BatchspecError(f"{where}: GPU counts, bandwidths and FLOP rates must be positive")
        for shape in (model.target, model.draft):
            if min(shape.layers, shape.heads, shape.hidden, shape.weight_bytes) <= 0 or shape.hidden < shape.heads:
                raise BatchspecError(f"{where}: {shape.name}: layers, heads, hidden and weight_bytes must be "
                                     f"positive, hidden >= heads")
        return model


BUILTIN = {
    "llama70b-h100x8": lambda: RooflineCostModel("Llama-3.1-70B (bf16, TP8) + Llama-3.2-1B draft on 8x H100 SXM",
                                                 H100_SXM, LLAMA_31_70B, LLAMA_32_1B),
    "llama405b-h100x8": lambda: RooflineCostModel("Llama-3.1-405B (fp8, TP8) + Llama-3.2-1B draft on 8x H100 SXM",
                                                  H100_SXM, LLAMA_31_405B_FP8, LLAMA_32_1B),
}
