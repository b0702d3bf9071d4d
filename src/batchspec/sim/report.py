"""`batchspec sim` output: the table (with Tetris/SD ratios), results.json and the two plots."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("tokens_per_s", "decode_tokens_per_s", "ter_tokens_per_s", "vsr", "mean_accept_len", "system_efficiency",
           "oracle_fraction")


def _cell(value, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.3f}" if isinstance(value, float) else f"{value:>{width}}"


def _ratio(runs: list[dict], run: dict, base: str) -> float | None:
    """run's tokens_per_s over policy `base`'s at the same pipeline and batch size."""
    for other in runs:
        if (other["policy"], other["pipeline"], other["batch_size"]) == (base, run["pipeline"], run["batch_size"]):
            return run["tokens_per_s"] / other["tokens_per_s"] if other["tokens_per_s"] else None
    return None


def format_table(results: dict) -> str:
    runs, config = results["runs"], results["config"]
    measured = config.get("measured_tokens_per_s", {})  # policy -> tokens/s of the recorded bench run
    header = (f"{'pipeline':>10} {'B':>4} {'policy':>7} " + " ".join(f"{c:>{len(c)}}" for c in COLUMNS)
              + f" {'vs sd':>7}" + (f" {'measured':>9}" if measured else ""))
    lines = [f"cost model: {config['cost_model']}", header]
    for run in runs:
        ratio = _ratio(runs, run, "sd")
        line = (f"{run['pipeline']:>10} {run['batch_size']:>4} {run['policy']:>7} "
                + " ".join(_cell(run.get(c), len(c)) for c in COLUMNS) + f" {_cell(ratio, 7)}")
        if measured:
            same_batch = run["batch_size"] == config.get("trace_batch_size")
            line += f" {_cell(measured.get(run['policy']) if same_batch else None, 9)}"
        lines.append(line)
    for pipeline in dict.fromkeys(r["pipeline"] for r in runs):
        gains = [f"B={r['batch_size']}: {_ratio(runs, r, 'sd'):.3f}" for r in runs
                 if r["pipeline"] == pipeline and r["policy"] == "tetris" and _ratio(runs, r, "sd")]
        if gains:
            lines.append(f"tetris/sd tokens_per_s ({pipeline}): " + ", ".join(gains))
    if measured and "sd" in measured and "tetris" in measured:
        lines.append(f"measured tetris/sd (recorded bench run, B={config.get('trace_batch_size')}): "
                     f"{measured['tetris'] / measured['sd']:.3f}")
    return "\n".join(lines)


def write_results(results: dict, out_dir: Path) -> list[Path]:
    """DIR/results.json and the plots under DIR/plots/; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    return [out_dir / "results.json"] + write_plots(results, out_dir / "plots")


def write_plots(results: dict, plots_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    runs, written = results["runs"], []
    pipelines = list(dict.fromkeys(r["pipeline"] for r in runs))
    fig, axes = plt.subplots(1, len(pipelines), figsize=(5.5 * len(pipelines), 4.2), squeeze=False, sharey=True)
    for ax, pipeline in zip(axes[0], pipelines):
        for policy in dict.fromkeys(r["policy"] for r in runs):
            points = sorted((r["batch_size"], r["tokens_per_s"]) for r in runs
                            if r["pipeline"] == pipeline and r["policy"] == policy)
            dashed = policy == "oracle"  # an upper bound, often drawn on top of tetris
            ax.plot([b for b, _ in points], [t for _, t in points], marker="x" if dashed else "o",
                    ls="--" if dashed else "-", label=policy)
        ax.set_xscale("log", base=2)
        batch_sizes = sorted({r["batch_size"] for r in runs})
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.minorticks_off()
        ax.set_xlabel("batch size B")
        ax.set_title(f"{pipeline} pipeline")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("simulated tokens/s")
    axes[0][-1].legend()
    fig.suptitle(f"Simulated throughput — {results['config']['cost_model']}", fontsize=9)
    fig.tight_layout()
    written.append(plots_dir / "throughput_vs_batch.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    sweep = results.get("ratio_sweep")
    if sweep and sweep["points"]:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for pipeline in dict.fromkeys(p["pipeline"] for p in sweep["points"]):
            points = [p for p in sweep["points"] if p["pipeline"] == pipeline]
            ax.plot([p["ratio"] for p in points], [100 * (p["gain"] - 1) for p in points], marker="o",
                    label=f"{pipeline} pipeline")
        ax.axhline(0, color="black", lw=0.8)
        ax.axvline(sweep["native_ratio"], color="gray", ls="--", lw=1,
                   label=f"this cost model ({sweep['native_ratio']:.3f})")
        ax.set_xlabel("draft / target cost (one draft forward / one target decode forward, same B)")
        ax.set_ylabel("Tetris over SD, tokens/s (%)")
        ax.set_title(f"Gain of Tetris over SD, B={sweep['batch_size']}, k={sweep['k']}, extra={sweep['extra']}",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(plots_dir / "tetris_gain_vs_cost_ratio.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
