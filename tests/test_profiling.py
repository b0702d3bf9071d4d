"""dsd's step-time profile is fitted once per machine and model pair, then read back from the cache."""

from __future__ import annotations

import numpy as np
import pytest

import batchspec.spec.step_time as profiling
from batchspec.weights.loading import load_model


def test_step_time_profile_is_cached(tmp_path, monkeypatch, tiny_model_factory):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    target = load_model(tiny_model_factory(name="target", seed=0)).transformer
    draft = load_model(tiny_model_factory(name="draft", seed=1, hidden_size=32, intermediate_size=64)).transformer
    first = profiling.cached_step_time(target, draft, max_batch=2, k_max=2)
    assert len(list((tmp_path / "cache" / "profiles").glob("step-time-*.json"))) == 1

    def must_not_profile(*args):
        raise AssertionError("profiled again instead of reading the cache")

    monkeypatch.setattr(profiling, "profile_step_time", must_not_profile)
    assert profiling.cached_step_time(target, draft, max_batch=2, k_max=2) == first
    other = load_model(tiny_model_factory(name="other", seed=2, hidden_size=32, intermediate_size=64)).transformer
    monkeypatch.undo()
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    profiling.cached_step_time(target, other, max_batch=2, k_max=2)  # another draft: a new profile
    assert len(list((tmp_path / "cache" / "profiles").glob("step-time-*.json"))) == 2
    monkeypatch.setattr(profiling, "runtime_code_version", lambda: "other kernels")
    profiling.cached_step_time(target, other, max_batch=2, k_max=2)  # the runtime's code changed: profiled again
    assert len(list((tmp_path / "cache" / "profiles").glob("step-time-*.json"))) == 3


def test_runtime_code_version_reads_the_runtime_sources():
    version = profiling.runtime_code_version()
    assert len(version) == 16 and (profiling.RUNTIME_DIR / "linear.py").is_file()


def test_machine_description_names_the_cpu_and_threads():
    import torch

    description = profiling.machine_description()
    assert f"({torch.backends.cpu.get_cpu_capability()})" in description
    assert description.endswith(f"{torch.get_num_threads()} threads") and not description.startswith(" (")


def test_a_row_time_slowed_by_a_busy_machine_is_timed_again(monkeypatch):
    """The profile's points are non-decreasing in the rows; one timed far above a point with more rows (another
    process held the cores) is timed again, and what stays non-monotone is cut to the later points' minimum."""
    calls: dict[int, int] = {}

    def timed(model, appends, repeats=2):
        rows = sum(appends)
        calls[rows] = calls.get(rows, 0) + 1
        if rows == 2 and calls[rows] == 1:
            return 5.0  # busy the first time only
        if rows == 3:
            return 1.5  # always above the 4-row point: noise that timing again does not remove
        return 1.0 + 0.01 * rows

    monkeypatch.setattr(profiling, "_time_ragged", timed)
    table = profiling.profile_row_times(None, max_batch=4, max_rows=4)
    assert table.rows == (1, 2, 3, 4)
    assert table.seconds == (1.01, 1.02, 1.04, 1.04)
    assert calls == {1: 1, 2: 2, 3: 1 + profiling.RETIMES, 4: 1}


def test_each_row_point_is_timed_at_exactly_its_rows(monkeypatch):
    """A staircase that steps up after 32 rows: the point just past it (33) is timed at 33 rows (spread 9, 8, 8, 8
    over 4 requests), not rounded up to 36, so the table does not interpolate across the step."""
    timed: list[list[int]] = []

    def ragged(model, appends, repeats=2):
        timed.append(list(appends))
        return 0.2 if sum(appends) <= 32 else 0.35

    monkeypatch.setattr(profiling, "_time_ragged", ragged)
    table = profiling.profile_row_times(None, max_batch=4, max_rows=36)
    assert [9, 8, 8, 8] in timed and 33 in table.rows
    assert all(sum(appends) in table.rows for appends in timed)
    assert float(table(32)) == 0.2 and float(table(33)) == 0.35


def test_the_target_profile_prices_padded_attention_rows(tmp_path, monkeypatch, tiny_model_factory):
    """Uneven appends pad attention to the longest: its cost per padded row is profiled with the target's table and
    read back from the cache with it (the draft's table has none)."""
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    target = load_model(tiny_model_factory(name="target", seed=0)).transformer
    draft = load_model(tiny_model_factory(name="draft", seed=1, hidden_size=32, intermediate_size=64)).transformer
    timed: list[list[int]] = []

    def ragged(model, appends, repeats=2):
        timed.append(list(appends))
        return 0.010 + 0.001 * sum(appends) + 0.0005 * len(appends) * (max(appends) - min(appends))

    monkeypatch.setattr(profiling, "_time_ragged", ragged)
    cost = profiling.step_cost(target, draft, max_batch=4, k_max=2, max_draft=2)
    assert [2, 2, 2, 2] in timed and [5, 1, 1, 1] in timed
    assert abs(cost.pad_s - 0.0005 * 4 * 4 / (4 * 5 - 8)) < 1e-12 and cost.draft.pad_s == 0.0
    monkeypatch.setattr(profiling, "_time_ragged", lambda *args, **kwargs: 1 / 0)  # read back, never profiled again
    assert profiling.step_cost(target, draft, max_batch=4, k_max=2, max_draft=2) == cost


def test_a_row_time_table_learns_what_forwards_take_and_stays_non_decreasing(monkeypatch):
    """A measured forward moves the points the interpolation reads, by their weights and `rate` of the error (capped
    at half the prediction); repeated, the table converges to what the machine now takes; later points never fall
    below earlier ones. The profile's own `seconds` stay as profiled. (The pull of every point toward the profile's
    shape is off here: `test_a_point_no_forward_revisits...`.)"""
    monkeypatch.setattr(profiling, "RELAX_RATE", 0.0)
    table = profiling.RowTimeTable((1, 10, 20), (1.0, 2.0, 3.0))
    table.learn(10, 4.0, rate=0.5)  # error 2.0, capped at 1.0
    assert float(table(10)) == 2.5 and table.version == 1 and table.seconds == (1.0, 2.0, 3.0)
    table.learn(15, 2.0, rate=0.5)  # between 10 and 20, half each: predicted 2.75, error -0.75
    assert np.allclose([table(1), table(10), table(20)], [1.0, 2.5 - 0.1875, 3.0 - 0.1875])
    for _ in range(60):
        table.learn(10, 4.0)
    assert abs(float(table(10)) - 4.0) < 1e-6 and float(table(20)) >= float(table(10))
    table.learn(40, 10.0, rate=1.0)  # past the end: the last point, by the ratio (prediction on the last slope)
    assert float(table(20)) > 4.0


def test_a_step_cost_shares_the_drafts_time_among_its_passes_as_predicted(monkeypatch):
    monkeypatch.setattr(profiling, "RELAX_RATE", 0.0)  # the local rule alone (the pull to the profile: below)
    cost = profiling.StepCost(profiling.StepTimeModel(0.0, 0.0, 0.0, 0.0), profiling.RowTimeTable((1, 8), (1.0, 1.0)),
                              profiling.RowTimeTable((1, 4, 132), (0.1, 0.2, 1.2)), catch_up=True)
    cost.learn(12, 4, 1.0, [4, 4], 0.8)  # the draft took twice what it predicts: 0.4 per pass
    assert float(cost.draft(4)) == pytest.approx(0.23 + 0.3 * 0.115)  # each pass 0.4: +0.3 x the capped error
    assert cost.version == (1, 2)
    assert cost.catch_up_s(4, np.array([0, 128])).tolist() == pytest.approx([0.0, 1.2 - float(cost.draft(4))])
    assert profiling.StepCost(cost.model, cost.target, cost.draft).catch_up_s(4, np.array([9])) is None


def test_a_point_learned_lower_lowers_the_points_before_it(monkeypatch):
    """A batch that always runs 16 rows learns that 16 rows got cheaper even where the profile timed 15 rows dearer:
    the points before it come down with it (and a point learned higher raises the ones after it)."""
    monkeypatch.setattr(profiling, "RELAX_RATE", 0.0)
    table = profiling.RowTimeTable((1, 15, 16, 32), (0.05, 0.11, 0.113, 0.14))
    for _ in range(40):
        table.learn(16, 0.085)
    assert abs(float(table(16)) - 0.085) < 1e-4 and float(table(15)) <= float(table(16))
    assert float(table(1)) == 0.05 and float(table(32)) == 0.14
    for _ in range(40):
        table.learn(15, 0.2)
    assert float(table(16)) >= float(table(15)) > 0.19


def test_a_point_no_forward_revisits_returns_to_the_profiles_shape_at_the_machines_speed():
    """Forwards slowed by another process raise the point they read and every later one; a plan priced on that
    table avoids those rows, so no forward corrects them. Every learned forward also pulls each point toward the
    profile's point at the machine's present speed (`level`, followed from forwards of any rows): the raised points
    come back, and a machine slower everywhere scales the whole table."""
    table = profiling.RowTimeTable((1, 5, 9), (0.042, 0.045, 0.048))
    for _ in range(5):
        table.learn(5, 0.09)  # slowed twofold for a moment
    assert float(table(5)) > 0.06 and float(table(9)) > 0.06
    for _ in range(100):  # then only one-row forwards, at the profile's speed
        table.learn(1, 0.042)
    assert table.level == pytest.approx(1.0, abs=0.01)
    assert [float(table(r)) for r in (1, 5, 9)] == pytest.approx([0.042, 0.045, 0.048], rel=0.02)
    for _ in range(200):  # the machine now twice as slow, seen at one row only
        table.learn(1, 0.084)
    assert [float(table(r)) for r in (1, 5, 9)] == pytest.approx([0.084, 0.090, 0.096], rel=0.02)
    table.rescale(1, 0.042)  # a refresh scales the speed the points are pulled to as well
    assert table.level == pytest.approx(1.0, rel=0.02)
    assert table.seconds == (0.042, 0.045, 0.048)


def test_a_refreshed_table_keeps_its_shape_at_the_machines_new_speed():
    """`rescale` (what `StepCost.refresh` does at a run's start) scales every point by what the re-timed point
    measured, so a verified row keeps its price against a plain step; a wild measurement moves it at most 2x."""
    table = profiling.RowTimeTable((1, 16, 32), (0.05, 0.088, 0.108))
    table.rescale(16, 0.072)
    assert np.allclose([table(1), table(16), table(32)], np.array([0.05, 0.088, 0.108]) * 0.072 / 0.088)
    assert table.version == 1 and table.seconds == (0.05, 0.088, 0.108)
    table.rescale(16, 100.0)
    assert float(table(16)) == pytest.approx(2 * 0.072)


def test_a_refresh_slowed_for_a_moment_does_not_price_the_run(monkeypatch):
    """`StepCost.refresh` times each model twice, in turn, and rescales by the faster figure: one round slowed by
    another process (the target's first, the draft's second here) leaves the tables at the machine's speed."""
    target, draft = object(), object()
    timings = iter([0.2, 0.05, 0.1, 0.08])  # target, draft, then target, draft again
    calls = []

    def timed(model, appends, repeats):
        calls.append((model, len(appends)))
        return next(timings)

    monkeypatch.setattr(profiling, "_time_ragged", timed)
    cost = profiling.StepCost(profiling.StepTimeModel(0.0, 0.0, 0.0, 0.0), profiling.RowTimeTable((1, 8), (0.05, 0.1)),
                              profiling.RowTimeTable((1, 8), (0.02, 0.04)))
    cost.refresh(target, draft, 8)
    assert calls == [(target, 8), (draft, 8), (target, 8), (draft, 8)]
    assert float(cost.target(8)) == pytest.approx(0.1) and float(cost.draft(8)) == pytest.approx(0.05)
    assert float(cost.target(1)) == pytest.approx(0.05) and float(cost.draft(1)) == pytest.approx(0.025)


def test_a_forward_far_past_the_table_moves_its_last_point_by_ratio_not_to_zero():
    """A draft pass that ran every prompt (2,000 rows, far past a table ending at 144) and took less than the last
    slope predicts scales the last point down by at most half, never through zero (which would flatten the table)."""
    table = profiling.RowTimeTable((1, 16, 144), (0.01, 0.02, 0.24))
    for _ in range(20):
        table.learn(2000, 1.0)
    assert 0.0 < float(table(16)) <= 0.02 and float(table(144)) > 0.0
