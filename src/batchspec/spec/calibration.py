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
from functools import cached_property

import numpy as np

# Bin edges over q: finer near 1, where a good draft's proposals concentrate and survival compounds.
EDGES = np.array([0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995, 1.0])


@dataclass
class AcceptanceCalibration:
    prior_strength: float = 4.0  # pseudo-observations per bin at rate q, before any data
    reached: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES) - 1))  # (bins,)
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(len(EDGES) - 1))  # (bins,)

    def update(self, q: np.ndarray, windows: np.ndarray, accepted: np.ndarray, bins: np.ndarray | None = None) -> None:
        """Count one verification: q (B, K') draft probabilities, windows l (B,), accepted drafts (B,); `bins`: q's
        bins when the caller has them already (`bin_of`).

        Draft j (0-based) of request i was reached iff j < min(l_i, accepted_i + 1): every draft before it passed.
        Only reached drafts say anything about P(accept | q): the others were never tested on their own.
        """
        positions = np.arange(q.shape[1])[None, :]  # (1, K')
        reached = positions < np.minimum(windows, accepted + 1)[:, None]  # (B, K')
        passed = positions < accepted[:, None]  # (B, K'), a subset of reached (accepted <= l)
        bins = bin_of(q) if bins is None else bins
        self.reached += np.bincount(bins[reached], minlength=len(self.reached))
        self.accepted += np.bincount(bins[passed], minlength=len(self.accepted))
        self.__dict__.pop("rates", None)  # recomputed on the next estimate

    @cached_property
    def rates(self) -> np.ndarray:
        """(bins,) P(accept) per bin of q: posterior means, non-decreasing in q."""
        middle = (EDGES[:-1] + EDGES[1:]) / 2
        rates = (self.accepted + self.prior_strength * middle) / (self.reached + self.prior_strength)
        return _isotonic(rates, self.reached + self.prior_strength)

    def estimate(self, q: np.ndarray) -> np.ndarray:
        """P(accept) of each draft, q of any shape -> the same shape, in [0, 1]."""
        return self.rates[bin_of(q)]


def bin_of(q: np.ndarray) -> np.ndarray:
    """Bin index of each q (NaN and q <= 0 go to the first bin, q >= 1 to the last)."""
    # NaN sorts after every edge in searchsorted: map it to 0 first.
    q = np.where(np.isnan(q), 0.0, q)
    return np.clip(np.searchsorted(EDGES, q, side="right") - 1, 0, len(EDGES) - 2)


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators). (n,) -> (n,)."""
    if np.all(np.diff(values) >= 0):  # the usual case once data agrees with q: nothing to pool
        return values
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(values.tolist(), weights.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, count2 = blocks.pop()
            mean1, weight1, count1 = blocks.pop()
            total = weight1 + weight2
            blocks.append([(mean1 * weight1 + mean2 * weight2) / total, total, count1 + count2])
    return np.array([mean for mean, _, count in blocks for _ in range(count)])
