"""Goodput Tetris's choices, as pure functions over estimated survival and a step-cost model.

Per step: each request's draft length (0 = none; all 0: a plain decoding step, the draft does not run) before
drafting, from the survival its positions have had lately; after drafting, the capacity C from every draft's own
estimate. Both maximise expected emitted tokens per second of the whole step, B + (sum of the verified drafts'
survivals) over T_draft + T_target(B + C rows): the draft passes, each over the requests still drafting, and one
target pass, with both models' times by rows from this machine's profile (`spec.step_time.StepCost`). Survival of
draft j of request i = prod_{t<=j} P(accept | q[i, t]), the calibrated acceptance of earlier steps' outcomes
(`spec.calibration`): draft-side information only, so verification stays lossless whatever is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from batchspec.spec.calibration import EDGES, AcceptanceCalibration, bin_of
from batchspec.spec.policies.exploration import Exploration


def capacity_rates(survival: np.ndarray, times: np.ndarray) -> np.ndarray:
    """(B*K' + 1,) expected tokens per second when the target verifies the top-C drafts, C = 0, 1, ..., B*K'.

    survival (B, K'), non-increasing along K' (so the top-C set is prefix-closed per request); every request emits
    one token more than its accepted drafts, hence B. times: the step's seconds verifying C = 0, 1, ... drafts (the
    draft passes plus the target over B + C rows; at least B*K' + 1 of them).
    """
    ranked = np.sort(survival, axis=None)[::-1]  # (B*K',)
    expected = survival.shape[0] + np.concatenate([[0.0], np.cumsum(ranked)])
    return expected / times[:len(expected)]


def goodput_capacity(survival: np.ndarray, times: np.ndarray) -> int:
    """The C with the most expected tokens per second (the smallest on ties; 0 = verify nothing)."""
    return int(np.argmax(capacity_rates(survival, times)))


def padded_rows(columns: np.ndarray, batch_size: int) -> np.ndarray:
    """(N,) attention query rows the target pads when it verifies the first C = 1..N drafts of an order (`columns`:
    each draft's 0-based position): attention pads every request to the longest window + 1 (its (B, n_max) queries),
    B * (2 + the deepest position so far) against the B + C rows scored."""
    return batch_size * (np.maximum.accumulate(columns) + 1) - np.arange(1, len(columns) + 1)


def goodput_windows(survival: np.ndarray, times: np.ndarray, pad_s: float = 0.0) -> np.ndarray:
    """Windows (B,) of the top-C drafts by survival at the goodput-best C: one stable sort serves both.

    A stable sort of -survival in row-major order keeps each row's positions in order (survival is non-increasing
    along K'), so every prefix of it is prefix-closed per request, also under ties. pad_s: the target's seconds per
    padded attention row (`padded_rows`), added to times.
    """
    batch_size, k_prime = survival.shape
    flat = survival.reshape(-1)
    order = np.argsort(-flat, kind="stable")  # (B*K',)
    expected = np.cumsum(flat[order])
    expected += batch_size
    seconds = times[1:len(order) + 1]  # C = 1, ..., B*K'
    if pad_s:
        seconds = seconds + pad_s * padded_rows(order % k_prime, batch_size)
    rates = expected / seconds
    best = int(np.argmax(rates))
    capacity = best + 1 if rates[best] > batch_size / times[0] else 0  # C = 0 wins ties, as in `goodput_capacity`
    return np.bincount(order[:capacity] // k_prime, minlength=batch_size)


def smallest_step(times: np.ndarray) -> float:
    """min over C of T(C) - T(C - 1): the least time one more verified draft can add (0 with a staircase)."""
    return float(np.diff(times).min()) if len(times) > 1 else 0.0


def goodput_keep_drafting(survival: np.ndarray, drafting: np.ndarray, times: np.ndarray, step: float) -> np.ndarray:
    """Which of the requests still drafting may yet have a draft that `goodput_windows` verifies. (B,) bool.

    survival (B, j): every draft so far, 0 past the end of a request that stopped; times: the step's seconds by C;
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


def pass_times(step_time, rows: int) -> np.ndarray:
    """(rows + 1,) seconds of one draft pass over 0, 1, ..., rows rows (none: no pass). A step's first pass may run
    up to 2B rows for B requests (each drafting request's `lag` besides its own)."""
    table = getattr(step_time, "draft", None)
    if callable(table):  # a profiled table: every row count at once
        return np.concatenate([[0.0], np.asarray(table(np.arange(1, rows + 1)), dtype=float)])
    return np.array([0.0, *(float(step_time.draft_s(count, 1)) for count in range(1, rows + 1))])


def pass_rows(lengths: np.ndarray) -> np.ndarray:
    """(max(lengths),) requests in each draft pass that gives request i lengths[i] drafts: pass j runs over the
    requests with more than j."""
    return len(lengths) - np.cumsum(np.bincount(lengths, minlength=int(lengths.max(initial=0)) + 1))[:-1]


def drafting_time(lengths: np.ndarray, passes: np.ndarray, lag: np.ndarray | None = None) -> float:
    """Seconds of the draft passes that give request i lengths[i] drafts (`pass_rows`). passes: `pass_times`.
    lag (B,): rows each drafting request adds to the first pass (`goodput_plan`)."""
    rows = pass_rows(lengths)
    if lag is not None and rows.size:
        rows[0] += int(lag[lengths > 0].sum())
    return float(passes[rows].sum())


def goodput_draft_lengths(expected: np.ndarray, passes: np.ndarray, target: np.ndarray,
                          pad_s: float = 0.0, done: int = 0, spent: float = 0.0) -> np.ndarray:
    """Draft lengths (B,) for the most expected tokens per second of the step (`goodput_plan`). int64, 0 = none."""
    return goodput_plan(expected, passes, target, pad_s, done, spent)[0]


def goodput_plan(expected: np.ndarray, passes: np.ndarray, target: np.ndarray, pad_s: float = 0.0, done: int = 0,
                 spent: float = 0.0, allowed: np.ndarray | None = None, min_gain: float = 1.0,
                 lag: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """(draft lengths (B,), int64, 0 = none; their predicted tokens per second) for the most expected tokens per
    second of the step.

    expected (B, K): each request's predicted survival of positions 1..K, non-increasing along K; passes: one draft
    pass's seconds by rows (`pass_times`); target (B*K + 1,): the target's seconds over B + C rows, C = 0..B*K;
    pad_s: its seconds per padded attention row (`padded_rows`: uneven windows cost more than their rows).
    done, spent: while drafting (`Goodput.draft_on`), the `done` draft passes already made and their seconds: those
    passes cost nothing more, every plan pays `spent`, and lengths of at most `done` mean drafting stops now.
    allowed: (B,) bool, the requests that may draft (None: all); the others decode one token in the target's pass.
    min_gain: before drafting, a plan that drafts must predict at least this multiple of plain decoding's rate.
    lag: (B,) rows each request adds to the first draft pass if it drafts (before drafting; None: none): the tokens
    its draft cache lacks past its last token, 1 after a step that accepted every draft (the last draft and the
    target's token both still to run). Measured on the Qwen pair at batch 8 (AVX2 EPYC): the first pass ran 15-16
    rows in nearly every step, ~0.1 s a step more than the plans had priced (27.0 s of draft passes where the
    plans said 23.4).
    Two families of plans, the better predicted rate wins (before drafting, all zeros, a plain decoding step at
    B / target[0] tokens per second, when neither beats it):
    - per request: the top C predicted positions over the batch (prefix-closed per request, as in `goodput_windows`),
      each request drafting exactly its own and the target verifying them all; pass j then runs over only the
      requests with more than j drafts, so an easy request drafts long and a hard one short or not at all;
    - one K' for every request allowed, the target verifying the goodput-best C of their drafts (DSD's shape,
      Tetris's choice): more drafts than verified, so that the drafts themselves can decide.
    """
    batch, width = expected.shape
    if allowed is not None:
        expected = np.where(allowed[:, None], expected, 0.0)  # never verified, so never drafted per request
    flat = expected.reshape(-1)
    order = np.argsort(-flat, kind="stable")  # (B*K,) row positions in order: every prefix is prefix-closed
    columns = order % width
    # Rows of pass j once this entry is drafted: its own and those of the earlier entries at the same position (one
    # each, and at the first position each one's lag too).
    lagging = lag is not None and not done and bool(lag.any())
    at = columns[:, None] == np.arange(width)  # (B*K, K): each entry's position
    weight = 1
    if lagging:
        weight = np.where(columns == 0, 1 + lag[order // width], 1)  # (B*K,)
        at = at * weight[:, None]
    rows = np.cumsum(at, axis=0)[np.arange(len(order)), columns]
    added = passes[rows] - passes[rows - weight]
    if done:
        added *= columns >= done  # passes already made
    seconds = spent + np.cumsum(added) + target[1:len(order) + 1]
    if pad_s:
        seconds += pad_s * padded_rows(columns, batch)
    rates = (batch + np.cumsum(flat[order])) / seconds
    best = int(np.argmax(rates))
    lengths = np.zeros(batch, dtype=np.int64)
    plain = 0.0 if done else batch / float(target[0])  # the rate returned where no plan drafts
    best_rate = min_gain * plain  # 0 once drafting started: K' = done stops it
    if rates[best] > best_rate:
        lengths, best_rate = np.bincount(order[:best + 1] // width, minlength=batch), float(rates[best])
    drafters = batch if allowed is None else int(allowed.sum())
    if batch > 1 and drafters:  # one request: every plan of one K' is a prefix above, drafted at least as long
        lagged = 0.0
        if lagging:  # the first pass over the drafters' lags besides
            extra = int(lag.sum() if allowed is None else lag[allowed].sum())
            lagged = float(passes[drafters + extra] - passes[drafters])
        k_primes = np.arange(max(done, 1), width + 1)
        drafting_s = spent + lagged + (k_primes - done) * passes[drafters]  # (K',) the draft passes of each K'
        rates = uniform_rates(expected, order, drafting_s, k_primes, target, pad_s)
        pick = int(np.argmax(rates))
        if rates[pick] > best_rate:
            best_rate, k_prime = float(rates[pick]), int(k_primes[pick])
            lengths = (np.full(batch, k_prime, dtype=np.int64) if allowed is None
                       else np.where(allowed, k_prime, 0).astype(np.int64))
    return lengths, best_rate if lengths.any() else plain


def uniform_rates(expected: np.ndarray, order: np.ndarray, drafting_s: np.ndarray, k_primes: np.ndarray,
                  target: np.ndarray, pad_s: float = 0.0) -> np.ndarray:
    """(len(k_primes),) the predicted tokens per second of drafting K' for every request, for each K' of
    `k_primes`, the target verifying the goodput-best C of the drafts (`goodput_windows`; `capacity_rates` where
    pad_s is 0): all K' at once, every figure as those functions compute it.

    expected (B, K), order: the stable argsort of its negated entries in row-major order (`goodput_plan`'s); the
    K'-column prefix's own stable order is the entries of `order` in its first K' columns, in the same order.
    drafting_s (len(k_primes),): the seconds of each plan's draft passes, added to the target's over B + C rows.
    """
    batch, width = expected.shape
    columns = order % width
    values = expected.reshape(-1)[order]  # (N,) in the order entries are verified
    inside = columns < k_primes[:, None]  # (K', N): the entries a K'-column prefix has
    counts = np.cumsum(inside, axis=1)  # C once the entry is verified (where inside)
    plain = batch / (drafting_s + target[0])  # C = 0: every request emits one token
    tokens = np.cumsum(np.where(inside, values, 0.0), axis=1) + batch  # B + the survival verified so far
    seconds = drafting_s[:, None] + target[counts]
    if not pad_s:
        return np.maximum(plain, np.where(inside, tokens / seconds, -np.inf).max(axis=1))
    deepest = np.maximum.accumulate(np.where(inside, columns, 0), axis=1)
    seconds += pad_s * (batch * (deepest + 1) - counts)  # `padded_rows` of each prefix's order
    rates = np.where(inside, tokens / seconds, -np.inf)
    best = np.argmax(rates, axis=1)  # (K',) the entry of the first best C
    lines = np.arange(len(k_primes))
    capacity = np.where(rates[lines, best] > plain, counts[lines, best], 0)
    # Each request's window at that C and the rate `goodput_plan` prices it at, as for one K' at a time.
    verified = inside & (counts <= capacity[:, None])
    cells = lines[:, None] * batch + order // width  # (K', N): (K', request) of each entry, flattened
    windows = np.bincount(cells[verified], minlength=len(k_primes) * batch).reshape(len(k_primes), batch)
    prefix = np.concatenate([np.zeros((batch, 1)), np.cumsum(expected, axis=1)], axis=1)  # (B, K + 1)
    gained = prefix[np.arange(batch)[None, :], windows].sum(axis=1)  # (K',)
    return (batch + gained) / (drafting_s + target[capacity] + pad_s * (batch * windows.max(axis=1) - capacity))


def catch_up_pays(lengths: np.ndarray, expected: np.ndarray, rate: float, plain_rate: float, owed_s: np.ndarray,
                  remaining: np.ndarray) -> np.ndarray:
    """Which requests planned drafts are worth their draft's catch-up. (B,) bool.

    A request's draft cache lags by the tokens the draft has not run: its whole prompt until it first drafts, and
    the tokens emitted while it did not draft. The first draft pass runs them, `owed_s` seconds more, once; no step's
    plan sees that cost, and where speculation barely pays it outweighs what drafting gains (the SmolLM2 pair at
    batch 16: the draft's prefill of the prompts took more time than speculation saved the target). The plan gains
    1 / plain_rate - 1 / rate seconds per token the batch emits while it runs; a request's share of that is its part
    of the plan's expected accepted drafts (expected (B, K) survival, summed over its planned length), taken over
    the B x `remaining` tokens the batch emits while that request may still run. It pays if that covers `owed_s`.
    """
    drafting = lengths > 0
    accepted = np.where(np.arange(expected.shape[1]) < lengths[:, None], expected, 0.0).sum(axis=1)  # (B,)
    total = float(accepted.sum())
    if rate <= plain_rate or total <= 0.0:
        return np.zeros_like(drafting)
    saving = (1.0 / plain_rate - 1.0 / rate) * len(lengths) * accepted / total * remaining  # (B,) seconds
    return drafting & (saving >= owed_s)


class Goodput:
    """What goodput Tetris learns across steps: calibrated acceptance, and the survival each position has had lately,
    over the batch and for each request on its own."""

    explore_after = 8  # plain decoding steps before one draft is tried again (acceptance may have risen);
    explore_most = 64  # the wait doubles up to this while drafting keeps not paying
    near = 0.9  # ... unless one draft per request is predicted at least this fraction of plain decoding's rate
    # A step drafts only where its plan predicts this multiple of plain decoding's rate: the cost model's error. On the
    # Qwen pair at batch 8 (AVX2 EPYC, float32 target) the target's speculative passes ran 5-20 % over their
    # prediction after a run's worth of learning, and plans of one to three requests drafting, predicted at 1.001-1.05
    # of plain decoding, paid for draft passes and catch-ups that the target never gave back (0.90x `ar`).
    min_gain = 1.05
    # An exploration pays the catch-up of the requests it drafts for (a whole prompt before a request first drafts,
    # the tokens emitted since it last did): it explores with the requests cheapest to catch up, as many as fit in
    # this share of the plain steps run since the batch last drafted, and waits for more plain steps where none fits.
    # Exploring only with requests caught up trapped runs in plain decoding: after a few plain steps none is, and a
    # request that never drafted never is (the SmolLM2 pair at batch 1, Xeon: the second of two runs never drafted,
    # 841 target calls, `ar`'s, where sd ran 1.16x `ar`).
    explore_share = 0.125
    population_memory = 32  # requests whose estimates, as they left the batch, a new request's starting one averages
    stay_prior = 1.0  # pseudo-counts of a draft's bin following itself, before any are counted (`_growth_table`)

    def __init__(self, max_draft: int, decay: float = 0.8) -> None:
        self.max_draft = max_draft
        self.decay = decay
        self.calibration = AcceptanceCalibration()
        self.expected_survival: np.ndarray | None = None  # (max_draft,) recent mean survival per position
        self._requests: tuple = ()  # the requests of the last step, in row order
        self._own: np.ndarray = np.zeros((0, max_draft))  # (B, max_draft) each one's recent survival per position
        # (max_draft,) the mean of the estimates requests had when they left the batch (`population_memory` of the
        # latest), and how many have left: where a request seen for the first time starts.
        self._population: np.ndarray | None = None
        self._left = 0
        self._exploration = Exploration(after=self.explore_after, most=self.explore_most)
        self._plain_steps = 0  # steps planned to draft nothing since the batch last drafted (explorations included)
        self.exploring = False  # whether the last `draft_lengths` was an exploration (its drafts are all verified)
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # the last drafts' log q and their bins
        # (1 + bins, 1 + bins): how often a draft in bin c followed one in bin b, as `_growth_table` was last built
        # on, and those counted since (`_learn_transitions`); None until a step has drafted
        self._transitions: np.ndarray | None = None
        self._new_transitions: np.ndarray | None = None
        self._counted = self._new_counted = 0  # the pairs in each
        self._growth: tuple[np.ndarray, np.ndarray] | None = None  # (calibration rates, `_growth_table` on them)
        # ((requests, lags, drafts useful), costs, (lengths, rate)) of the last plan, until survival changes
        self._best: tuple | None = None

    def _survival(self, bins: np.ndarray) -> np.ndarray:
        # Bin 0 (-inf: not drafted, the request stopped early) has rate 0: survives nothing.
        return np.cumprod(self.calibration.rates[bins], axis=1)

    def survival(self, logprobs: np.ndarray, requests=None) -> np.ndarray:
        """(B, K') log q -> estimated P(drafts 1..j all accepted); also remembered per position, over the batch and
        per request (`requests`: an id per row, as for `draft_lengths`), for the next step's draft lengths."""
        bins = bin_of(logprobs)
        self._last = (logprobs, bins)  # for `observe`, which sees the same drafts
        survival = self._survival(bins)
        self._best = None
        full = np.count_nonzero(bins) == bins.size  # no bin 0: every request drafted every position of the step
        self._learn_transitions(bins, full)
        every = full and survival.shape[1] == self.max_draft
        if every:
            continued, drafted = survival, None
        else:
            continued = self._continued(survival, bins)  # (B, max_draft)
            drafted = survival[:, 0] > 0
            every = bool(drafted.all())
        if every or drafted.any():
            if self.expected_survival is None:
                self.expected_survival = (np.add.reduce(continued) / len(continued) if every
                                          else continued[drafted].mean(axis=0))
            elif every:  # the batch's mean survival per position, in as few calls as possible
                self.expected_survival *= self.decay
                self.expected_survival += np.add.reduce(continued) * ((1.0 - self.decay) / len(continued))
            else:
                self.expected_survival += (1.0 - self.decay) * (continued[drafted].mean(axis=0)
                                                                - self.expected_survival)
        if requests is not None and self.expected_survival is not None:
            # A request's own estimate: what its drafts survived, or, in a step it did not draft, the batch's (so a
            # request that stopped drafting is tried again once others show drafting pays).
            own = self._own_rows(tuple(requests))
            seen = continued if every else np.where(drafted[:, None], continued, self.expected_survival)
            own += (1.0 - self.decay) * (seen - own)
        return survival

    def _own_rows(self, requests: tuple) -> np.ndarray:
        """(B, max_draft) the requests' own estimates in row order. A request not seen before starts at the mean of
        the estimates that requests had when they left the batch (before any left: at the batch's recent one); one
        that left the batch is forgotten, its estimate kept in that mean.

        Starting at the batch's recent estimate made a run's start follow the previous run's end: on the SmolLM2 pair
        at batch 16 (greedy HumanEval, one engine, the second of two runs) the last steps' few long requests had
        left it at 0.57 for the first position, the new requests' catch-up did not pay on that, and the run drafted
        1,046 tokens in 216 target calls against 2,194 in 160 in the first (147 against 161 tokens/s)."""
        if requests != self._requests:
            index = {request: row for row, request in enumerate(self._requests)}
            kept = set(requests)
            for request, row in index.items():
                if request not in kept:
                    self._leaves(self._own[row])
            start = self.expected_survival if self._population is None else self._population
            own = np.tile(start, (len(requests), 1))
            for row, request in enumerate(requests):
                if request in index:
                    own[row] = self._own[index[request]]
            self._requests, self._own = requests, own
        return self._own

    def _leaves(self, own: np.ndarray) -> None:
        """A request's estimate joins the population's as it leaves the batch (a running mean, then an average of the
        latest `population_memory`)."""
        self._left += 1
        if self._population is None:
            self._population = own.copy()
        else:
            self._population += max(1.0 / self._left, 1.0 / self.population_memory) * (own - self._population)

    def _learn_transitions(self, bins: np.ndarray, full: bool = False) -> None:
        """Count, for each pair of consecutive drafts of a request, the calibration bin of the second under the bin of
        the first: what the drafts after a request's last one are likely to be like (`_continued`). full: no bin 0
        (every request drafted every position), the common case made cheap."""
        size = len(EDGES)  # the calibration's bins and bin 0
        if self._transitions is None:
            self._transitions, self._new_transitions = np.zeros((size, size)), np.zeros((size, size))
        if bins.shape[1] > 1:
            pairs = bins[:, :-1] * size + bins[:, 1:]
            if not full:
                pairs = pairs[(bins[:, :-1] > 0) & (bins[:, 1:] > 0)]  # bin 0: not drafted (the request stopped)
            self._new_transitions += np.bincount(pairs.ravel(), minlength=size * size).reshape(size, size)
            self._new_counted += pairs.size

    def _growth_table(self) -> np.ndarray:
        """(max_draft + 1, 1 + bins) G[n, b]: the expected product of the calibrated acceptance of the next n drafts
        after a draft in bin b, the bins following one another as counted (`_learn_transitions`; a bin never seen
        followed stays where it is: `stay_prior` pseudo-counts): G[n] = M G[n - 1], M[b, c] = P(c | b) P(accept | c).
        Kept until the calibration's rates are fitted again or the pairs counted since grow past its `refit_growth`
        share of those it was built on, as the rates themselves (built at every step, on the SmolLM2 pair at batch 1
        `select` took 690-884 us per step in the engine, 547-556 gated: the policy's numpy work runs on caches the
        forwards have just flushed, several times slower than in `benchmarks/selection_overhead.py`)."""
        rates = self.calibration.rates
        grown = self._new_counted > self.calibration.refit_growth * self._counted
        if self._growth is None or self._growth[0] is not rates or grown:
            if self._new_counted:
                self._transitions += self._new_transitions
                self._new_transitions[:] = 0.0
                self._counted, self._new_counted = self._counted + self._new_counted, 0
            counts = self._transitions + self.stay_prior * np.eye(len(rates))
            steps = counts / counts.sum(axis=1, keepdims=True) * rates  # (b, c)
            table = np.ones((self.max_draft + 1, len(rates)))
            for ahead in range(1, self.max_draft + 1):
                np.matmul(steps, table[ahead - 1], out=table[ahead])
            self._growth = rates, table
        return self._growth[1]

    def _continued(self, survival: np.ndarray, bins: np.ndarray) -> np.ndarray:
        """(B, max_draft) each request's survival (B, K') continued past its last draft (past K', or where it stopped
        drafting) by what drafts after one in its last draft's bin have been like (`_growth_table`); 0 for a request
        that drafted nothing. bins: the drafts' `bin_of`.

        Drafts of one request are alike: after a sure draft the next ones are mostly sure too. Continuing every
        request at the mean rate that drafts at each further position had lately (the batch's, by position) ignored
        that, and under-predicted survival past the drafts (`benchmarks/continuation_bias.py`: recorded sd steps,
        k = 7, greedy, 128 tokens; positions 2-7 predicted from the first draft): 0.79x the survival observed on the
        SmolLM2 pair (HumanEval, batch 16) and 0.81x on the Qwen pair (mixed set, batch 8), 0.70-0.74x from the
        third draft; following the bins, 1.00x and 1.02x (0.81x and 0.90x from the third), the mean squared error
        0.165 -> 0.159 and 0.178 -> 0.111. In goodput Tetris the re-plans between draft passes (`draft_on`) priced
        deeper drafts on those rates, so a run could settle on one draft per request: the Qwen pair, mixed set,
        batch 8, the engine's fourth run of four after sd's runs (an in-process replica of the bench loop) stopped
        every step after its first pass for 30 steps, where the plans made before drafting had three drafts each
        (132 target calls, 995 drafts against 103-111 and 1,220-1,257 in its other runs). Earlier forms: positions
        left at what an early step estimated kept K' at what it first chose (the Qwen pair at batch 4: positions 6-8
        at 0.56-0.49 from the prior, accepted ~0.99 of the time); each request continued at its own last draft's
        rate over-drafted where acceptance falls with depth (the SmolLM2 pair at batch 16: 3,234 drafts to 2,563,
        0.95x dsd)."""
        batch, width = survival.shape
        continued = np.zeros((batch, self.max_draft))
        continued[:, :width] = survival
        drafted = np.count_nonzero(survival, axis=1)  # (B,) > 0 exactly where drafted (every rate is > 0)
        if not drafted.any():  # nothing drafted (every log q -inf): nothing to continue
            return continued
        rows, last = np.arange(batch), np.maximum(drafted - 1, 0)
        positions = np.arange(self.max_draft)
        past = positions[None, :] > last[:, None]  # (B, max_draft) positions after the last draft
        ahead = (positions[None, :] - last[:, None]) * past  # drafts past the last one (0 where not past it)
        growth = self._growth_table()[ahead, bins[rows, last][:, None]]  # (B, max_draft)
        tail = survival[rows, last] * (drafted > 0)  # (B,)
        np.copyto(continued, tail[:, None] * growth, where=past)
        return continued

    def estimate(self, logprobs: np.ndarray) -> np.ndarray:
        """`survival` without remembering anything: for the drafts so far, while drafting."""
        return self._survival(bin_of(logprobs))

    def keep_drafting(self, logprobs: np.ndarray, drafting: np.ndarray, times: np.ndarray, step: float) -> np.ndarray:
        """`goodput_keep_drafting` on the drafts so far (B, j), as `survival` will estimate them."""
        if step <= 0.0:  # every request drafts on (`goodput_keep_drafting`): no estimate needed
            return drafting
        return goodput_keep_drafting(self.estimate(logprobs), drafting, times, step)

    def draft_on(self, logprobs: np.ndarray, drafting: np.ndarray, passes: np.ndarray, target: np.ndarray,
                 pad_s: float = 0.0) -> np.ndarray:
        """Which of the requests still drafting draft on, the step re-planned on the drafts so far (B, j): their own
        calibrated survival, continued past them as drafts after theirs have been (`_continued`), planned by
        `goodput_draft_lengths` with the j passes made already paid for. (B,) bool.

        What the drafts say overrides what earlier steps predicted: a request whose first drafts the draft model
        was unsure of stops, where the plan made before drafting had it draft on. Measured on the SmolLM2 pair
        (greedy HumanEval, 128 tokens, one run each, tetris over the best of ar, sd, dsd): batch 1 0.967 -> 1.020,
        batch 8 0.972 -> 1.001 (fewer verification steps: 383 vs 423 and 233 vs 244)."""
        if self._transitions is None:  # nothing learned yet: draft the plan
            return drafting
        done = logprobs.shape[1]
        bins = bin_of(logprobs)
        survival = self._survival(bins)  # (B, j), 0 past the end of a request that stopped
        made = np.count_nonzero(logprobs > -np.inf, axis=1)  # (B,) drafts each request made
        # Continued past its drafts while drafting; a request that stopped drafts nothing more.
        expected = self._continued(survival, bins)  # (B, max_draft)
        expected[np.arange(self.max_draft) >= np.where(drafting, self.max_draft, made)[:, None]] = 0.0
        lengths = goodput_draft_lengths(expected, passes, target, pad_s, done, drafting_time(made, passes))
        return drafting & (lengths > done)

    def observe(self, logprobs: np.ndarray, windows: np.ndarray, accepted: np.ndarray) -> None:
        seen = None if self._last is None else self._last[0]
        same = seen is logprobs or seen is not None and np.array_equal(seen, logprobs)  # the drafts `survival` saw
        bins = self._last[1] if same else bin_of(logprobs)
        self.calibration.update(bins, windows, accepted)

    def draft_lengths(self, requests: tuple, passes: np.ndarray, target: np.ndarray, pad_s: float = 0.0,
                      catch_up: CatchUp | None = None, useful: np.ndarray | None = None) -> np.ndarray:
        """Draft lengths (B,) for the next step (`goodput_plan` on each request's own estimate): the whole cap until a
        step has been seen; after a run of plain decoding steps, one draft per request, to see whether drafting pays
        again. passes, target, pad_s: the step's costs, as `goodput_plan` takes them.

        With `catch_up` a request drafts only where its draft's catch-up pays (`catch_up_pays`), judged on the plan
        it drafts in: the plan is made again without the others, and again, until every request left drafting pays
        for itself in it (the gain of a plan where all draft is not there when only a few do: measured on the Qwen
        pair at batch 8, one or two requests of eight drafting paid their catch-up and a draft pass each for
        windows of 1-4, 0.91x `ar`); the first step drafts only for the requests cheapest to catch up (already caught
        up, else the one with the fewest tokens to run), and explorations only for the requests whose catch-ups fit in
        `explore_share` of the plain steps since the batch last drafted (`CatchUp.affordable`): what they learn
        decides for the rest, before anyone else pays for a prompt (on the SmolLM2 pair at batch 16, where
        speculation does not pay, an exploration by a request that never drafted ran its prompt and output so far
        through the draft: 0.2-0.4 s by the draft's profile, against 0.1 s per plain step).

        useful: (B,) the most drafts each request can still use (None: any number), its tokens left to emit less the
        one every step emits: the positions past it are worth nothing to the plan, and no request drafts past it.
        Drafting on, a request's last step drafted and verified tokens it would never emit: on the Qwen pair at
        batch 1 (8 HumanEval prompts, 128 tokens, one engine each way in turn, three runs) 902-916 drafts against
        935-967 in the same 84-92 target calls, 1.077x the tokens per second (median; 0.968-1.212)."""
        if useful is not None and int(useful.min()) >= self.max_draft:
            useful = None  # no limit this step (and the same plan as the last step's where nothing was learned)
        lengths = self._draft_lengths(requests, passes, target, pad_s, catch_up, useful)
        return lengths if useful is None else np.minimum(lengths, useful)

    def _draft_lengths(self, requests: tuple, passes: np.ndarray, target: np.ndarray, pad_s: float,
                       catch_up: CatchUp | None, useful: np.ndarray | None) -> np.ndarray:
        self.exploring = False
        batch = len(requests)
        if self.expected_survival is None:
            if catch_up is None:
                return np.full(batch, self.max_draft, dtype=np.int64)
            return np.where(catch_up.cheapest(), self.max_draft, 0).astype(np.int64)
        own = self._own_rows(requests)
        if useful is not None:
            own = np.where(np.arange(self.max_draft) < useful[:, None], own, 0.0)  # a copy: the estimates stay
        lag = None if catch_up is None else catch_up.lag
        key = requests, None if lag is None else lag.tobytes(), None if useful is None else useful.tobytes()
        if self._best is not None and self._best[0] == key and self._best[1] is target:
            lengths, rate = self._best[2]  # nothing learned since (plain decoding steps): the same choice
        else:
            lengths, rate = goodput_plan(own, passes, target, pad_s, min_gain=self.min_gain, lag=lag)
            self._best = key, target, (lengths, rate)
        while catch_up is not None and lengths.any():  # the drafting requests shrink until each one's catch-up pays
            owed = catch_up.seconds(int(np.count_nonzero(lengths)), catch_up.tokens)
            pays = catch_up_pays(lengths, own, rate, batch / float(target[0]), owed, catch_up.remaining)
            if np.array_equal(pays, lengths > 0):
                break
            lengths, rate = goodput_plan(own, passes, target, pad_s, allowed=pays, min_gain=self.min_gain, lag=lag)
        if lengths.any():
            self._exploration.drafted()
            self._plain_steps = 0
            return lengths
        self._plain_steps += 1

        def near() -> bool:  # one draft per request predicted within `near` of plain decoding's rate
            one_each = (batch + float(own[:, 0].sum())) / (passes[batch] + target[batch])
            return one_each >= self.near * batch / target[0]

        if not self._exploration.explores(near):
            return lengths
        explorers = (np.ones(batch, dtype=bool) if catch_up is None
                     else catch_up.affordable(self.explore_share * self._plain_steps * float(target[0])))
        if not explorers.any():  # no catch-up fits yet: a later exploration will have waited longer
            return lengths
        self._plain_steps = 0
        self.exploring = True
        return explorers.astype(np.int64)


@dataclass(frozen=True)
class CatchUp:
    """What each request's draft cache lacks, and how long the request may still run: `Goodput.draft_lengths` weighs
    paying for the first against what drafting gains over the second.

    A request at most `CAUGHT_UP` token behind is caught up: that token rides in every step's first draft pass (the
    plan's `lag`), where a longer catch-up is paid once (`catch_up_pays`)."""

    tokens: np.ndarray  # (B,) tokens the draft has not run beyond the one every pass runs (a whole prompt at first)
    remaining: np.ndarray  # (B,) tokens each request may still emit
    seconds: Callable[[int, np.ndarray], np.ndarray]  # (requests drafting, tokens) -> (B,) seconds they add

    CAUGHT_UP: ClassVar[int] = 1

    @cached_property
    def lag(self) -> np.ndarray:
        """(B,) the rows each request adds to a step's first draft pass (`goodput_plan`'s lag): at most `CAUGHT_UP`."""
        return np.minimum(self.tokens, self.CAUGHT_UP)

    def affordable(self, budget: float) -> np.ndarray:
        """(B,) bool: the most requests, cheapest to catch up first, whose catch-ups together take at most `budget`
        seconds (a request caught up costs nothing: every draft pass runs its token)."""
        order = np.argsort(self.tokens, kind="stable")
        chosen = np.zeros(len(order), dtype=bool)
        for count in range(len(order), 0, -1):
            tokens = self.tokens[order[:count]]
            owed = np.where(tokens <= self.CAUGHT_UP, 0.0, self.seconds(count, tokens))
            if float(owed.sum()) <= budget:
                chosen[order[:count]] = True
                break
        return chosen

    def cheapest(self) -> np.ndarray:
        """(B,) bool: the requests caught up already, else the ones with the fewest tokens to run."""
        return self.tokens <= max(self.CAUGHT_UP, int(self.tokens.min()))
