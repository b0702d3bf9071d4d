"""Step-time cost models for `batchspec sim`: how long one target forward, one draft forward and a prefill take.

Three sources (`load_cost_model(spec, trace)`):
- `trace`: fitted on this machine from a trace's own timings (per-step snapshots of the engine's time counters).
- `llama70b-h100x8`, `llama405b-h100x8`: analytic roofline models (RooflineCostModel, below), every constant with its
  source or marked as an assumption.
- a JSON file: `{"kind": "linear", ...}` (the fields of LinearCostModel) or `{"kind": "roofline", ...}`.

Interface (all in seconds): `target_s(batch, tokens, context)` one target forward scoring `tokens` positions of `batch`
requests holding `context` cached tokens in total; `draft_s(batch, context)` one draft forward (one token per
request); `prefill_s(tokens, requests)` -> (target, draft) prompt prefill; `select_s(policy)` per step;
`step_overhead_s` per step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchspec.errors import BatchspecError

SORTING_POLICIES = ("tetris", "oracle")  # policies whose selection sorts the batch's scores (the rest is ~free)


@dataclass(frozen=True)
class LinearCostModel:
    """Times linear in the work: what a CPU runtime (row-proportional matmuls plus fixed per-call costs) shows."""

    name: str
    target_fixed_s: float  # per target forward: weight reads that do not scale with rows, dispatch
    target_per_token_s: float  # per scored position
    draft_fixed_s: float  # per draft forward
    draft_per_seq_s: float  # per request in the draft forward (one token each)
    prefill_target_per_token_s: float  # target prefill, per prompt token
    prefill_draft_per_token_s: float  # draft prefill, per prompt token
    select_s_per_step: float = 0.0  # Tetris/oracle selection (a sort over B x K' scores); sd/dsd: 0
    step_overhead_s: float = 0.0  # per speculative step: bookkeeping outside the forwards and the selection
    target_per_context_s: float = 0.0  # per cached token read by attention
    draft_per_context_s: float = 0.0
    kind: str = "linear"

    def target_s(self, batch: int, tokens: int, context: int) -> float:
        return self.target_fixed_s + self.target_per_token_s * tokens + self.target_per_context_s * context

    def draft_s(self, batch: int, context: int) -> float:
        return self.draft_fixed_s + self.draft_per_seq_s * batch + self.draft_per_context_s * context

    def prefill_s(self, tokens: int, requests: int) -> tuple[float, float]:
        return self.prefill_target_per_token_s * tokens, self.prefill_draft_per_token_s * tokens

    def select_s(self, policy: str) -> float:
        return self.select_s_per_step if policy in SORTING_POLICIES else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DraftRatioCostModel:
    """`base` with the draft re-costed as `ratio` x a target decode forward at the same batch (for ratio sweeps)."""

    base: object  # any cost model
    ratio: float

    @property
    def name(self) -> str:
        return f"{self.base.name} (draft/target = {self.ratio:g})"

    @property
    def step_overhead_s(self) -> float:
        return self.base.step_overhead_s

    def target_s(self, batch: int, tokens: int, context: int) -> float:
        return self.base.target_s(batch, tokens, context)

    def draft_s(self, batch: int, context: int) -> float:
        return self.ratio * self.base.target_s(batch, batch, context)

    def prefill_s(self, tokens: int, requests: int) -> tuple[float, float]:
        target, _ = self.base.prefill_s(tokens, requests)
        return target, self.ratio * target

    def select_s(self, policy: str) -> float:
        return self.base.select_s(policy)


def draft_target_ratio(model, batch: int, context: int) -> float:
    """One draft forward over one target decode forward (B tokens) at this batch and context."""
    return model.draft_s(batch, context) / model.target_s(batch, batch, context)


# ---------------------------------------------------------------------------------------------------------------
# Fitting on this machine, from a trace's per-step counter snapshots
# ---------------------------------------------------------------------------------------------------------------


def _fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) >= 0 by least squares; a line through the origin when x barely varies or the fit is < 0."""
    if len(x) == 0:
        raise BatchspecError("the trace has too few steps to fit a cost model (record a longer run)")
    if x.max() >= 1.2 * max(x.min(), 1e-12) and len(x) >= 3:
        slope, intercept = np.polyfit(x, y, 1)
        if intercept >= 0 and slope >= 0:
            return float(intercept), float(slope)
        if slope < 0:  # noise dominates the trend: a constant time
            return float(np.median(y)), 0.0
    return 0.0, float(np.sum(y) / max(np.sum(x), 1e-12))


def fit_from_trace(trace) -> LinearCostModel:
    """Per-forward times of this machine from the engine's cumulative counters, snapshotted at every step.

    Between the snapshots of steps s and s+1 the engine ran, in order: step s's selection and its one verification
    forward (B_s requests, sum(l) + B_s positions), then step s+1's K' sequential draft forwards (B_{s+1} rows each).
    Intervals with more than one target call also hold a prefill of newly admitted requests and are left out.
    Before the first snapshot only the first prefill (target and draft) and step 0's drafting ran.
    """
    from batchspec.trace import COUNTERS

    c = {name: trace.step_counters[:, i] for i, name in enumerate(COUNTERS)}  # each (S,)
    delta = {name: np.diff(v) for name, v in c.items()}  # each (S-1,)
    clean = delta["target_calls"] == 1  # (S-1,) intervals with exactly step s's verification
    target_fixed, target_token = _fit_line(delta["target_tokens"][clean], delta["target_s"][clean])
    next_batch, next_width = trace.step_batch[1:][clean], trace.step_width[1:][clean]
    draft_fixed, draft_seq = _fit_line(next_batch.astype(float), delta["draft_s"][clean] / np.maximum(next_width, 1))
    select = float(np.mean(delta["select_s"][clean])) if clean.any() else 0.0

    prefill_tokens = max(c["target_tokens"][0], 1.0)  # prompt tokens of the first admission
    first_draft = trace.step_width[0] * (draft_fixed + draft_seq * trace.step_batch[0])
    run = trace.meta.get("run", {})
    steps = max(int(run.get("steps", 0)), 1)
    overhead = max(0.0, float(run.get("wall_s", 0.0)) - float(run.get("target_s", 0.0))
                   - float(run.get("draft_s", 0.0)) - float(run.get("select_s", 0.0))) / steps
    return LinearCostModel(
        name=f"fitted on this machine ({trace.meta.get('machine', 'unknown CPU')}, "
             f"{trace.meta.get('threads', '?')} threads) from the trace's {trace.meta.get('policy', '?')} run",
        target_fixed_s=target_fixed, target_per_token_s=target_token, draft_fixed_s=draft_fixed,
        draft_per_seq_s=draft_seq, prefill_target_per_token_s=float(c["target_s"][0] / prefill_tokens),
        prefill_draft_per_token_s=float(max(0.0, c["draft_s"][0] - first_draft) / prefill_tokens),
        select_s_per_step=select if trace.meta.get("policy") in SORTING_POLICIES else 0.0,
        step_overhead_s=overhead,
    )


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

    def select_s(self, policy: str) -> float:
        return self.select_s_per_step if policy in SORTING_POLICIES else 0.0

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


# ---------------------------------------------------------------------------------------------------------------
# Loading by name or from JSON
# ---------------------------------------------------------------------------------------------------------------


def builtin_names() -> tuple[str, ...]:
    return ("trace",) + tuple(BUILTIN)


def load_cost_model(spec: str, trace=None):
    """`trace` (needs the trace), a built-in roofline name, or a path to a JSON file."""
    if spec == "trace":
        if trace is None:
            raise BatchspecError("the 'trace' cost model needs a trace (--trace)")
        return fit_from_trace(trace)
    if spec in BUILTIN:
        return BUILTIN[spec]()
    path = Path(spec)
    if not path.is_file():
        raise BatchspecError(f"unknown cost model {spec!r}: use {', '.join(builtin_names())} or a JSON file path")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BatchspecError(f"{path}: invalid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("kind") not in ("linear", "roofline"):
        raise BatchspecError(f"{path}: a cost model is a JSON object with \"kind\": \"linear\" or \"roofline\"")
    if data["kind"] == "linear":
        return from_dict(LinearCostModel, data, str(path))
    return RooflineCostModel.from_dict(data, str(path))


def from_dict(cls, data: dict, where: str):
    """Build a flat dataclass of numbers (plus `name`/`kind` strings), rejecting unknown, missing and bad fields."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BatchspecError(f"{where}: unknown field(s) {', '.join(unknown)}; expected {', '.join(fields)}")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data]
    if required:
        raise BatchspecError(f"{where}: missing field(s) {', '.join(required)}")
    for name, value in data.items():
        if name in ("name", "kind"):
            if not isinstance(value, str):
                raise BatchspecError(f"{where}: {name} must be a string")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise BatchspecError(f"{where}: {name} must be a finite non-negative number, got {value!r}")
    return cls(**data)
