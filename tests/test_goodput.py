"""Goodput Tetris's pure parts: calibrated acceptance (monotone, converges to the true rate) and the capacity that
maximises expected tokens per second (equal to brute force over every C and every prefix-closed selection)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec.errors import BatchspecError
from batchspec.spec.calibration import EDGES, AcceptanceCalibration, bin_of
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies import make_policy
from batchspec.spec.policies.exploration import Exploration
from batchspec.spec.policies.goodput import (CatchUp, Goodput, capacity_rates, catch_up_pays, drafting_time,
                                             goodput_capacity, goodput_draft_lengths, goodput_plan, goodput_windows,
                                             padded_rows, pass_times, smallest_step, uniform_rates)
from batchspec.spec.policies.tetris import _top_capacity_windows
from batchspec.spec.proposal import replay_drafting, undrafted
from batchspec.spec.step_time import RowTimeTable, StepCost, StepTimeModel


def _brute_force_rate(survival: np.ndarray, seconds) -> float:
    """Best expected tokens per second over every window assignment (each request: a prefix of its drafts)."""
    batch, width = survival.shape
    best = 0.0
    for windows in itertools.product(range(width + 1), repeat=batch):
        chosen = sum(int(w) for w in windows)
        expected = batch + sum(survival[i, :w].sum() for i, w in enumerate(windows))
        best = max(best, expected / float(seconds(np.array([chosen]))[0]))
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 10_000), st.floats(0.0, 0.5), st.integers(1, 4))
def test_goodput_capacity_equals_brute_force(batch, width, seed, per_row, step_rows):
    rng = np.random.default_rng(seed)
    survival = np.cumprod(rng.uniform(0.0, 1.0, (batch, width)), axis=1)  # non-increasing along K'
    table = RowTimeTable(tuple(range(1, 16)), tuple(1.0 + per_row * ((r + step_rows - 1) // step_rows)
                                                   for r in range(1, 16)))  # a staircase in the rows

    def seconds(capacity):
        return 0.2 + table(batch + capacity)

    times = seconds(np.arange(batch * width + 1))
    capacity = goodput_capacity(survival, times)
    windows = goodput_windows(survival, times)
    assert windows.sum() == capacity
    assert windows.tolist() == _top_capacity_windows(torch.from_numpy(survival), capacity).tolist()
    rate = (batch + sum(survival[i, :w].sum() for i, w in enumerate(windows))) / float(seconds(np.array([capacity]))[0])
    assert abs(rate - _brute_force_rate(survival, seconds)) < 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 10_000), st.floats(0.0, 0.5), st.floats(0.0, 0.2))
def test_padded_attention_rows_are_priced_in_the_capacity(batch, width, seed, per_row, pad_s):
    """With uneven windows padded to the longest, the windows are still the top-C prefix with the most expected
    tokens per second, each C priced with its padded rows."""
    rng = np.random.default_rng(seed)
    survival = np.cumprod(rng.uniform(0.0, 1.0, (batch, width)), axis=1)
    times = 1.0 + per_row * np.arange(batch * width + 1)
    windows = goodput_windows(survival, times, pad_s)

    def rate(capacity):
        chosen = _top_capacity_windows(torch.from_numpy(survival), capacity).numpy()
        padded = batch * int(chosen.max()) - capacity if capacity else 0
        return (batch + sum(survival[i, :w].sum() for i, w in enumerate(chosen))) / (times[capacity] + pad_s * padded)

    assert rate(int(windows.sum())) >= max(rate(c) for c in range(batch * width + 1)) - 1e-12
    assert windows.tolist() == _top_capacity_windows(torch.from_numpy(survival), int(windows.sum())).tolist()


def test_padded_rows_count_attention_padding():
    # B = 3: windows 0, 0, 0 -> 1, 0, 0 (1 padded row each for two requests) -> 2, 0, 0 (4) -> 2, 1, 0 (3)
    assert padded_rows(np.array([0, 1, 0]), 3).tolist() == [2, 4, 3]


def test_free_verification_takes_everything_and_costly_takes_nothing():
    survival = np.cumprod(np.full((2, 3), 0.9), axis=1)
    assert goodput_capacity(survival, np.ones(7)) == 6  # every draft adds tokens
    assert goodput_capacity(survival, 1.0 + 10.0 * np.arange(7)) == 0  # a plain decoding step


def test_calibration_starts_at_the_prior_and_is_monotone():
    calibration = AcceptanceCalibration()
    with np.errstate(divide="ignore"):
        q = np.log(np.linspace(0.0, 1.0, 101))  # log q, as drafts carry it
    before = calibration.estimate(q)
    assert np.all(np.diff(before) >= 0) and before[0] < 0.05 and before[-1] > 0.95
    rng = np.random.default_rng(0)
    for _ in range(50):  # outcomes that contradict the ordering: low q accepted more than high q
        drafts = rng.uniform(0.0, 1.0, (8, 4))
        accepted = (rng.uniform(size=8) < 0.5).astype(int) * 4
        calibration.update(bin_of(np.log(drafts[:, ::-1])), np.full(8, 4), accepted)
    assert np.all(np.diff(calibration.estimate(q)) >= -1e-12)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 1000))
def test_calibration_converges_to_the_true_rate(rate, seed):
    """Drafts whose q says 0.9 but that pass with probability `rate`, one position each, in cascade."""
    rng = np.random.default_rng(seed)
    calibration = AcceptanceCalibration()
    for _ in range(200):
        q = np.full((16, 3), 0.9)
        passes = rng.uniform(size=(16, 3)) < rate
        accepted = np.cumprod(passes, axis=1).sum(axis=1)  # drafts accepted before the first rejection
        calibration.update(bin_of(np.log(q)), np.full(16, 3), accepted)
    assert abs(float(calibration.estimate(np.log([0.9]))[0]) - rate) < 0.05


def test_calibration_refits_once_the_evidence_grows():
    """The rates follow every update at first, then once `refit_growth` more reached drafts have come in: never
    further from a fit on all the evidence than that fraction of it."""
    calibration = AcceptanceCalibration()
    sure = bin_of(np.log(np.full((1, 1), 0.97)))

    def estimate() -> float:
        return float(calibration.estimate(np.log([0.97]))[0])

    calibration.update(sure, np.array([1]), np.array([0]))  # the first outcome moves the estimate at once
    first = estimate()
    assert first < 0.97 - 0.1
    for _ in range(199):  # 200 reached drafts, all rejected
        calibration.update(sure, np.array([1]), np.array([0]))
        estimate()
    changes, last = 0, estimate()
    for _ in range(20):  # 20 more, all accepted: the estimate moves every ~2 % (4 drafts), never lags more
        calibration.update(sure, np.array([1]), np.array([1]))
        now = estimate()
        changes += now != last
        assert now >= last
        last = now
    assert 4 <= changes <= 6 and last < first


def test_only_reached_drafts_count():
    calibration = AcceptanceCalibration()
    half = bin_of(np.log(np.array([[0.5, 0.5, 0.5]])))
    calibration.update(half, np.array([3]), np.array([0]))  # the first rejected
    assert calibration.reached.sum() == 1 and calibration.accepted.sum() == 0
    calibration.update(half, np.array([2]), np.array([2]))  # window 2, both accepted
    assert calibration.reached.sum() == 3 and calibration.accepted.sum() == 2
    assert len(calibration.reached) == len(EDGES) - 1


def _cost(draft_step: float, per_row: float) -> StepCost:
    return StepCost(StepTimeModel(0.0, draft_step, 0.0, 0.0), RowTimeTable((1, 200), (1.0, 1.0 + 199 * per_row)),
                    RowTimeTable((1, 200), (draft_step, draft_step)))


def _costs(cost: StepCost, batch: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`goodput_draft_lengths`' costs: a draft pass by rows (to 2B, as `TetrisPolicy` gives them), the target over B + C
    rows."""
    return pass_times(cost, 2 * batch), np.asarray(cost.target_s(batch + np.arange(batch * width + 1)), dtype=float)


def _lengths(survival: np.ndarray, batch: int, cost: StepCost) -> list[int]:
    return goodput_draft_lengths(np.tile(survival, (batch, 1)), *_costs(cost, batch, len(survival))).tolist()


def test_draft_lengths_draft_when_it_pays_and_not_otherwise():
    survival = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert _lengths(survival, 4, _cost(draft_step=0.01, per_row=0.001)) == [6] * 4  # cheap: draft the cap
    assert _lengths(survival, 4, _cost(draft_step=5.0, per_row=0.001)) == [0] * 4  # drafting costs too much
    assert _lengths(survival, 4, _cost(draft_step=0.01, per_row=1.0)) == [0] * 4  # verified rows cost too much
    assert _lengths(survival, 4, _cost(draft_step=0.3, per_row=0.05)) == [3] * 4  # in between


def _plan_rate(expected: np.ndarray, lengths: np.ndarray, passes: np.ndarray, target: np.ndarray,
               lag: np.ndarray | None = None) -> float:
    """Predicted tokens per second of drafting `lengths` and verifying every draft; for one K' for all, the best of
    that and of verifying only the goodput-best C of them (`goodput_draft_lengths`' two families). lag: rows each
    drafting request adds to the first pass."""
    batch = len(lengths)
    gained = sum(expected[i, :n].sum() for i, n in enumerate(lengths))
    rate = (batch + gained) / (drafting_time(lengths, passes, lag) + target[int(lengths.sum())])
    if lengths.min() == lengths.max() and lengths[0] > 0:
        k_prime = int(lengths[0])
        first = passes[batch] if lag is None else passes[batch + int(lag.sum())]
        rate = max(rate, float(capacity_rates(expected[:, :k_prime],
                                              first + (k_prime - 1) * passes[batch] + target).max()))
    return rate


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 10_000), st.floats(0.0, 0.3), st.floats(0.0, 0.2),
       st.floats(0.0, 0.2), st.integers(1, 4), st.booleans())
def test_draft_lengths_are_the_best_plan(batch, width, seed, per_draft, pass_fixed, per_row, step_rows, lagging):
    """Request by request, never predicted worse than any one K' for all, also with requests lagging a token (their
    first pass runs two rows: `goodput_plan`'s lag), the plan's rate priced with it; with a draft pass costing the
    same per row (no fixed part) and no lag, the best of every assignment of lengths (brute force), whatever the
    target's staircase."""
    rng = np.random.default_rng(seed)
    expected = np.cumprod(rng.uniform(0.0, 1.0, (batch, width)) ** rng.uniform(0.2, 3.0, (batch, 1)), axis=1)
    passes = np.array([0.0, *(pass_fixed + per_draft * rows for rows in range(1, 2 * batch + 1))])
    target = 1.0 + per_row * ((batch + np.arange(batch * width + 1) + step_rows - 1) // step_rows)
    lag = rng.integers(0, 2, batch) if lagging else None
    lengths, rate = goodput_plan(expected, passes, target, lag=lag)
    chosen = _plan_rate(expected, lengths, passes, target, lag) if lengths.any() else batch / target[0]
    assert rate == pytest.approx(chosen, rel=1e-9)  # the rate it reports is the plan's, lag included
    for k_prime in range(1, width + 1):
        assert chosen >= _plan_rate(expected, np.full(batch, k_prime), passes, target, lag) - 1e-12
    if pass_fixed == 0.0 and not lagging:
        for plan in itertools.product(range(width + 1), repeat=batch):
            plan = np.array(plan)
            assert chosen >= (_plan_rate(expected, plan, passes, target) if plan.any() else batch / target[0]) - 1e-12


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(2, 4), st.integers(0, 10_000), st.floats(0.0, 0.3), st.floats(0.0, 0.2),
       st.floats(0.0, 0.2), st.integers(1, 4))
def test_a_plan_made_while_drafting_prices_only_the_passes_to_come(batch, width, seed, per_draft, pass_fixed,
                                                                    per_row, step_rows):
    """With `done` passes made (`spent` seconds), every plan pays `spent` and only the passes after `done`: the
    chosen lengths are predicted at least as good as stopping now (the goodput-best C of the drafts made) and as
    every one K' >= done for all."""
    rng = np.random.default_rng(seed)
    expected = np.cumprod(rng.uniform(0.0, 1.0, (batch, width)) ** rng.uniform(0.2, 3.0, (batch, 1)), axis=1)
    passes = np.array([0.0, *(pass_fixed + per_draft * rows for rows in range(1, batch + 1))])
    target = 1.0 + per_row * ((batch + np.arange(batch * width + 1) + step_rows - 1) // step_rows)
    done = int(rng.integers(1, width))
    spent = done * float(passes[batch])

    def rate(lengths: np.ndarray) -> float:
        """Verify every planned draft, passes past `done` priced; one K' for all may verify only the goodput-best C
        of its drafts instead (`goodput_draft_lengths`' second family)."""
        more = np.maximum(lengths - done, 0)
        gained = sum(expected[i, :n].sum() for i, n in enumerate(lengths))
        every = (batch + gained) / (spent + drafting_time(more, passes) + target[int(lengths.sum())])
        if lengths.min() == lengths.max() > done:
            k_prime = int(lengths[0])
            return max(every, float(capacity_rates(expected[:, :k_prime],
                                                   spent + (k_prime - done) * passes[batch] + target).max()))
        return every

    lengths = goodput_draft_lengths(expected, passes, target, done=done, spent=spent)
    stop_now = float(capacity_rates(expected[:, :done], spent + target).max())
    chosen = max(rate(lengths), stop_now) if lengths.max() <= done else rate(lengths)
    assert chosen >= stop_now - 1e-12
    for k_prime in range(done, width + 1):
        assert chosen >= float(capacity_rates(expected[:, :k_prime],
                                              spent + (k_prime - done) * passes[batch] + target).max()) - 1e-12
    # Before drafting (done = 0, nothing spent) the plan is the one made without the arguments.
    assert goodput_draft_lengths(expected, passes, target, done=0, spent=0.0).tolist() == \
        goodput_draft_lengths(expected, passes, target).tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 3), st.integers(1, 3), st.integers(0, 10_000), st.floats(0.0, 0.3), st.floats(0.0, 0.2),
       st.integers(1, 4))
def test_a_plan_drafts_only_for_the_requests_allowed_and_is_the_best_of_those(batch, width, seed, per_draft, per_row,
                                                                             step_rows):
    """`allowed` rows never draft (their token still costs a target row), and the plan is predicted at least as good
    as every assignment of lengths to the others (brute force) and as one K' for all of them; its rate is the one
    returned."""
    rng = np.random.default_rng(seed)
    expected = np.cumprod(rng.uniform(0.0, 1.0, (batch, width)) ** rng.uniform(0.2, 3.0, (batch, 1)), axis=1)
    allowed = rng.uniform(size=batch) < 0.6
    passes = np.array([0.0, *(per_draft * rows for rows in range(1, batch + 1))])
    target = 1.0 + per_row * ((batch + np.arange(batch * width + 1) + step_rows - 1) // step_rows)
    lengths, rate = goodput_plan(expected, passes, target, allowed=allowed)
    assert not lengths[~allowed].any()
    chosen = _plan_rate(expected, lengths, passes, target) if lengths.any() else batch / target[0]
    drafters = int(allowed.sum())
    for k_prime in range(1, width + 1):
        if drafters:
            one_each = np.where(allowed[:, None], expected[:, :k_prime], 0.0)
            rate_k = float(capacity_rates(one_each, k_prime * passes[drafters] + target).max())
            assert rate >= rate_k - 1e-12
    for plan in itertools.product(range(width + 1), repeat=batch):
        plan = np.array(plan)
        if not plan[~allowed].any():
            assert rate >= (_plan_rate(expected, plan, passes, target) if plan.any() else batch / target[0]) - 1e-12
    assert rate >= chosen - 1e-12


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(0, 10_000), st.sampled_from([0.0, 0.004, 0.02]),
       st.integers(0, 3), st.booleans())
def test_every_uniform_k_is_rated_at_once_as_one_at_a_time(batch, width, seed, pad_s, done, staircase):
    """`uniform_rates` gives, for every K' together, bit for bit the rate of drafting K' for every request that
    `goodput_windows` (or `capacity_rates` without padding) gives one K' at a time, ties and zero survival
    included."""
    rng = np.random.default_rng(seed)
    # Rounded to tenths: many ties, across requests and positions; zeros as for requests not allowed to draft.
    expected = np.round(np.cumprod(rng.uniform(0.0, 1.0, (batch, width)), axis=1), 1)
    expected[rng.uniform(size=batch) < 0.2] = 0.0
    rows = np.arange(batch * width + 1)
    target = 0.05 + (0.02 * (rows // 4) if staircase else rng.uniform(0.001, 0.01) * rows)
    passes_s = rng.uniform(0.0, 0.02)
    done = min(done, width - 1)
    k_primes = np.arange(max(done, 1), width + 1)
    drafting_s = 0.003 + (k_primes - done) * passes_s
    order = np.argsort(-expected.reshape(-1), kind="stable")
    prefix = np.concatenate([np.zeros((batch, 1)), np.cumsum(expected, axis=1)], axis=1)
    one_at_a_time = []
    for k_prime, drafting in zip(k_primes, drafting_s):
        times = drafting + target
        if pad_s:
            windows = goodput_windows(expected[:, :k_prime], times, pad_s)
            verified = int(windows.sum())
            one_at_a_time.append((batch + float(prefix[np.arange(batch), windows].sum()))
                                 / (times[verified] + pad_s * (batch * int(windows.max()) - verified)))
        else:
            one_at_a_time.append(float(capacity_rates(expected[:, :k_prime], times).max()))
    assert uniform_rates(expected, order, drafting_s, k_primes, target, pad_s).tolist() == one_at_a_time


def test_a_catch_up_pays_where_a_requests_share_of_the_gain_covers_it():
    """Requests 0 and 1 planned 2 drafts, 2 none; the plan gains 1/10 - 1/12 s per token the batch emits, a request's
    share by its expected accepted drafts (1.7 and 0.7 of 2.4), over the 3 x 100 tokens the batch emits while it
    runs: 3.54 s and 1.46 s, against 1 s and 2 s of catch-up."""
    expected = np.array([[0.9, 0.8], [0.5, 0.2], [0.9, 0.9]])
    lengths = np.array([2, 2, 0])
    remaining = np.array([100, 100, 100])
    pays = catch_up_pays(lengths, expected, 12.0, 10.0, np.array([1.0, 2.0, 0.0]), remaining)
    assert pays.tolist() == [True, False, False]
    assert catch_up_pays(lengths, expected, 12.0, 10.0, np.array([1.0, 1.4, 0.0]), remaining).tolist() == \
        [True, True, False]
    assert catch_up_pays(lengths, expected, 12.0, 10.0, np.zeros(3), np.array([100, 1, 100])).tolist() == \
        [True, True, False]  # nothing owed: drafting pays
    assert not catch_up_pays(lengths, expected, 10.0, 10.0, np.zeros(3), remaining).any()  # no gain at all


def test_no_request_drafts_past_the_tokens_it_has_left():
    """A request with n tokens left can use n - 1 drafts: no plan drafts past them, whatever the others draft; where
    every request has the cap or more left, the plan is the one without a limit."""
    passes, target = _costs(_cost(draft_step=0.01, per_row=0.001), 3, 6)
    goodput = Goodput(max_draft=6)
    sure = np.log(np.full((3, 6), 0.97))
    for _ in range(10):
        goodput.survival(sure, (0, 1, 2))
        goodput.observe(sure, np.full(3, 6), np.full(3, 6))
    assert goodput.draft_lengths((0, 1, 2), passes, target).tolist() == [6, 6, 6]
    assert goodput.draft_lengths((0, 1, 2), passes, target, useful=np.array([9, 2, 0])).tolist() == [6, 2, 0]
    assert goodput.draft_lengths((0, 1, 2), passes, target, useful=np.array([6, 100, 7])).tolist() == [6, 6, 6]


def test_goodput_drafts_only_for_requests_whose_catch_up_pays():
    """Two requests drafting alike, one with its whole 500-token prompt still to run in the draft (10 s): with 20 left
    to emit it draws no drafts (the other drafts on), with 10,000 it does. Before anything is learned only the
    request cheapest to catch up drafts, the cap; explorations try one draft on requests whose catch-up fits."""
    cost = _cost(draft_step=0.05, per_row=0.01)
    passes, target = _costs(cost, 2, 4)

    def owed(drafting: int, tokens: np.ndarray) -> np.ndarray:
        return 0.02 * tokens  # 10 s for the prompt: more than 20 tokens of drafting save, less than 10,000

    fresh = Goodput(max_draft=4)
    first = fresh.draft_lengths((0, 1), passes, target, 0.0, CatchUp(np.array([500, 120]), np.array([128, 128]), owed))
    assert first.tolist() == [0, 4]
    goodput = Goodput(max_draft=4)
    for _ in range(10):
        goodput.survival(np.log(np.full((2, 4), 0.97)), (0, 1))
        goodput.observe(np.log(np.full((2, 4), 0.97)), np.array([4, 4]), np.array([4, 4]))
    assert goodput.draft_lengths((0, 1), passes, target).tolist() == [4, 4]
    short = CatchUp(np.array([0, 500]), np.array([20, 20]), owed)
    assert goodput.draft_lengths((0, 1), passes, target, 0.0, short).tolist() == [4, 0]
    long = CatchUp(np.array([0, 500]), np.array([10_000, 10_000]), owed)
    assert goodput.draft_lengths((0, 1), passes, target, 0.0, long).tolist() == [4, 4]
    far = _cost(draft_step=5.0, per_row=0.01)  # drafting never pays: plain steps, then an exploration
    explored = []
    for _ in range(Goodput.explore_after):
        lengths = goodput.draft_lengths((0, 1), *_costs(far, 2, 4), 0.0, short)
        explored.append(lengths.tolist() if goodput.exploring else None)
    assert explored[-1] == [1, 0] and explored[:-1] == [None] * (Goodput.explore_after - 1)
    behind = CatchUp(np.array([3, 500]), np.array([20, 20]), owed)  # 0.06 s and 10 s to catch up
    explored = [goodput.draft_lengths((0, 1), *_costs(far, 2, 4), 0.0, behind).tolist()
                for _ in range(2 * Goodput.explore_after)]  # the wait doubled: one exploration, by request 0
    assert explored == [[0, 0]] * (2 * Goodput.explore_after - 1) + [[1, 0]] and goodput.exploring
    assert CatchUp(np.array([3, 7, 3]), np.zeros(3), owed).cheapest().tolist() == [True, False, True]
    assert CatchUp(np.array([1, 0, 9]), np.zeros(3), owed).cheapest().tolist() == [True, True, False]


def test_explorations_wait_until_a_catch_up_fits_in_their_share_of_the_plain_steps():
    """Drafting never pays (5 s draft passes) and neither request has ever drafted (10 s to catch up each): an
    exploration pays at most `explore_share` of the plain steps since the batch last drafted (~1 s each here), so
    explorations come due after 8, 16, 32, 64 plain steps and the first to fit (120 steps, 15 s) tries one draft for
    one request, never both (20 s)."""
    far = _cost(draft_step=5.0, per_row=0.01)
    passes, target = _costs(far, 2, 4)
    goodput = Goodput(max_draft=4)
    goodput.survival(np.log(np.full((2, 4), 0.5)), (0, 1))
    goodput.observe(np.log(np.full((2, 4), 0.5)), np.array([4, 4]), np.array([0, 0]))
    prompts = CatchUp(np.array([500, 500]), np.array([1000, 1000]), lambda drafting, tokens: 0.02 * tokens)
    plans = [goodput.draft_lengths((0, 1), passes, target, 0.0, prompts).tolist() for _ in range(130)]
    explorations = [step for step, lengths in enumerate(plans, 1) if any(lengths)]
    budget = Goodput.explore_share * float(target[0])  # seconds of catch-up each plain step buys
    assert explorations == [8 + 16 + 32 + 64] and 10.0 <= 120 * budget < 20.0
    assert plans[119] == [1, 0]
    assert CatchUp(np.array([1, 0, 500]), np.zeros(3), lambda d, t: 0.02 * t).affordable(0.0).tolist() == \
        [True, True, False]  # caught up: free


def test_a_plan_drafts_only_past_the_margin_it_is_asked_for():
    """Four requests surviving 0.9 per draft, 0.85 s per draft pass: one draft each is predicted 1.019x plain decoding,
    enough to draft with no margin, not with 5 % (and a plan that does not draft reports plain decoding's rate)."""
    passes, target = _costs(_cost(draft_step=0.85, per_row=0.01), 4, 4)
    expected = np.tile(np.cumprod(np.full(4, 0.9)), (4, 1))
    lengths, rate = goodput_plan(expected, passes, target)
    assert lengths.tolist() == [1] * 4 and rate == pytest.approx(1.0193 * 4 / target[0], rel=1e-3)
    lengths, rate = goodput_plan(expected, passes, target, min_gain=1.05)
    assert lengths.tolist() == [0] * 4 and rate == 4 / target[0]
    passes, target = _costs(_cost(draft_step=0.75, per_row=0.01), 4, 4)  # 1.075x: past the margin
    assert goodput_plan(expected, passes, target, min_gain=1.05)[0].tolist() == [1] * 4


def test_a_catch_up_is_judged_on_the_plan_its_request_drafts_in():
    """Eight requests alike, two with 250 prompt tokens to catch up (5 s), six with 1,000 (20 s). With all eight
    drafting, a request's share of the gain covers 5 s; in the plan where only those two draft (each draft pass then
    serves two requests) it does not: no one drafts, where judging the pair on the whole batch's plan had them draft."""
    cost = _cost(draft_step=0.2, per_row=0.01)
    passes, target = _costs(cost, 8, 4)
    goodput = Goodput(max_draft=4)
    drafts = np.log(np.full((8, 4), 0.97))
    for _ in range(10):
        goodput.survival(drafts, tuple(range(8)))
        goodput.observe(drafts, np.full(8, 4), np.full(8, 4))
    assert goodput.draft_lengths(tuple(range(8)), passes, target).tolist() == [4] * 8
    tokens = np.array([250, 250, 1000, 1000, 1000, 1000, 1000, 1000])

    def owed(drafting: int, tokens: np.ndarray) -> np.ndarray:
        return 0.02 * tokens

    catch_up = CatchUp(tokens, np.full(8, 100), owed)
    assert goodput.draft_lengths(tuple(range(8)), passes, target, 0.0, catch_up).tolist() == [0] * 8
    everyone = CatchUp(np.full(8, 250), np.full(8, 100), owed)  # all pay in the plan where all draft
    assert goodput.draft_lengths(tuple(range(8)), passes, target, 0.0, everyone).tolist() == [4] * 8


def test_drafting_stops_for_a_request_whose_drafts_the_model_doubts():
    """Re-planned on the drafts so far: two requests that have always been accepted alike, one now drafting a token
    its draft model gives 0.1 and the other one it gives 0.99; only the confident one drafts on. Before any draft
    was seen the plan stands."""
    goodput = Goodput(max_draft=6)
    cost = _cost(draft_step=0.05, per_row=0.01)
    passes, target = _costs(cost, 2, 6)
    drafting = np.array([True, True])
    assert goodput.draft_on(np.log([[0.9], [0.9]]), drafting, passes, target).tolist() == [True, True]
    for _ in range(20):  # the calibration learns that q predicts acceptance
        drafts = np.log(np.array([[0.99, 0.99, 0.1, 0.99, 0.99, 0.99], [0.99, 0.99, 0.99, 0.99, 0.99, 0.99]]))
        goodput.survival(drafts, requests=(0, 1))
        goodput.observe(drafts, np.full(2, 6), np.array([2, 6]))
    so_far = np.log(np.array([[0.99, 0.1], [0.99, 0.99]]))
    assert goodput.draft_on(so_far, drafting, passes, target).tolist() == [False, True]
    # A request that stopped earlier stays stopped.
    assert goodput.draft_on(so_far, np.array([True, False]), passes, target)[1] == False  # noqa: E712


def test_padded_attention_makes_uneven_lengths_pay_less():
    """An easy and a hard request: uneven lengths while rows are all the target prices; fewer padded rows once a
    padded row costs more than a verified draft."""
    expected = np.array([[0.99, 0.98, 0.97, 0.96, 0.95, 0.94], [0.5, 0.25, 0.12, 0.06, 0.03, 0.01]])
    passes = np.array([0.0, 0.02, 0.04])  # a pass costs by its rows
    target = 1.0 + 0.03 * np.arange(2 + 12 + 1)
    uneven = goodput_draft_lengths(expected, passes, target)
    assert uneven[0] > uneven[1]
    even = goodput_draft_lengths(expected, passes, target, pad_s=0.2)
    assert 2 * even.max() - even.sum() < 2 * uneven.max() - uneven.sum()  # fewer padded rows


def test_a_short_burst_of_drafting_after_an_exploration_does_not_reset_the_wait(monkeypatch):
    """Exploring, one draft accepted, two steps of drafting, then plain again: the next exploration still waits twice
    as long; only drafting that keeps paying for `explore_after` steps brings the wait back."""
    import batchspec.spec.policies.goodput as goodput_module

    script: list[int] = []
    monkeypatch.setattr(goodput_module, "goodput_plan",
                        lambda expected, passes, target, pad_s=0.0, done=0, spent=0.0, allowed=None, min_gain=1.0,
                        lag=None: (np.full(len(expected), script.pop(0)), 1.0))
    goodput = Goodput(max_draft=4)
    goodput.survival(np.log(np.full((1, 4), 0.5)), (0,))
    wait = Goodput.explore_after

    def steps(chosen: list[int]) -> list[int]:
        script.extend(chosen)
        out = []
        for _ in chosen:
            goodput._best = None  # as after a step that drafted (survival seen)
            out.append(int(goodput.draft_lengths((0,), np.array([0.0, 10.0]), np.ones(5)).max()))  # far from paying
        return out

    assert steps([0] * wait) == [0] * (wait - 1) + [1]  # the first exploration after `wait` plain steps
    steps([1, 1])  # a burst of drafting
    assert steps([0] * 2 * wait) == [0] * (2 * wait - 1) + [1]  # the wait doubled all the same
    steps([1] * wait)  # drafting that keeps paying
    assert steps([0] * wait) == [0] * (wait - 1) + [1]


def test_easy_requests_draft_long_and_hard_ones_short():
    """Each request's own survival sets its length: one whose drafts are accepted drafts longer than one whose
    drafts are rejected, whatever row it is in; a new request starts at the estimate of those that left (here the
    easy one's)."""
    goodput = Goodput(max_draft=6)
    cost = _cost(draft_step=0.02, per_row=0.01)
    easy, hard = np.log(np.full(6, 0.97)), np.log([0.6, 0.4, 0.3, 0.2, 0.1, 0.1])
    for _ in range(10):
        drafts = np.stack([easy, hard])
        goodput.survival(drafts, requests=(7, 3))
        goodput.observe(drafts, np.full(2, 6), np.array([6, 0]))
    lengths = goodput.draft_lengths((7, 3), *_costs(cost, 2, 6))
    assert lengths[0] > lengths[1]
    assert goodput.draft_lengths((3, 7), *_costs(cost, 2, 6)).tolist() == lengths[::-1].tolist()
    easy_own = goodput._own_rows((3, 7))[1].copy()
    assert goodput._own_rows((3, 9))[1] == pytest.approx(easy_own)


def test_a_new_request_starts_at_what_requests_that_left_had_not_at_the_last_steps():
    """Once requests have left the batch, a new one starts at the mean of their estimates as they left: the batch's
    recent estimate is what the last few requests had (a run's tail), not what a new request is like."""
    goodput = Goodput(max_draft=4)
    easy, hard = np.log(np.full((2, 4), 0.99)), np.log(np.full((1, 4), 0.3))
    for _ in range(20):
        goodput.survival(easy, requests=(0, 1))
        goodput.observe(easy, np.full(2, 4), np.full(2, 4))
    left = goodput._own_rows((0, 1)).mean(axis=0)
    for _ in range(20):  # both leave; a hard one runs alone for a while
        goodput.survival(hard, requests=(2,))
        goodput.observe(hard, np.full(1, 4), np.zeros(1, dtype=np.int64))
    assert goodput.expected_survival[0] < 0.5 * left[0]
    assert goodput._own_rows((2, 5))[1] == pytest.approx(left)


def test_goodput_drafts_the_cap_first_then_explores_ever_more_rarely():
    goodput = Goodput(max_draft=5)
    costs = _costs(_cost(draft_step=10.0, per_row=0.001), 4, 5)
    requests = (0, 1, 2, 3)
    assert goodput.draft_lengths(requests, *costs).tolist() == [5] * 4  # nothing seen yet
    goodput.survival(np.log(np.full((4, 5), 0.5)), requests)
    wait = Goodput.explore_after
    lengths = [int(goodput.draft_lengths(requests, *costs).max()) for _ in range(3 * wait + 1)]
    # One draft after `wait` plain steps, then after twice as many while drafting keeps not paying.
    assert lengths == [0] * (wait - 1) + [1] + [0] * (2 * wait - 1) + [1] + [0]


def test_explorations_stay_frequent_while_drafting_is_near_paying():
    """One draft per request predicted within `Goodput.near` of plain decoding's rate: the wait between explorations
    does not double (far from paying, it does: the test above)."""
    goodput = Goodput(max_draft=5)
    requests = (0, 1)
    goodput.survival(np.log(np.full((2, 5), 0.3)), requests)
    passes = np.array([0.0, 0.02, 0.02])
    target = np.array([1.0, 1.2, 1.25] + [1.3] * 8)  # by C: one draft per request is 0.98 of plain decoding
    wait = Goodput.explore_after
    lengths = [int(goodput.draft_lengths(requests, passes, target).max()) for _ in range(3 * wait)]
    assert lengths == ([0] * (wait - 1) + [1]) * 3


def test_an_exploration_verifies_its_drafts():
    """Drafting that does not pay: an exploration's one draft per request is verified all the same (the calibration
    learns only from verified drafts; one chosen away would be drafted for nothing)."""
    from batchspec.spec.proposal import Proposal

    policy = make_policy(SpecConfig(policy="tetris", k=4, extra=2, k_max=8, capacity="auto"))
    cost = _cost(draft_step=10.0, per_row=0.5)  # nothing is worth verifying
    requests = (0, 1)
    policy.goodput.survival(np.log(np.full((2, 8), 0.5)), requests)
    plans = [policy.plan(2, cost, requests) for _ in range(Goodput.explore_after)]
    assert [plan.k_prime for plan in plans] == [0] * (Goodput.explore_after - 1) + [1]
    proposal = Proposal(torch.zeros(2, 1, dtype=torch.int64), None, torch.log(torch.full((2, 1), 0.01)))
    assert policy.select(plans[-1], proposal).tolist() == [1, 1]
    policy.goodput.exploring = False
    assert policy.select(plans[-1], proposal).tolist() == [0, 0]  # what the capacity's choice would have been


def test_positions_past_the_drafts_follow_the_calibration():
    """Every position's expected survival follows the latest calibration, also those the last steps did not draft:
    the first step, rated by the prior alone, must not cap K' for good (it did: positions past the next K' kept the
    first step's estimate)."""
    goodput = Goodput(max_draft=8)
    drafts = np.log(np.full((4, 8), 0.93))  # the prior rates them 0.925 each: 0.54 to survive all 8
    goodput.survival(drafts)
    assert goodput.expected_survival[7] == pytest.approx(0.925 ** 8)
    goodput.observe(drafts, np.full(4, 8), np.full(4, 8))  # every one accepted
    for _ in range(30):  # then K' = 5 steps, every draft accepted
        goodput.survival(drafts[:, :5])
        goodput.observe(drafts[:, :5], np.full(4, 5), np.full(4, 5))
    assert goodput.expected_survival[5:].min() > 0.9
    assert _lengths(goodput.expected_survival, 4, _cost(draft_step=0.01, per_row=0.001)) == [8] * 4
    sure = drafts[:, :5]
    # A request that stopped drafting (pruned) continues as drafts after its last one's bin have been, not at zero.
    pruned = sure.copy()
    pruned[0, 2:] = -np.inf
    bins = bin_of(pruned)
    assert goodput._continued(goodput._survival(bins), bins) == pytest.approx(_continued_by_paths(goodput, pruned))


def _continued_by_paths(goodput: Goodput, logprobs: np.ndarray) -> np.ndarray:
    """`Goodput._continued` brute force, request by request: the expected survival of each later position, the
    distribution over the next draft's bin carried forward one draft at a time (counted transitions plus the stay
    prior, each bin's calibrated acceptance multiplied in)."""
    rates = goodput.calibration.rates
    counts = goodput._transitions + goodput.stay_prior * np.eye(len(rates))
    follows = counts / counts.sum(axis=1, keepdims=True)
    rows = []
    for row in logprobs:
        bins = [int(b) for b in bin_of(row) if b > 0]
        survival = list(np.cumprod(rates[bins]))
        weights = np.eye(len(rates))[bins[-1]] * survival[-1]  # survival mass by the last draft's bin
        while len(survival) < goodput.max_draft:
            weights = (weights @ follows) * rates
            survival.append(float(weights.sum()))
        rows.append(survival)
    return np.array(rows)


def test_a_request_continues_as_drafts_after_its_own_have_been():
    """Two kinds of drafting: sure drafts followed by sure ones, unsure followed by unsure. A request whose last draft
    was sure is continued at the sure ones' rate, one whose last was unsure at the unsure ones' (a rate by position
    alone would give both the mean)."""
    goodput = Goodput(max_draft=6)
    drafts = np.log(np.array([[0.999] * 6, [0.45] * 6]))
    for _ in range(10):
        goodput.survival(drafts)
        goodput.observe(drafts, np.full(2, 6), np.array([6, 0]))  # the sure ones all accepted, the unsure none
    short = drafts[:, :2]
    continued = goodput._continued(goodput.estimate(short), bin_of(short))
    rates = goodput.calibration.estimate(drafts[:, 0])
    assert continued[0, 2:] == pytest.approx(continued[0, 1] * rates[0] ** np.arange(1, 5))
    assert continued[1, 2:] == pytest.approx(continued[1, 1] * rates[1] ** np.arange(1, 5))
    assert continued[0, 5] > 0.9 and continued[1, 5] < 0.01


def test_the_continuation_is_built_again_once_the_transitions_have_grown():
    """The continuation table stays while the pairs of drafts counted since it was built are few (under the
    calibration's `refit_growth` share of those it was built on), and follows them once they are not."""
    goodput = Goodput(max_draft=4)
    drafts = np.log(np.full((8, 4), 0.9))
    for _ in range(20):  # 8 x 3 pairs each
        goodput.survival(drafts)
    table = goodput._growth_table()
    assert goodput._counted == 480
    one = bin_of(np.log([[0.9, 0.2]]))  # one pair, 1 / 480 of those counted
    goodput._learn_transitions(one)
    assert goodput._growth_table() is table
    for _ in range(10):  # 11 / 480 > 2 %
        goodput._learn_transitions(one)
    assert not np.array_equal(goodput._growth_table(), table) and goodput._counted == 491


def test_a_bin_never_seen_followed_continues_at_its_own_rate():
    """The first step's last draft (q 0.6): no draft has followed one in its bin yet, so the positions past it
    continue at that bin's own calibrated rate (`Goodput.stay_prior`)."""
    goodput = Goodput(max_draft=8)
    drafts = np.log(np.tile([0.99, 0.9, 0.6], (2, 1)))
    goodput.survival(drafts)
    rates = goodput.calibration.estimate(drafts[0])
    expected = np.cumprod([*rates, *[rates[-1]] * 5])
    assert goodput.expected_survival == pytest.approx(expected)


def test_a_step_without_any_draft_continues_nothing():
    goodput = Goodput(max_draft=4)
    survival = goodput.survival(np.full((2, 2), -np.inf))  # every log q -inf: nothing drafted
    assert not survival.any()
    assert goodput.expected_survival is None  # nothing learned of any position
    continued = goodput._continued(survival, bin_of(np.full((2, 2), -np.inf)))
    assert continued.shape == (2, 4) and not continued.any()


def test_acceptance_that_falls_with_depth_stays_falling_past_the_drafts():
    """Drafts that get less sure with depth: positions past K' are continued as the drafts that followed such a draft
    have been (learned when they were drafted), not at the last draft's rate, so K' does not grow where it would not
    pay."""
    goodput = Goodput(max_draft=6)
    falling = np.log(np.tile([0.99, 0.9, 0.6, 0.35, 0.15, 0.07], (4, 1)))
    for _ in range(20):
        goodput.survival(falling)
        goodput.observe(falling, np.full(4, 6), np.full(4, 2))
    short = falling[:, :2]
    for _ in range(20):
        goodput.survival(short)
        goodput.observe(short, np.full(4, 2), np.full(4, 2))
    assert goodput.expected_survival[2:].max() < 0.5 * goodput.expected_survival[1]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(2, 6), st.integers(0, 10_000), st.floats(0.0, 0.3), st.integers(1, 4),
       st.floats(0.0, 2.0))
def test_pruned_drafting_keeps_every_draft_goodput_verifies(batch, width, seed, per_row, step_rows, drafting_s):
    """With `goodput_keep_drafting` the goodput-best windows are those of drafting everything, for linear and
    staircase step times alike; on a linear one, hopeless requests do stop early."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(0.0, 1.0, (batch, width)) ** rng.uniform(0.2, 3.0, (batch, 1))  # easy and hard requests
    logprobs = torch.from_numpy(np.log(q))
    goodput = Goodput(width)
    for _ in range(3):  # a calibration that has seen some outcomes
        goodput.observe(np.log(rng.uniform(size=(batch, width))), np.full(batch, width), rng.integers(0, width, batch))
    table = RowTimeTable(tuple(range(1, 64)), tuple(1.0 + per_row * ((r + step_rows - 1) // step_rows)
                                                   for r in range(1, 64)))

    def seconds(capacity):
        return drafting_s + table(batch + capacity)

    times = seconds(np.arange(batch * width + 1))
    step = smallest_step(times)

    def rule(so_far, drafting):
        return torch.from_numpy(goodput.keep_drafting(so_far.numpy(), drafting.numpy(), times, step))

    drafted = replay_drafting(rule, logprobs)
    pruned = goodput_windows(goodput.survival(undrafted(logprobs, drafted).numpy()), times)
    full = goodput_windows(goodput.survival(logprobs.numpy()), times)
    assert pruned.tolist() == full.tolist()
    assert np.all(pruned <= drafted.numpy())
    if step_rows > 1 or per_row == 0.0:
        assert step == 0.0 and drafted.tolist() == [width] * batch  # free verification somewhere: no pruning


def test_bins_on_log_q_match_the_edges():
    q = np.array([0.0, 0.01, 0.05, 0.5, 0.97, 0.995, 1.0, np.nan])
    with np.errstate(divide="ignore"):
        bins = bin_of(np.log(q))
    assert bins.tolist() == [0, 1, 1, 6, 12, 13, 14, 0]  # 0: no draft (q = 0, NaN); at an edge, the bin below it


def test_auto_capacity_drafts_up_to_its_cap():
    """K' is a cap under --capacity auto: max_draft (None: twice dsd's k_max; k + extra when larger), the cache
    head-room with it."""
    auto = make_policy(SpecConfig(policy="tetris", k=4, extra=2, k_max=8, capacity="auto"))
    assert auto.max_draft_length() == 16 and auto.goodput.max_draft == 16
    assert auto.plan(1, _cost(draft_step=0.01, per_row=0.001)).k_prime == 16  # nothing seen yet: the whole cap
    assert make_policy(SpecConfig(policy="tetris", k=4, extra=14, k_max=8, capacity="auto")).max_draft_length() == 18
    assert make_policy(SpecConfig(policy="tetris", k_max=8, capacity="auto")).max_draft_length() == 16  # the default
    assert make_policy(SpecConfig(policy="tetris", k=4, extra=2, k_max=8)).max_draft_length() == 6  # fixed C: K'
    own = make_policy(SpecConfig(policy="tetris", k=4, extra=2, k_max=8, max_draft=12, capacity="auto"))
    assert own.max_draft_length() == 12 and own.goodput.max_draft == 12  # its own cap, dsd's k_max aside
    with pytest.raises(BatchspecError, match="max_draft must be >= 1"):
        make_policy(SpecConfig(policy="tetris", max_draft=0, capacity="auto"), None, 4)


@given(st.integers(1, 6), st.integers(0, 3), st.lists(st.booleans(), max_size=80))
@settings(max_examples=200, deadline=None)
def test_exploration_waits_double_from_after_to_most_and_drafting_resets_them(after, doublings, drafts):
    """The gap between explorations (steps planned to draft nothing in a row) starts at `after`, doubles after each
    exploration that finds drafting far from paying, never exceeds `most`, and is back to `after` once `after`
    steps in a row drafted."""
    most = after * 2 ** doublings
    exploration = Exploration(after=after, most=most)
    wait, plain, drafting = after, 0, 0
    for drafted in drafts:
        if drafted:
            exploration.drafted()
            plain, drafting = 0, drafting + 1
            wait = after if drafting >= after else wait
            continue
        plain, drafting = plain + 1, 0
        explores = plain == wait
        assert exploration.explores() == explores
        if explores:
            plain, wait = 0, min(2 * wait, most)
        assert after <= exploration.wait == wait <= most
