"""Step-time cost models for `batchspec sim`: how long one target forward, one draft forward and a prefill take.

Three sources (`load_cost_model(spec, trace)`):
- `trace`: fitted on this machine from a trace's own timings (per-step snapshots of the engine's time counters).
- `llama70b-h100x8`, `llama405b-h100x8`: analytic roofline models (RooflineCostModel, below), every constant with its
  source or marked as an assumption.
- a JSON file: `{"kind": "linear", ...}` (the fields of LinearCostModel) or `{"kind": "roofline", ...}`.

Interface (all in seconds): `target_s(batch, tokens, context)` one target forward scoring `tokens` positions of `batch`
requests holding `context` cached tokens in total; `draft_s(batch, context)` one draft forward (one token per
request); `prefill_s(tokens, requests)` -> (target, draft) prompt prefill; `select_s(sorts)` per step (for a policy whose selection sorts the batch, or not);
`step_overhead_s` per step.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchspec.errors import BatchspecError
from batchspec.sim.linear_cost import DraftRatioCostModel, LinearCostModel, draft_target_ratio, fit_from_trace, from_dict
from batchspec.sim.roofline import BUILTIN, Gpu, LlamaShape, RooflineCostModel

__all__ = ["BUILTIN", "DraftRatioCostModel", "Gpu", "LinearCostModel", "LlamaShape", "RooflineCostModel",
           "builtin_names", "draft_target_ratio", "fit_from_trace", "load_cost_model"]


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
