"""DSD / SmartSpec: one window k for the whole batch, chosen per step to maximise goodput (DESIGN.md section 3).

goodput(k) = B * (1 - alpha^(k+1)) / (1 - alpha) / T(B, k), with alpha an EMA of the observed acceptance rate and
T(B, k) a step-time model profiled on this machine (`profiling.py` fits and caches it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from batchspec.errors import BatchspecError


@dataclass(frozen=True)
class AcceptanceEMA:
    """Exponential moving average of the observed acceptance rate. Immutable: `ema = ema.update(rate)`."""

    value: float = 0.7
    decay: float = 0.85

    def update(self, observed_rate: float) -> AcceptanceEMA:
        rate = min(max(observed_rate, 0.0), 1.0)
        return AcceptanceEMA(value=self.decay * self.value + (1.0 - self.decay) * rate, decay=self.decay)


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per speculative step: T(B, k) = c_fixed + c_draft_step*k + c_draft_token*B*k + c_target_token*B*(k+1).

    Why this form: the target runs once over B*(k+1) positions (a launch/weight-read cost `c_fixed` plus a per-token
    cost); the draft runs k *sequential* steps, each paying a per-step overhead independent of B plus a per-token
    cost for its B rows. Linear in the coefficients, so it is fitted by least squares on profiled (B, k, seconds).
    """

    c_fixed: float
    c_draft_step: float
    c_draft_token: float
    c_target_token: float

    @staticmethod
    def features(batch_size: int, k: int) -> tuple[float, float, float, float]:
        return (1.0, float(k), float(batch_size * k), float(batch_size * (k + 1)))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> StepTimeModel:
        """Least-squares fit on (batch_size, k, seconds) samples.

        Samples that do not vary both B and k leave the system rank-deficient; the minimum-norm solution (gelsd)
        still predicts well inside the profiled range.
        """
        if len(samples) < 4:
            raise BatchspecError(
                f"need at least 4 (batch_size, k, seconds) samples to fit the step-time model, got {len(samples)}"
            )
        design = torch.tensor([cls.features(b, k) for b, k, _ in samples], dtype=torch.float64)  # (N, 4)
        seconds = torch.tensor([[t] for _, _, t in samples], dtype=torch.float64)  # (N, 1)
        coef = torch.linalg.lstsq(design, seconds, driver="gelsd").solution[:, 0]  # (4,)
        return cls(*(float(c) for c in coef))

    def __call__(self, batch_size: int, k: int) -> float:
        f = self.features(batch_size, k)
        return self.c_fixed * f[0] + self.c_draft_step * f[1] + self.c_draft_token * f[2] + self.c_target_token * f[3]


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
