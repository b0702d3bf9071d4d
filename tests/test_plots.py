"""Bench plots are written from a results dict: every plot file exists and is a non-trivial PNG."""

from __future__ import annotations

import random

from batchspec.bench.plots import write_plots


def _results(sweep: dict | None = None) -> dict:
    rng = random.Random(0)
    runs = []
    points = [{"batch_size": b} for b in (sweep or {}).get("batch_size", [4])]
    for index, point in enumerate(points):
        for trial in range(2):
            for policy in ("ar", "sd", "tetris"):
                spec = policy != "ar"
                history = [[rng.randint(0, 6) for _ in range(point["batch_size"])] for _ in range(12)] if spec else []
                runs.append({"policy": policy, "trial": trial, "point": index, **point, "tokens_per_s": rng.uniform(5, 20),
                             "vsr": rng.random() if spec else None,
                             "per_position_accept": [0.6, 0.5, 0.4, 0.3, 0.2, 0.1] if spec else [],
                             "window_history": history})
    config = {"dataset": "humaneval", "num_prompts": 8, "max_tokens": 16, "batch_size": 4,
              "spec": {"k": 4, "extra": 2}, "sweep": sweep}
    baselines = [{"policy": "hf_generate", "batch_size": 4, "tokens_per_s": 6.0, "library": "transformers x"}]
    return {"config": config, "runs": runs, "baselines": baselines}


def test_plots_written(tmp_path):
    files = write_plots(_results(), tmp_path / "plots")
    assert sorted(p.name for p in files) == ["position_acceptance.png", "tetris_shape.png", "throughput.png"]
    for path in files:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_sweep_plot_written(tmp_path):
    files = write_plots(_results({"batch_size": [2, 4, 8]}), tmp_path)
    assert (tmp_path / "sweep_batch_size.png") in files


def test_windows_by_kind_plot_and_line(tmp_path):
    """A mixed dataset: each request's windows, by the kind of its prompt (code requests get longer ones here)."""
    from batchspec.bench.report import mean_windows_by_kind

    results = _results()
    results["config"]["prompt_kinds"] = ["code", "prose"] * 2
    for run in results["runs"]:
        run["request_windows"] = [[5, 6, 4], [0, 1], [6, 6], [1, 0, 0]] if run["policy"] != "ar" else [[]] * 4
    files = write_plots(results, tmp_path)
    assert (tmp_path / "windows_by_kind.png") in files
    means = mean_windows_by_kind(results, "")
    assert set(means) == {"sd", "tetris"} and means["tetris"] == {"code": 27 / 5, "prose": 2 / 5}
