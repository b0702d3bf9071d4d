"""DSD: goodput-chosen k, the step-time model's fit, the acceptance EMA."""

from __future__ import annotations

import pytest

from batchspec.errors import BatchspecError
from batchspec.spec.policies.dsd import AcceptanceEMA, dsd_choose_k, expected_tokens_per_request
from batchspec.spec.step_time import StepTimeModel


def test_dsd_choose_k_on_hand_made_step_time() -> None:
    def step_time(batch_size: int, k: int) -> float:
        return 1.0 + 0.3 * k  # goodput with alpha 0.8: 1.0, 1.385, 1.525, 1.554, 1.528, ... -> k = 3

    assert dsd_choose_k(0.8, 4, 8, step_time) == 3
    assert dsd_choose_k(0.8, 4, 2, step_time) == 2  # capped by k_max
    assert dsd_choose_k(0.0, 4, 8, step_time) == 0  # nothing is ever accepted
    assert dsd_choose_k(1.0, 4, 8, step_time) == 8  # everything accepted: (k+1)/(1+0.3k) grows
    assert expected_tokens_per_request(1.0, 4) == 5.0
    assert expected_tokens_per_request(1.0 - 1e-12, 4) == 5.0
    with pytest.raises(BatchspecError, match="non-positive"):
        dsd_choose_k(0.5, 4, 3, lambda b, k: 0.0)


def test_step_time_model_fit_recovers_coefficients() -> None:
    truth = StepTimeModel(c_fixed=0.02, c_draft_step=0.004, c_draft_token=0.0003, c_target_token=0.0011)
    samples = [(b, k, truth(b, k)) for b in (1, 2, 4, 8, 16) for k in range(6)]
    fitted = StepTimeModel.fit(samples)
    for name in ("c_fixed", "c_draft_step", "c_draft_token", "c_target_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-8, abs=1e-12)
    assert fitted(32, 7) == pytest.approx(truth(32, 7), rel=1e-8)
    with pytest.raises(BatchspecError, match="at least 4"):
        StepTimeModel.fit(samples[:3])


def test_acceptance_ema() -> None:
    ema = AcceptanceEMA()
    assert ema.value == 0.7
    updated = ema.update(0.3)
    assert updated.value == pytest.approx(0.85 * 0.7 + 0.15 * 0.3)
    assert ema.value == 0.7  # immutable: state is passed explicitly


def test_dsd_reads_the_profiled_tables_where_a_line_cannot_fit_the_staircase() -> None:
    """The Qwen pair's bfloat16 target at batch 8 (measured 2026-12-05, AVX-512, 2 threads): a pass costs about one
    weight read up to 32 rows and two from 33 on. The line fitted across that staircase gives each verified row a
    negative cost; the tables give dsd the window that fills 32 rows."""
    from batchspec.spec.policies import make_policy
    from batchspec.spec.config import SpecConfig
    from batchspec.spec.step_time import RowTimeTable, StepCost

    target = RowTimeTable((1, 8, 16, 24, 32, 33, 40, 64, 72), (0.140, 0.165, 0.181, 0.201, 0.218, 0.370, 0.370,
                                                               0.420, 0.560))
    draft = RowTimeTable((1, 4, 8), (0.027, 0.043, 0.061))
    line = StepTimeModel(c_fixed=0.147, c_draft_step=0.0147, c_draft_token=0.0127, c_target_token=-0.00136)
    cost = StepCost(line, target, draft)
    assert cost(8, 3) == pytest.approx(3 * 0.061 + 0.218)
    assert cost(8, 0) == pytest.approx(0.165)
    assert StepCost(line)(8, 3) == line(8, 3)  # without tables: the fitted line
    assert dsd_choose_k(0.95, 8, 8, cost) == 3  # 4 rows each: one weight pass
    policy = make_policy(SpecConfig(policy="dsd", k_max=8), None, 8)
    assert policy.needs_row_times  # the engine profiles both tables for it


def test_row_grid_reaches_the_most_rows_a_step_verifies():
    """The profiled table ends at the most rows a step can verify, so none of them is priced by extrapolation (a
    table that stopped at 17 of 28 rows priced 28 on the 16 -> 17 step's slope)."""
    from batchspec.spec.step_time import row_grid

    for max_rows in (1, 5, 16, 17, 28, 40, 56):
        grid = row_grid(max_rows)
        assert grid[0] == 1 and grid[-1] == max_rows and grid == sorted(set(grid))
    assert {15, 16, 17, 28} <= set(row_grid(28)) and {31, 32, 33, 47, 48, 49, 56} <= set(row_grid(56))


def test_dsd_probes_after_steps_at_zero_and_leaves_the_prior() -> None:
    """Where the prior makes k = 0 best, k = 0 steps teach nothing: dsd drafts one token per request every
    EXPLORE_AFTER steps, and a draft that agrees brings it to longer windows (it stayed at k = 0 without)."""
    from batchspec.spec.config import SpecConfig
    from batchspec.spec.policies import make_policy
    from batchspec.spec.policies.dsd import EXPLORE_AFTER

    def step_time(batch_size: int, k: int) -> float:
        return 1.0 + 0.9 * k  # k = 1 pays from alpha 0.9 on; the prior 0.7 says k = 0

    policy = make_policy(SpecConfig(policy="dsd", k_max=4), None, 8)
    windows = []
    for _ in range(60):
        k = policy.plan(8, step_time).k
        windows.append(k)
        if k:
            policy.observe(None, [k] * 8, [k] * 8)  # every draft accepted
    assert windows[:EXPLORE_AFTER] == [0] * (EXPLORE_AFTER - 1) + [1]  # the first exploration
    assert windows[-10:] == [4] * 10  # learned: every draft is accepted, the longest window pays most
    never = make_policy(SpecConfig(policy="dsd", k_max=4), None, 8)
    plans = [never.plan(8, lambda b, k: 1.0 + 5.0 * k).k for _ in range(3 * EXPLORE_AFTER)]
    assert plans == ([0] * (EXPLORE_AFTER - 1) + [1]) * 3  # drafting never pays: explorations only, at a fixed wait
