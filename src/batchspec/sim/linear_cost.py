"""Cost models measured on this machine: `LinearCostModel`, fitted from a trace's own step timings
(`fit_from_trace`), and `DraftRatioCostModel`, the same with the draft's cost scaled (the gain plot's sweep)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from batchspec.errors import BatchspecError
from batchspec.spec.policies import REGISTRY


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

    def select_s(self, sorts: bool) -> float:
        return self.select_s_per_step if sorts else 0.0

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

    def select_s(self, sorts: bool) -> float:
        return self.base.select_s(sorts)


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


def _sorts(policy: str | None) -> bool:
    """Whether the recorded policy's selection sorts the batch's scores (its per-step cost is then worth charging)."""
    return policy in REGISTRY and REGISTRY[policy].sorts


def fit_from_trace(trace) -> LinearCostModel:
    """Per-forward times of this machine from the engine's cumulative counters, snapshotted at every step.

    Between the snapshots of steps s and s+1 the engine ran, in order: step s's selection and its one verification
    forward (B_s requests, sum(l) + B_s positions), then step s+1's K' sequential draft forwards (B_{s+1} rows each).
    Intervals with more than one target call also hold a prefill of newly admitted requests and are left out.
    Before the first snapshot only the first prefill (target and draft) and step 0's drafting ran.
    """
    from batchspec.engine.trace import COUNTERS

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
        select_s_per_step=select if _sorts(trace.meta.get("policy")) else 0.0,
        step_overhead_s=overhead,
    )


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
