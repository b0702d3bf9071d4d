"""DSD / SmartSpec: one window k for the whole batch, chosen per step to maximise goodput (DESIGN.md section 3).

goodput(k) = B * (1 - alpha^(k+1)) / (1 - alpha) / T(B, k), with alpha an EMA of the observed acceptance rate and
T(B, k) a step-time model profiled on this machine (`spec/step_time.py` fits and caches it).

A step at k = 0 verifies nothing, so it teaches the estimate nothing: where the prior (0.7) makes k = 0 the best
choice, alpha would stay at the prior for the whole run, however well the draft agrees. The `EXPLORE_AFTER`-th step
in a row planned at k = 0 drafts one token per request (k = 1) to observe the acceptance again (`Exploration`, as
goodput Tetris explores, at a fixed wait here). Measured on an AVX2 EPYC (Qwen pair, float32 target,
batch 8, where a window of 1 pays only from alpha ~0.84): without probes dsd spent 217 steps almost all at k = 0,
0.92x sd's tokens per second; with them 1.03x (69 steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from batchspec.errors import BatchspecError
from batchspec.spec.policies.base import Plan, StepTime
from batchspec.spec.policies.exploration import Exploration
from batchspec.spec.policies.sd import SdPolicy


# Every EXPLORE_AFTER-th step in a row planned at k = 0 drafts one token per request to observe the acceptance
# (where k = 0 is right, that costs one draft pass and one verified row per request every EXPLORE_AFTER steps).
EXPLORE_AFTER = 5


@dataclass(frozen=True)
class AcceptanceEMA:
    """Exponential moving average of the observed acceptance rate. Immutable: `ema = ema.update(rate)`."""

    value: float = 0.7
    decay: float = 0.85

    def update(self, observed_rate: float) -> AcceptanceEMA:
        rate = min(max(observed_rate, 0.0), 1.0)
        return AcceptanceEMA(value=self.decay * self.value + (1.0 - self.decay) * rate, decay=self.decay)


def expected_tokens_per_request(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected emitted tokens per request with window k, i.i.d. acceptance alpha."""
    if abs(1.0 - alpha) < 1e-9:
        return float(k + 1)  # the limit alpha -> 1
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def dsd_choose_k(alpha: float, batch_size: int, k_max: int, step_time: Callable[[int, int], float]) -> int:
    """argmax over k in [0, k_max] of goodput B * (1 - alpha^(k+1)) / (1 - alpha) / T(B, k); smallest k on ties."""
    alpha = min(max(alpha, 0.0), 1.0)
    best_k, best_goodput = 0, -math.inf
    for k in range(k_max + 1):  # k_max + 1 scalar candidates, not a loop over tokens
        seconds = step_time(batch_size, k)
        if not seconds > 0.0:
            raise BatchspecError(f"step-time model gave a non-positive time {seconds} for B={batch_size}, k={k}")
        goodput = batch_size * expected_tokens_per_request(alpha, k) / seconds
        if goodput > best_goodput:
            best_k, best_goodput = k, goodput
    return best_k


class DsdPolicy(SdPolicy):
    """sd with k chosen per step by goodput, from its own running acceptance estimate and a step-time model."""

    name = "dsd"
    needs_step_time = True
    needs_row_times = True  # T(B, k) from both models' profiled tables (`StepCost.__call__`)
    description = "window k chosen per step by goodput"

    def __init__(self, spec, verifier=None) -> None:
        super().__init__(spec, verifier)
        self.acceptance = AcceptanceEMA()  # learned across steps (and across `generate` calls of one engine)
        self.exploration = Exploration(after=EXPLORE_AFTER, most=EXPLORE_AFTER)  # steps at k = 0 observe nothing

    @classmethod
    def validate(cls, spec, batch_size: int) -> None:
        super().validate(spec, batch_size)
        if spec.k_max < 1:
            raise BatchspecError(f"k_max must be >= 1 for dsd (got {spec.k_max})")

    def max_draft_length(self) -> int:
        return max(self.spec.k + self.spec.extra, self.spec.k_max)

    def plan(self, batch_size: int, step_time: StepTime | None = None, requests=None, catch_up=None,
             remaining=None) -> Plan:
        if step_time is None:
            raise BatchspecError("dsd needs a step-time model T(B, k) to choose its window")
        k = dsd_choose_k(self.acceptance.value, batch_size, self.spec.k_max, step_time)
        if k:
            self.exploration.drafted()
        elif self.exploration.explores():  # the estimate is stale: look at the acceptance again
            k = 1
        return Plan(k, k, min(self.spec.capacity_for(batch_size), batch_size * k))

    def observe(self, proposal, windows: list[int], accepted: list[int]) -> None:
        if sum(windows):
            self.acceptance = self.acceptance.update(sum(accepted) / sum(windows))
