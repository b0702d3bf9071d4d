"""Calibrated acceptance: P(the target accepts a draft | its draft probability q), learned from past verifications.

Tetris ranks drafts by cumulative log q, a proxy for the probability that a window prefix survives. Choosing *how
many* drafts to verify (goodput Tetris) needs the probability itself: a draft the model is 90 % sure of may be
accepted 97 % of the time on one pair and 60 % on another. The estimate here is a histogram over q: per bin, the
verified drafts that were reached (every draft before them accepted) and those accepted, plus a prior of
`prior_strength` pseudo-observations at rate q (what a draft that agrees with the target in distribution would
get), made monotone in q by pooling adjacent violators. It reads only the outcomes of earlier steps, never the
current step's target output, so a selection that uses it is still draft-side only: verification stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, cached_property

import numpy as np

# Bin edges over q: finer near 1, where a good draft's proposals concentrate and survival compounds.
EDGES = np.array([0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995, 1.0])
with np.errstate(divide="ignore"):
    _LOG_EDGES = np.log(EDGES[:-1])  # -inf, then the inner edges: bins are found on log q directly, no exp per draft
_MIDDLES = ((EDGES[:-1] + EDGES[1:]) / 2).tolist()  # the prior's rate in each bin


@dataclass
class AcceptanceCalibration:
    prior_strength: float = 4.0  # pseudo-observations per bin at rate q, before any data
    reached: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES) - 1))  # (bins,)
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES) - 1))  # (bins,)
    # The rates are fitted again once the evidence (reached drafts) has grown by this fraction since the last fit:
    # a step adds ~1 % of it after the first hundred steps, and the fit is a fifth of goodput Tetris's selection time.
    refit_growth: float = 0.02
    # The reached drafts counted so far, and those the rates were last fitted on.
    _evidence: float = field(default=0.0, init=False, repr=False, compare=False)
    _fitted_on: float = field(default=0.0, init=False, repr=False, compare=False)

    def update(self, bins: np.ndarray, windows: np.ndarray, accepted: np.ndarray) -> None:
        """Count one verification: the bins of its drafts (B, K') (`bin_of`), windows l (B,), accepted drafts (B,).

        Draft j (0-based) of request i was reached iff j < min(l_i, accepted_i + 1): every draft before it passed.
        Only reached drafts say anything about P(accept | q): the others were never tested on their own. The rates
        follow at the next estimate, or, past the first steps, once `refit_growth` more evidence has come in.
        """
        prefixes = _prefixes(bins.shape[1])  # (K' + 1, K'): row n is True on the first n positions
        reached = prefixes[np.minimum(windows, accepted + 1)]  # (B, K')
        passed = prefixes[accepted]  # (B, K'), a subset of reached (accepted <= l)
        size = len(self.reached) + 1  # bin 0 (not a draft) is counted, then dropped
        self.reached += np.bincount(bins[reached], minlength=size)[1:]
        self.accepted += np.bincount(bins[passed], minlength=size)[1:]
        self._evidence += np.count_nonzero(reached)
        if self._evidence - self._fitted_on >= self.refit_growth * self._fitted_on:
            self.__dict__.pop("rates", None)  # fitted again at the next estimate

    @cached_property
    def rates(self) -> np.ndarray:
        """(1 + bins,) P(accept) by `bin_of`: 0 for bin 0 (not a draft), then posterior means, non-decreasing in q.

        Fitted after updates (`refit_growth`), on 14 plain floats (numpy's per-call cost would dominate)."""
        self._fitted_on = self._evidence
        strength = self.prior_strength
        weights = [reached + strength for reached in self.reached.tolist()]
        means = [(accepted + strength * middle) / weight
                 for accepted, middle, weight in zip(self.accepted.tolist(), _MIDDLES, weights)]
        return np.array([0.0, *_isotonic(means, weights)])

    def estimate(self, logq: np.ndarray) -> np.ndarray:
        """P(accept) of each draft by its log q, of any shape -> the same shape, in [0, 1]."""
        return self.rates[bin_of(logq)]


@cache
def _prefixes(width: int) -> np.ndarray:
    """(width + 1, width) bool: row n marks positions 0..n-1 (a prefix mask per length, by indexing)."""
    prefixes = np.arange(width)[None, :] < np.arange(width + 1)[:, None]
    prefixes.flags.writeable = False  # shared by every caller
    return prefixes


def bin_of(logq: np.ndarray) -> np.ndarray:
    """1 + the bin of each draft's q, by its log q; 0 for no draft (log q = -inf, or NaN). q on an edge belongs to the
    bin below it; log q >= 0 goes to the last bin."""
    return np.searchsorted(_LOG_EDGES, np.fmax(logq, -np.inf), side="left")  # fmax: NaN -> -inf


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    if all(low <= high for low, high in zip(values, values[1:])):  # the usual case once data agrees with q
        return values
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, count2 = blocks.pop()
            mean1, weight1, count1 = blocks.pop()
            total = weight1 + weight2
            blocks.append([(mean1 * weight1 + mean2 * weight2) / total, total, count1 + count2])
    return [mean for mean, _, count in blocks for _ in range(count)]
