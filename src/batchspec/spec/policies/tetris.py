"""Tetris: spend the target's verification capacity C on the draft tokens most likely to be accepted (DESIGN.md 3).

Per step, request i drafted K' tokens with log-probabilities log q[i, t]. Tetris scores every (i, j) by the log of
its cumulative draft probability s[i, j] = sum_{t<=j} log q[i, t], a draft-side proxy for the probability that drafts
1..j of request i are all accepted, takes the top C scores over the whole batch and verifies, per request, the
window l[i] = how many of its positions were taken. Easy requests get long windows, hard ones short (or none).

Because s is non-increasing along j, the top-C set is prefix-closed per request, and greedy top-C maximises
E[A] = sum_i sum_{j<=l[i]} prod_{t<=j} a[i, t] when the scores are the true acceptance a (Theorem 1 of the Tetris
paper) - that is `oracle_windows`, the measurement-only upper bound. Selection uses draft-side information only, so
verification stays lossless whatever windows it picks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from batchspec.errors import BatchspecError
from batchspec.spec.policies.base import Plan, Policy, sd_windows
from batchspec.spec.policies.goodput import (CatchUp, Goodput, drafting_time, goodput_windows, pass_times,
                                             smallest_step)
from batchspec.spec.proposal import KeepDrafting
from batchspec.spec.verifier import DraftScorer, calibrated_log_probs


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
        return torch.from_numpy(_top_rows_ascending(_cumulative_costs(draft_logprobs.numpy()), capacity))
    logprobs = torch.nan_to_num(draft_logprobs, nan=-math.inf).clamp(max=0.0)  # (B, K')
    return _top_capacity_windows(torch.cumsum(logprobs, dim=1), capacity)


def _cumulative_costs(logprobs: np.ndarray) -> np.ndarray:
    """-s[i, j] = -sum_{t<=j} log q[i, t] (B, K') float64, non-decreasing along K'.

    The numpy form of Tetris's scores, in as few calls as possible (each is ~1 us, the whole ~20 us at B=64, K'=8):
    fmin maps NaN to inf (ranked last, like -inf log q), maximum clamps -log q at 0 (rounding cannot break the order
    along K'), and float64 partial sums of float32 values cannot overflow. A prefix of the columns gives the same
    partial sums, so pruned drafting (`tetris_keep_drafting`) sees the values the final selection will.
    """
    costs = np.negative(logprobs)
    np.fmin(costs, np.inf, out=costs)
    np.maximum(costs, 0.0, out=costs)
    return costs.cumsum(axis=1, dtype=np.float64)


def tetris_keep_drafting(logprobs: np.ndarray, drafting: np.ndarray, capacity: int) -> np.ndarray:
    """Fixed C: which of the requests still drafting may yet have a draft among the final top-C. (B,) bool.

    logprobs (B, j): every draft so far, -inf past the end of a request that stopped. Request i's later drafts score
    at most its current s[i, j-1]; when that is below the C-th best score already drafted, at least C drafts will
    outrank every one of them, so none can be verified: request i stops drafting. The final windows are then exactly
    those of drafting everything (tests/test_tetris.py: random instances; tests/test_speculative.py: recorded steps).
    """
    return top_capacity_keep_drafting(_cumulative_costs(logprobs), drafting, capacity)


def top_capacity_keep_drafting(costs: np.ndarray, drafting: np.ndarray, capacity: int) -> np.ndarray:
    """`tetris_keep_drafting` on any costs (B, j) non-decreasing along j (the negated scores a top-C ranks by)."""
    if capacity <= 0:
        return np.zeros_like(drafting)
    if capacity > costs.size:
        return drafting  # fewer drafts than capacity: every one is verified
    threshold = np.partition(costs, capacity - 1, axis=None)[capacity - 1]  # the C-th smallest cost
    return drafting & (costs[:, -1] <= threshold)


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


class TetrisPolicy(Policy):
    """Top-C cumulative draft probability across the batch; sd's window below `turn_on_batch_size` requests, where
    there is too little choice across requests to pay off. With `tetris_scores="verifier"` it ranks by the SPRINTER
    verifier's calibrated P(accept) instead of q, with "calibrated" by survival on acceptance learned from earlier
    steps (`spec.calibration`): still draft-side only, so still lossless. With `capacity="auto"`
    (goodput Tetris, `policies/goodput.py`) it chooses K' before drafting and C after it, for the most expected
    tokens per second, on acceptance calibrated from earlier steps."""

    name = "tetris"
    sorts = True
    # With `capacity="auto"`: re-plan the draft lengths after each draft pass on what the drafts say (off: only the
    # exact pruning, which never changes the windows).
    replans = True
    description = "top-C cumulative acceptance across the batch"

    def __init__(self, spec, verifier=None) -> None:
        super().__init__(spec, verifier)
        self.auto = spec.capacity == "auto"  # K' and C chosen per step for goodput, on calibrated acceptance
        self.needs_step_time = self.needs_row_times = self.auto
        # Calibrated acceptance, learned from every verification: what goodput mode and tetris_scores="calibrated"
        # rank by.
        self.calibrated = self.auto or spec.tetris_scores == "calibrated"
        self.goodput = Goodput(self.max_draft_length()) if self.calibrated else None
        self._costs = None  # (cost model, {B: (draft pass times by rows, target times by C)}) of the steps seen
        self._planned = None  # (plan, its `_step_times`, its fewest drafts of a request) of the current step
        self._lag = None  # (B,) the current step's first-pass lag per request (`goodput.CatchUp.lag`)
        self._selected = None, None  # (proposal, its log q as numpy) of the last `select` with capacity="auto"

    @classmethod
    def validate(cls, spec, batch_size: int) -> None:
        if isinstance(spec.capacity, str) and spec.capacity != "auto":
            raise BatchspecError(f"capacity must be a number or auto, got {spec.capacity!r}")
        super().validate(spec, batch_size)
        if spec.max_draft is not None and spec.max_draft < 1:
            raise BatchspecError(f"max_draft must be >= 1 (got {spec.max_draft})")
        if spec.tetris_scores == "verifier" and spec.verifier is None:
            raise BatchspecError("policy 'tetris' with --tetris-scores verifier needs a SPRINTER verifier (--verifier)")
        if spec.tetris_scores == "verifier" and spec.capacity == "auto":
            raise BatchspecError("--capacity auto ranks by calibrated draft probabilities: use --tetris-scores q or "
                                 "calibrated")

    def max_draft_length(self) -> int:
        """With `capacity="auto"` K' is chosen per step, up to `max_draft` (None: twice dsd's cap k_max; k + extra
        when larger)."""
        if not self.auto:
            return super().max_draft_length()
        return max(self.spec.k + self.spec.extra, self.spec.draft_cap)

    def plan(self, batch_size: int, step_time=None, requests=None, catch_up=None, remaining=None) -> Plan:
        if not self.auto:
            return super().plan(batch_size)
        if step_time is None:
            raise BatchspecError("tetris with --capacity auto needs a step-time model to choose its capacity")
        requests = tuple(range(batch_size) if requests is None else requests)
        owed = None  # the draft's catch-up, priced where the cost model has timed it
        if catch_up is not None and remaining is not None and getattr(step_time, "catch_up", False):
            owed = CatchUp(np.asarray(catch_up), np.asarray(remaining), step_time.catch_up_s)
        self._lag = None if owed is None else owed.lag  # as `draft_lengths` prices it
        # A request with n tokens left emits at most n - 1 drafts (and the token every step emits).
        useful = None if remaining is None else np.maximum(np.asarray(remaining, dtype=np.int64) - 1, 0)
        lengths = self.goodput.draft_lengths(requests, *self._step_costs(step_time, batch_size), step_time.pad_s,
                                             owed, useful)
        return replace(super().plan(batch_size), k_prime=int(lengths.max(initial=0)), step_time=step_time,
                       lengths=lengths, requests=requests)

    def _on(self, batch_size: int) -> bool:
        return batch_size >= self.spec.turn_on_batch_size

    def draft_length(self, k: int, batch_size: int) -> int:
        return k + self.spec.extra if self._on(batch_size) else k

    def draft_scorer(self) -> DraftScorer | None:
        return DraftScorer(self.verifier) if self.spec.tetris_scores == "verifier" else None

    def drafting_rule(self, plan: Plan, batch_size: int) -> KeepDrafting | None:
        """Pruned drafting: a request stops drafting once none of its later drafts could be verified; with
        `capacity="auto"` (and `replans`) also once the step re-planned on its drafts so far (`Goodput.draft_on`)
        stops it."""
        if not self.spec.prune_drafts or plan.k_prime < 2 or not self._on(batch_size):
            return None
        if self.spec.tetris_scores == "verifier":
            return None  # its scores are not the log q seen while drafting
        if not self.auto:
            # The costs `select` will rank by: -survival when calibrated, else -cumulative log q.
            costs_of = ((lambda logprobs: np.negative(self.goodput.estimate(logprobs))) if self.calibrated
                        else _cumulative_costs)

            def keep_fixed(logprobs: Tensor, drafting: Tensor) -> Tensor:
                return torch.from_numpy(top_capacity_keep_drafting(costs_of(logprobs.numpy()), drafting.numpy(),
                                                                   plan.capacity))
            return keep_fixed
        times = self._step_times(plan, batch_size)  # as `select` will time the step
        lengths = plan.drafts(batch_size)
        # The bound of `goodput_keep_drafting` holds for times that only grow with C; padded attention rows shrink as
        # shorter windows fill up to the longest, so with them priced each request drafts its planned length.
        step = 0.0 if plan.step_time.pad_s else smallest_step(times)

        passes, target = self._step_costs(plan.step_time, batch_size)

        def keep_goodput(logprobs: Tensor, drafting: Tensor) -> Tensor:
            so_far = logprobs.numpy()
            keep = self.goodput.keep_drafting(so_far, drafting.numpy(), times, step)
            keep &= lengths > so_far.shape[1]  # each request up to its own length
            if self.replans and keep.any():
                keep = self.goodput.draft_on(so_far, keep, passes, target, plan.step_time.pad_s)
            return torch.from_numpy(keep)
        return keep_goodput

    def _step_costs(self, step_time, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(one draft pass's seconds by rows 0..2B, the target's seconds over B + C rows for C = 0..B * cap), kept per
        B while the cost model stays and learns nothing new (`StepCost.learn`)."""
        version = getattr(step_time, "version", None)
        if self._costs is None or self._costs[0] is not step_time or self._costs[2] != version:
            self._costs = step_time, {}, version
        by_batch = self._costs[1]
        if batch_size not in by_batch:
            rows = batch_size + np.arange(batch_size * self.goodput.max_draft + 1)
            by_batch[batch_size] = (pass_times(step_time, 2 * batch_size),
                                    np.asarray(step_time.target_s(rows), dtype=float))
        return by_batch[batch_size]

    def _step_times(self, plan: Plan, batch_size: int) -> np.ndarray:
        """(B*K' + 1,) seconds of the planned step verifying C = 0..B*K' drafts: its draft passes (each over the
        requests drafting that far) and one target pass over B + C rows. Kept for the plan (pruned drafting and
        `select` both read them)."""
        if self._planned is None or self._planned[0] is not plan:
            passes, target = self._step_costs(plan.step_time, batch_size)
            lengths = plan.drafts(batch_size)
            drafting = drafting_time(lengths, passes, self._lag)
            shortest = int(lengths.min()) if lengths.size else 0
            self._planned = plan, drafting + target[:batch_size * plan.k_prime + 1], shortest
        return self._planned[1]

    def _shortest(self, plan: Plan, batch_size: int) -> int:
        """The fewest drafts the plan gives a request (kept with `_step_times`)."""
        self._step_times(plan, batch_size)
        return self._planned[2]

    def select(self, plan: Plan, proposal, accept_probs: Tensor | None = None) -> Tensor:
        batch_size, k_prime = proposal.logprobs.shape
        if not self._on(batch_size):
            return sd_windows(batch_size, plan.k, k_prime, device=proposal.logprobs.device)
        if self.auto:
            logprobs = proposal.logprobs.numpy()  # (B, K')
            self._selected = proposal, logprobs  # `observe` learns from the same array
            lengths = plan.drafts(batch_size)
            if self._shortest(plan, batch_size) < k_prime:  # drafts past a request's length (unpruned, or measuring)
                logprobs = np.where(np.arange(k_prime) < lengths[:, None], logprobs, -np.inf)
            survival = self.goodput.survival(logprobs, plan.requests)  # (B, K')
            if self.goodput.exploring:  # an exploration learns only from drafts the target verifies
                return torch.minimum(torch.from_numpy(lengths), proposal.drafted)
            return torch.from_numpy(goodput_windows(survival, self._step_times(plan, batch_size), plan.step_time.pad_s))
        if self.calibrated:  # top-C by calibrated survival
            return _top_capacity_windows(torch.from_numpy(self.goodput.survival(proposal.logprobs.numpy())),
                                         plan.capacity)
        # Calibrated (class balancing undone) verifier probabilities rank like acceptance probabilities.
        scores = (calibrated_log_probs(self.verifier, proposal.verifier_probs) if self.spec.tetris_scores == "verifier"
                  else proposal.logprobs)
        return tetris_windows(scores, plan.capacity)

    def observe(self, proposal, windows: list[int], accepted: list[int]) -> None:
        if self.calibrated:
            seen, logprobs = self._selected
            if seen is not proposal:
                logprobs = proposal.logprobs.numpy()
            self.goodput.observe(logprobs, np.asarray(windows), np.asarray(accepted))
