"""Bench plots (PNG, matplotlib, no display needed): everything is drawn from a `results.json` dict.

- `throughput.png` — tokens/s per policy, median over trials, whiskers min..max;
- `sweep_<axis>.png` — tokens/s and VSR against a swept axis (batch size, capacity, k, extra), one line per policy;
- `tetris_shape.png` — per speculative policy, how many requests got each window length at each step;
- `position_acceptance.png` — acceptance rate of draft position 1..K' per policy.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from batchspec.spec.policies import POLICIES

SWEEP_AXES = ("batch_size", "k", "extra", "capacity")
AXIS_LABELS = {"tau": "sprinter threshold tau (verifier probability)",
               "batch_size": "batch size B (requests)", "k": "window k (draft tokens)",
               "extra": "extra draft tokens (K' - k)", "capacity": "capacity C (draft tokens verified per step)",
               "tetris_scores": "Tetris ranks by: q, calibrated\nsurvival or the verifier"}


def baselines_by_name(results: dict) -> dict[str, list[dict]]:
    """The baseline rows (transformers, llama.cpp) grouped by baseline, one row per trial each, in run order."""
    groups: dict[str, list[dict]] = {}
    for row in results.get("baselines", []):
        groups.setdefault(row["policy"], []).append(row)
    return groups


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works on headless machines and in tests
    import matplotlib.pyplot as plt

    return plt


def _color(policy: str) -> str:
    """One colour per policy in every plot."""
    order = POLICIES
    index = order.index(policy) if policy in order else len(order) + hash(policy) % 4
    return f"C{index % 10}"


def _policies(results: dict) -> list[str]:
    seen = []
    for run in results["runs"]:
        if run["policy"] not in seen:
            seen.append(run["policy"])
    return seen


def _title(results: dict) -> str:
    c = results["config"]
    spec = c.get("spec", {})
    return (f"{c.get('dataset', '')}, {c.get('num_prompts', '?')} prompts, {c.get('max_tokens', '?')} new tokens, "
            f"B={c.get('batch_size', '?')}, k={spec.get('k', '?')}, extra={spec.get('extra', '?')}")


def plot_throughput(results: dict, path: Path) -> Path:
    plt = _pyplot()
    runs = [r for r in results["runs"] if r.get("point", 0) == 0]  # the first sweep point
    policies = [p for p in _policies(results) if any(r["policy"] == p for r in runs)]
    values = [[r["tokens_per_s"] for r in runs if r["policy"] == p] for p in policies]
    colors = [_color(p) for p in policies]
    for trials in baselines_by_name(results).values():  # transformers rows, one per trial
        kind = "assisted" if "assisted" in trials[0]["policy"] else "generate"
        policies.append(f"transformers\n{kind}\nB={trials[0]['batch_size']}")
        values.append([b["tokens_per_s"] for b in trials])
        colors.append("0.6")
    medians = [statistics.median(v) for v in values]
    fig, ax = plt.subplots(figsize=(max(7, 1.25 * len(policies)), 4))  # ~1.2 in per label: no overlap
    low = [m - min(v) for m, v in zip(medians, values)]
    high = [max(v) - m for m, v in zip(medians, values)]
    bars = ax.bar(policies, medians, yerr=[low, high], capsize=4, color=colors)
    for bar, value, top in zip(bars, medians, (max(v) for v in values)):  # above the whisker, not across it
        ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_ylim(0, 1.12 * max(max(v) for v in values))  # room for the labels above the whiskers
    ax.set_ylabel("throughput (output tokens / s)")
    ax.set_xlabel("policy (median over trials; whiskers: min..max); grey: transformers baselines")
    if len(policies) > 8:
        ax.tick_params(axis="x", labelrotation=25)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    ax.set_title(_title(results), fontsize=9)
    return _save(fig, path)


def plot_sweep(results: dict, axis: str, path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in _policies(results):
        runs = [r for r in results["runs"] if r["policy"] == policy and r.get(axis) is not None]
        xs = sorted({r[axis] for r in runs})
        tps = [statistics.median(r["tokens_per_s"] for r in runs if r[axis] == x) for x in xs]
        left.plot(xs, tps, marker="o", label=policy, color=_color(policy))
        vsr = [[r["vsr"] for r in runs if r[axis] == x and r.get("vsr") is not None] for x in xs]
        points = [(x, statistics.median(v)) for x, v in zip(xs, vsr) if v]
        if points:
            right.plot(*zip(*points), marker="o", label=policy, color=_color(policy))
    left.set_ylabel("throughput (output tokens / s)")
    right.set_ylabel("VSR (accepted / verified drafts)")
    right.set_ylim(0, 1)
    for ax in (left, right):
        ax.set_xlabel(AXIS_LABELS.get(axis, axis))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"sweep over {axis}: {_title(results)}", fontsize=9)
    return _save(fig, path)


def plot_tetris_shape(results: dict, path: Path) -> Path | None:
    """Heat map per policy: x = step, y = window length l, colour = number of requests given that window."""
    plt = _pyplot()
    import numpy as np

    runs = {}
    for run in results["runs"]:
        if run.get("window_history") and run["policy"] not in runs:
            runs[run["policy"]] = run["window_history"]  # the first trial (and sweep point) of each policy
    if not runs:
        return None
    longest = max(max((max(step, default=0) for step in h), default=0) for h in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.8 + 1.6 * len(runs)), squeeze=False, sharex=True)
    image = None
    vmax = max(max(len(step) for step in h) for h in runs.values())
    for ax, (policy, history) in zip(axes[:, 0], runs.items()):
        counts = np.zeros((longest + 1, len(history)))  # (window length, step)
        for step, windows in enumerate(history):
            np.add.at(counts[:, step], windows, 1)
        image = ax.imshow(np.where(counts > 0, counts, np.nan), aspect="auto", origin="lower", cmap="viridis",
                          interpolation="nearest", vmin=0, vmax=vmax)
        ax.set_ylabel(f"{policy}\nwindow l (tokens)")
    axes[-1, 0].set_xlabel("speculative step")
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="requests with this window")
    fig.suptitle(f"per-request window lengths per step: {_title(results)}", fontsize=9)
    return _save(fig, path)


def plot_windows_by_kind(results: dict, path: Path) -> Path | None:
    """Heat map for datasets that mix kinds of prompts: one row per (policy, prompt kind), x = window length l,
    colour = share of that kind's request-steps given window l (first trial and sweep point)."""
    kinds = results["config"].get("prompt_kinds") or []
    if len(set(k for k in kinds if k)) < 2:
        return None
    rows: list[tuple[str, list[int]]] = []
    seen = set()
    for run in results["runs"]:
        if run["policy"] in seen or not run.get("request_windows") or not any(run["request_windows"]):
            continue
        seen.add(run["policy"])
        for kind in sorted(set(k for k in kinds if k)):
            windows = [w for k, ws in zip(kinds, run["request_windows"]) if k == kind for w in ws]
            if windows:
                rows.append((f"{run['policy']} · {kind}", windows))
    if not rows:
        return None
    plt = _pyplot()
    import numpy as np

    longest = max(max(w) for _, w in rows)
    shares = np.zeros((len(rows), longest + 1))
    for i, (_, windows) in enumerate(rows):
        shares[i] = np.bincount(windows, minlength=longest + 1) / len(windows)
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * (longest + 1), 0.8 + 0.45 * len(rows)))
    image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    for i in range(len(rows)):
        for j in range(longest + 1):
            if shares[i, j] >= 0.005:
                ax.text(j, i, f"{shares[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if shares[i, j] < 0.6 else "black")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_xticks(range(longest + 1))
    ax.set_xlabel("window l (drafts verified for the request in a step)")
    fig.colorbar(image, ax=ax, label="share of the kind's request-steps")
    ax.set_title(f"windows by prompt kind: {_title(results)}", fontsize=9)
    return _save(fig, path)


def plot_position_acceptance(results: dict, path: Path) -> Path | None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for policy in _policies(results):
        runs = [r["per_position_accept"] for r in results["runs"]
                if r["policy"] == policy and r.get("per_position_accept")]
        if not runs:
            continue
        points = [(j + 1, v) for j, v in enumerate(runs[0]) if v is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=policy, color=_color(policy))
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("draft position j (1 = first drafted token)")
    ax.set_ylabel("acceptance rate at j (given 1..j-1 accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(results), fontsize=9)
    return _save(fig, path)


def plot_speed_quality(results: dict, path: Path) -> Path | None:
    """SPRINTER's trade-off, one point per tau: throughput against HumanEval pass@1 (with `--quality humaneval`: does
    the code still work?), else against match with the target-only output."""
    plt = _pyplot()
    quality = "pass_at_1" if any(r.get("pass_at_1") is not None for r in results["runs"]) else "match_ar"
    runs = [r for r in results["runs"] if r["policy"] == "sprinter" and r.get(quality) is not None]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(sorted(runs, key=lambda r: r.get("tau") or 0.0)):
        ax.scatter(run[quality], run["tokens_per_s"], color=_color("sprinter"))
        # Neighbouring taus often land close together: their labels alternate above and below the point.
        ax.annotate(f"tau={run.get('tau')}", (run[quality], run["tokens_per_s"]), fontsize=8,
                    xytext=(4, 4 if i % 2 == 0 else -11), textcoords="offset points")
    for policy in ("ar", "sd", "dsd", "tetris"):
        mine = [r for r in results["runs"] if r["policy"] == policy]
        if mine:
            ax.axhline(statistics.median(r["tokens_per_s"] for r in mine), color=_color(policy), linestyle="--",
                       label=f"{policy} (lossless)")
            if quality == "pass_at_1" and policy == "ar":
                ax.axvline(mine[0]["pass_at_1"], color=_color("ar"), linestyle=":", label="ar pass@1")
    ax.set_xlabel("HumanEval pass@1 (share of tasks whose tests pass)" if quality == "pass_at_1" else
                  "match_ar (share of outputs identical to the target-only greedy output)")
    ax.set_ylabel("throughput (output tokens / s)")
    ax.set_xlim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"SPRINTER speed vs quality: {_title(results)}", fontsize=9)
    return _save(fig, path)


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """All plots that the results support, under `out_dir`; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_throughput(results, out_dir / "throughput.png"),
               plot_tetris_shape(results, out_dir / "tetris_shape.png"),
               plot_windows_by_kind(results, out_dir / "windows_by_kind.png"),
               plot_position_acceptance(results, out_dir / "position_acceptance.png"),
               plot_speed_quality(results, out_dir / "sprinter_speed_quality.png")]
    for axis in results["config"].get("sweep") or {}:
        written.append(plot_sweep(results, axis, out_dir / f"sweep_{axis}.png"))
    return [p for p in written if p is not None]


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
