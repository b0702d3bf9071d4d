"""Goodput Tetris's choices, as pure functions over estimated survival and a step-cost model.

Per step: the draft length K' (0 = a plain decoding step, the draft does not run) before drafting, from the survival
each position has had lately; after drafting, the capacity C from every draft's own estimate. Both maximise expected
emitted tokens per second of the whole step, B + (sum of the verified drafts' survivals) over
T_draft(B, K') + T_target(B + C rows), with T from this machine's profile (`spec.step_time.StepCost`). Survival of
draft j of request i = prod_{t<=j} P(accept | q[i, t]), the calibrated acceptance of earlier steps' outcomes
(`spec.calibration`): draft-side information only, so verification stays lossless whatever is chosen.
"""

from __future__ import annotations

import numpy as np

from batchspec.spec.calibration import AcceptanceCalibration, bin_of


def step_times(step_time, batch_size: int, k_prime: int) -> np.ndarray:
    """(B*K' + 1,) seconds of the whole step verifying C = 0, 1, ..., B*K' drafts: K' draft passes over B rows and one
    target pass over B + C rows. Computed once per (B, K'); every choice below reads it."""
    drafting = step_time.draft_s(batch_size, k_prime) if k_prime else 0.0
    return drafting + np.asarray(step_time.target_s(batch_size + np.arange(batch_size * k_prime + 1)), dtype=float)


def capacity_rates(survival: np.ndarray, times: np.ndarray) -> np.ndarray:
    """(B*K' + 1,) expected tokens per second when the target verifies the top-C drafts, C = 0, 1, ..., B*K'.

    survival (B, K'), non-increasing along K' (so the top-C set is prefix-closed per request); every request emits
    one token more than its accepted drafts, hence B. times: `step_times` (at least B*K' + 1 of them).
    """
    ranked = np.sort(survival, axis=None)[::-1]  # (B*K',)
    expected = survival.shape[0] + np.concatenate([[0.0], np.cumsum(ranked)])
    return expected / times[:len(expected)]


def goodput_capacity(survival: np.ndarray, times: np.ndarray) -> int:
    """The C with the most expected tokens per second (the smallest on ties; 0 = verify nothing)."""
    return int(np.argmax(capacity_rates(survival, times)))


def goodput_windows(survival: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Windows (B,) of the top-C drafts by survival at the goodput-best C: one stable sort serves both.

    A stable sort of -survival in row-major order keeps each row's positions in order (survival is non-increasing
    along K'), so every prefix of it is prefix-closed per request, also under ties.
    """
    batch_size, k_prime = survival.shape
    flat = survival.reshape(-1)
    order = np.argsort(-flat, kind="stable")  # (B*K',)
    expected = np.cumsum(flat[order])
    expected += batch_size
    rates = expected / times[1:len(order) + 1]  # C = 1, ..., B*K'
    best = int(np.argmax(rates))
    capacity = best + 1 if rates[best] > batch_size / times[0] else 0  # C = 0 wins ties, as in `goodput_capacity`
    return np.bincount(order[:capacity] // k_prime, minlength=batch_size)


def smallest_step(times: np.ndarray) -> float:
    """min over C of T(C) - T(C - 1): the least time one more verified draft can add (0 with a staircase)."""
    return float(np.diff(times).min()) if len(times) > 1 else 0.0


def goodput_keep_drafting(survival: np.ndarray, drafting: np.ndarray, times: np.ndarray, step: float) -> np.ndarray:
    """Which of the requests still drafting may yet have a draft that `goodput_windows` verifies. (B,) bool.

    survival (B, j): every draft so far, 0 past the end of a request that stopped; times: the step's `step_times`;
    step: their `smallest_step`. The last draft the goodput-best C* verifies adds at least the step's rate times the
    time it adds (else C* - 1 would be better): its survival is >= R* (T(C*) - T(C* - 1)) >= R_known * step, where
    R_known, the best rate of the drafts so far alone, is <= R* (more drafts only raise the sorted survivals). Request
    i's later drafts survive at most as much as its current one; below that bound none of them can be verified, and it
    stops. A staircase T (steps of 0) keeps every request drafting: verification is free until the next step up.
    """
    if step <= 0.0:
        return drafting
    bound = float(capacity_rates(survival, times).max()) * step * (1.0 - 1e-9)  # a margin for rounding
    return drafting & (survival[:, -1] >= bound)


def best_draft_length(expected_survival: np.ndarray, batch_size: int, step_time) -> int:
    """K' in 0..len(expected_survival) with the most expected tokens per second, every request predicted to survive
    position j with expected_survival[j] (then C is chosen as `goodput_capacity` would)."""
    best_k = 0
    best_rate = batch_size / float(step_times(step_time, batch_size, 0)[0])
    for k_prime in range(1, len(expected_survival) + 1):
        rows = np.tile(expected_survival[:k_prime], (batch_size, 1))  # (B, K')
        rate = float(capacity_rates(rows, step_times(step_time, batch_size, k_prime)).max())
        if rate > best_rate:
            best_k, best_rate = k_prime, rate
    return best_k


class Goodput:
    """What goodput Tetris learns across steps: calibrated acceptance, and the mean survival of each position."""

    explore_after = 8  # plain decoding steps before one draft is tried again (acceptance may have risen);
    explore_most = 64  # the wait doubles up to this while drafting keeps not paying

    def __init__(self, max_draft: int, decay: float = 0.8) -> None:
        self.max_draft = max_draft
        self.decay = decay
        self.calibration = AcceptanceCalibration()
        self.expected_survival: np.ndarray | None = None  # (max_draft,) recent mean survival per position
        self._plain_steps = 0
        self._wait = self.explore_after
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # the last drafts' log q and their bins
        self._depth_counts: np.ndarray | None = None  # (max_draft, 1 + bins): drafts per bin and position, decayed
        self._after = np.triu(np.ones((max_draft + 1, max_draft)))  # (d, j): 1 where position j follows d drafts
        self._best: tuple | None = None  # (B, cost model, K') of the last choice, until survival changes

    def _survival(self, bins: np.ndarray) -> np.ndarray:
        # Bin 0 (-inf: not drafted, the request stopped early) has rate 0: survives nothing.
        return np.cumprod(self.calibration.rates[bins], axis=1)

    def survival(self, logprobs: np.ndarray) -> np.ndarray:
        """(B, K') log q -> estimated P(drafts 1..j all accepted); also remembered per position for `draft_length`."""
        self._last = (logprobs, bin_of(logprobs))  # for `observe`, which sees the same drafts
        bins = self._last[1]
        survival = self._survival(bins)
        self._best = None
        self._learn_depths(bins)
        if survival.shape[1] == self.max_draft and survival[:, -1].all():  # every request drafted every position
            mean = survival.mean(axis=0)
        else:
            mean = self._continued_mean(survival)  # (max_draft,)
        if self.expected_survival is None:
            self.expected_survival = mean
        else:
            self.expected_survival += (1.0 - self.decay) * (mean - self.expected_survival)
        return survival

    def _learn_depths(self, bins: np.ndarray) -> None:
        """Remember, per draft position, how its drafts' q fall into the calibration's bins (counts decayed by
        `decay` at each step that drafts the position): what a draft at that depth is like, to be rated by the
        latest calibration."""
        size = len(self.calibration.rates)
        width = bins.shape[1]
        counts = np.bincount((bins + size * np.arange(width)).ravel(), minlength=width * size).reshape(width, size)
        counts[:, 0] = 0  # bin 0: not drafted
        if self._depth_counts is None:
            self._depth_counts = np.zeros((self.max_draft, size))
        head = self._depth_counts[:width]  # a view: updated in place
        head[counts.any(axis=1)] *= self.decay
        head += counts

    def _continued_mean(self, survival: np.ndarray) -> np.ndarray:
        """(max_draft,) mean over requests of each one's survival (B, K') continued past its last draft (past K', or
        where it stopped drafting) at the rate drafts at each further position have had (`_learn_depths`, rated by
        the latest calibration; a position never drafted, at the deepest one's). Positions left at what an early
        step estimated (from the prior, before any outcome) kept K' at whatever it first chose: measured on the
        Qwen pair at batch 4, the first step put positions 6-8 at 0.56-0.49, so K' stayed 5 while every position
        was accepted ~0.99 of the time; continuing each request at its own last draft's rate instead over-drafted
        where acceptance falls with depth (the SmolLM2 pair at batch 16: 3,234 drafts to 2,563, 0.95x dsd).

        Grouped by drafted length d (survival is 0 past a request's drafts): sum of the drafted parts, plus for each
        d the requests' last survivals times the depth rates' products from position d on."""
        batch, width = survival.shape
        totals = self._depth_counts.sum(axis=1)
        seen = np.flatnonzero(totals)
        mean = np.zeros(self.max_draft)
        if not seen.size:  # no position drafted yet (every log q -inf): nothing to continue
            return mean
        rates = self._depth_counts @ self.calibration.rates
        rates[seen] /= totals[seen]
        rates[seen[-1] + 1:] = rates[seen[-1]]  # never drafted: as the deepest position drafted
        cum = np.zeros(self.max_draft + 1)
        np.cumsum(np.log(np.maximum(rates, 1e-12)), out=cum[1:])  # cum[j]: log of the product of rates before j
        drafted = np.count_nonzero(survival, axis=1)  # (B,) > 0 exactly where drafted (every rate is > 0)
        last = np.bincount(drafted, weights=survival[np.arange(batch), drafted - 1], minlength=self.max_draft + 1)
        growth = np.exp(cum[None, 1:] - cum[:, None]) * self._after  # (d, j): rates at positions d..j
        mean += last @ growth
        mean[:width] += survival.sum(axis=0)
        return mean / batch

    def estimate(self, logprobs: np.ndarray) -> np.ndarray:
        """`survival` without remembering anything: for the drafts so far, while drafting."""
        return self._survival(bin_of(logprobs))

    def keep_drafting(self, logprobs: np.ndarray, drafting: np.ndarray, times: np.ndarray, step: float) -> np.ndarray:
        """`goodput_keep_drafting` on the drafts so far (B, j), as `survival` will estimate them."""
        return goodput_keep_drafting(self.estimate(logprobs), drafting, times, step)

    def observe(self, logprobs: np.ndarray, windows: np.ndarray, accepted: np.ndarray) -> None:
        same = self._last is not None and np.array_equal(self._last[0], logprobs)  # the drafts `survival` saw
        self.calibration.update(self._last[1] if same else bin_of(logprobs), windows, accepted)

    def draft_length(self, batch_size: int, step_time) -> int:
        """K' for the next step: the whole cap until a step has been seen, then the best predicted one; after a run
        of plain decoding steps, one draft per request, to see whether drafting pays again."""
        if self.expected_survival is None:
            return self.max_draft
        if self._best is not None and self._best[0] == batch_size and self._best[1] is step_time:
            k_prime = self._best[2]  # nothing learned since (plain decoding steps): the same choice
        else:
            k_prime = best_draft_length(self.expected_survival, batch_size, step_time)
            self._best = batch_size, step_time, k_prime
        if k_prime:
            self._plain_steps, self._wait = 0, self.explore_after
            return k_prime
        self._plain_steps += 1
        if self._plain_steps < self._wait:
            return 0
        self._plain_steps, self._wait = 0, min(2 * self._wait, self.explore_most)
        return 1
