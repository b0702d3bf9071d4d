"""Selection policies: which draft tokens of which requests the target verifies (DESIGN.md sections 2-3).

Every policy is a pure function from draft-side statistics to window lengths `l` of shape (B,), int64, each in
[0, K'], with sum(l) <= C. The target then scores l[i] + 1 positions of request i (drafts plus bonus/correction).
Only draft-side information may choose `l` in a real run; `oracle_windows` (true acceptance probabilities) exists
for measurement only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from batchspec.errors import BatchspecError

POLICIES: tuple[str, ...] = ("ar", "sd", "dsd", "tetris", "oracle", "sprinter")
LOSSLESS_POLICIES: tuple[str, ...] = ("ar", "sd", "dsd", "tetris", "oracle")  # sprinter trades fidelity for speed


# ---------------------------------------------------------------------------------------------------------------
# Validation at the edge (user-facing messages)
# ---------------------------------------------------------------------------------------------------------------


def check_policy(policy: str) -> str:
    """Return `policy` unchanged if it names a selection policy, else raise with the valid names."""
    if policy not in POLICIES:
        raise BatchspecError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    return policy


def default_capacity(k: int, batch_size: int) -> int:
    """C = k * B: the verification cost of standard SD with window k (the Tetris paper's default)."""
    return k * batch_size


def validate_spec(k: int, extra: int, capacity: int, batch_size: int) -> None:
    """Raise BatchspecError with a one-line message if (k, extra, capacity) cannot be run on `batch_size` requests."""
    if k < 1:
        raise BatchspecError(f"k must be >= 1 (got {k})")
    if extra < 0:
        raise BatchspecError(f"extra must be >= 0 (got {extra})")
    if batch_size < 1:
        raise BatchspecError(f"batch size must be >= 1 (got {batch_size})")
    if capacity < 0:
        raise BatchspecError(f"capacity must be >= 0 (got {capacity})")
    most = (k + extra) * batch_size
    if capacity > most:
        raise BatchspecError(
            f"capacity {capacity} exceeds the drafted tokens (k + extra) * B = ({k} + {extra}) * {batch_size} = {most}"
        )


def draft_length(policy: str, k: int, extra: int, batch_size: int, turn_on_batch_size: int = 0) -> int:
    """K': how many tokens the draft proposes per request this step under `policy`."""
    check_policy(policy)
    if policy == "ar":
        return 0
    if policy == "oracle" or (policy == "tetris" and batch_size >= turn_on_batch_size):
        return k + extra
    return k  # sd, dsd (k already chosen by dsd_choose_k), tetris below its turn-on batch size; sprinter: k = L


# ---------------------------------------------------------------------------------------------------------------
# Window rules
# ---------------------------------------------------------------------------------------------------------------


def sd_windows(batch_size: int, k: int, k_prime: int, device: torch.device | str | None = None) -> Tensor:
    """Standard SD: every request verifies min(k, K') drafts. Returns (B,) int64."""
    return torch.full((batch_size,), min(k, k_prime), dtype=torch.int64, device=device)


def _top_capacity_windows(scores: Tensor, capacity: int) -> Tensor:
    """Window lengths of the top-`capacity` entries of `scores` (B, K'), which must be non-increasing along K'.

    A stable descending sort of the row-major flattening orders equal scores by flat index, i.e. by position within
    a row. Together with non-increasing rows this means every row's positions appear in increasing order, so any
    sorted prefix is prefix-closed per row, and counting the chosen entries per row gives sum(l) == C exactly even
    under ties (0 log-probs, -inf), where "furthest selected position" would overshoot C.
    """
    batch_size, k_prime = scores.shape
    if capacity >= batch_size * k_prime:
        return torch.full((batch_size,), k_prime, dtype=torch.int64, device=scores.device)
    if capacity <= 0:
        return torch.zeros(batch_size, dtype=torch.int64, device=scores.device)
    if scores.device.type == "cpu":
        # numpy for its ~1 us per-op dispatch (torch's is ~5-25 us; benchmarks/selection_overhead.py). Negating
        # turns the stable ascending argsort into a stable descending one (-inf -> inf keeps zero-probability tails
        # last).
        return torch.from_numpy(_top_rows_ascending(np.negative(scores.numpy()), capacity))
    order = torch.sort(scores.reshape(-1), descending=True, stable=True).indices  # (B*K',)
    chosen_rows = order[:capacity] // k_prime  # (C,)
    return torch.bincount(chosen_rows, minlength=batch_size)  # (B,) int64


def _top_rows_ascending(costs: np.ndarray, capacity: int) -> np.ndarray:
    """Per row, how many of the `capacity` smallest entries of `costs` (B, K') it holds (rows non-decreasing)."""
    chosen = np.argsort(costs, axis=None, kind="stable")[:capacity]  # flat indices, row-major
    return np.bincount(chosen // costs.shape[1], minlength=costs.shape[0])


def tetris_windows(draft_logprobs: Tensor, capacity: int) -> Tensor:
    """Tetris: top-C of s[i,j] = sum_{t<=j} log q[i,t] over all (i, j). (B, K') -> (B,) int64."""
    # log q <= 0 in exact arithmetic; the clamp keeps rounding (and NaN) from breaking monotonicity along K',
    # since fl(s + x) <= s for x <= 0.
    if draft_logprobs.device.type == "cpu":
        batch_size, k_prime = draft_logprobs.shape
        if not 0 < capacity < batch_size * k_prime:
            return _top_capacity_windows(draft_logprobs, capacity)  # all or nothing: no ranking needed
        # The same in numpy, on costs -log q, in as few calls as possible (each is ~1 us, the whole ~20 us at
        # B=64, K'=8): fmin maps NaN to inf (ranked last, like -inf log q), maximum clamps -log q at 0, and
        # float64 partial sums of float32 values cannot overflow.
        costs = np.negative(draft_logprobs.numpy())
        np.fmin(costs, np.inf, out=costs)
        np.maximum(costs, 0.0, out=costs)
        return torch.from_numpy(_top_rows_ascending(costs.cumsum(axis=1, dtype=np.float64), capacity))
    logprobs = torch.nan_to_num(draft_logprobs, nan=-math.inf).clamp(max=0.0)  # (B, K')
    return _top_capacity_windows(torch.cumsum(logprobs, dim=1), capacity)


def oracle_windows(accept_probs: Tensor, capacity: int) -> Tensor:
    """Tetris with the true acceptance a[i,j]: top-C of log prod_{t<=j} a[i,t]. (B, K') -> (B,) int64.

    Top-C on cumulative acceptance is optimal for E[A] (Tetris, Theorem 1); measurement only (needs the target).
    """
    probs = torch.nan_to_num(accept_probs, nan=0.0).clamp(0.0, 1.0)  # (B, K')
    # cumprod of values in [0, 1] is non-increasing, and ranking the products ranks their logs (log is monotone).
    return _top_capacity_windows(torch.cumprod(probs, dim=1), capacity)


def expected_accepted(accept_probs: Tensor, windows: Tensor) -> float:
    """E[A](l) = sum_i sum_{j<=l[i]} prod_{t<=j} a[i,t] (j 1-based): expected accepted drafts of a selection."""
    survival = torch.cumprod(accept_probs, dim=1)  # (B, K'): P(drafts 1..j all accepted)
    positions = torch.arange(accept_probs.shape[1], device=accept_probs.device)  # (K',)
    in_window = positions[None, :] < windows[:, None]  # (B, K')
    return float(torch.where(in_window, survival, torch.zeros_like(survival)).sum())


def select_windows(
    policy: str,
    *,
    draft_logprobs: Tensor,
    k: int,
    capacity: int,
    turn_on_batch_size: int = 0,
    accept_probs: Tensor | None = None,
) -> Tensor:
    """Dispatch to a policy's window rule. `draft_logprobs` is (B, K'); returns (B,) int64.

    `k` is the per-request window of sd (and of dsd, whose k the caller chose with `dsd_choose_k`). Tetris behaves
    as sd below `turn_on_batch_size` requests, where there is too little choice across requests to pay off.
    """
    check_policy(policy)
    batch_size, k_prime = draft_logprobs.shape
    device = draft_logprobs.device
    if policy == "ar":
        return torch.zeros(batch_size, dtype=torch.int64, device=device)
    if policy in ("sd", "dsd") or (policy == "tetris" and batch_size < turn_on_batch_size):
        return sd_windows(batch_size, k, k_prime, device=device)
    if policy == "tetris":
        return tetris_windows(draft_logprobs, capacity)
    if policy == "sprinter":
        raise BatchspecError("sprinter's windows are its verifier's blocks (speculative.propose), not a selection")
    if accept_probs is None:
        raise BatchspecError("the oracle policy needs the true acceptance probabilities (accept_probs)")
    return oracle_windows(accept_probs, capacity)


# ---------------------------------------------------------------------------------------------------------------
# DSD / SmartSpec: one k for the batch, maximising goodput under a step-time model
# ---------------------------------------------------------------------------------------------------------------


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
