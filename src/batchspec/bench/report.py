"""Bench output: the summary table (median over trials per sweep point and policy), results.json/csv and plots."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from batchspec.bench.plots import baselines_by_name, write_plots

TABLE_FIELDS = ("tokens_per_s", "ter_tokens_per_s", "vsr", "mean_accept_len", "system_efficiency", "target_calls",
                "draft_tokens", "oracle_fraction", "match_ar", "select_us_per_step")
HISTORIES = ("window_history", "request_windows")  # per step: in results.json, not in the csv
QUALITY_FIELDS = ("rouge_l_ar", "target_nll", "target_disagreement")  # lossy runs only (sprinter), and ar for reference
CORRECTNESS_FIELDS = ("pass_at_1",)  # every run, with --quality humaneval
POINT_FIELDS = ("batch_size", "k", "extra", "capacity", "tau", "tetris_scores", "prune_drafts", "max_draft")


def _point_label(run: dict, swept: list[str]) -> str:
    return " ".join(f"{axis}={run.get(axis)}" for axis in swept)


def summary_rows(results: dict) -> list[dict]:
    """One row per (sweep point, policy): the median over trials of each table field."""
    swept = list(results["config"].get("sweep") or {})
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in results["runs"]:
        groups.setdefault((_point_label(run, swept), run["policy"]), []).append(run)
    rows = []
    for (point, policy), runs in groups.items():
        row = {"policy": policy, "point": point}
        for name in TABLE_FIELDS + QUALITY_FIELDS + CORRECTNESS_FIELDS:
            values = [r[name] for r in runs if r.get(name) is not None]
            row[name] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def _cell(value) -> str:
    if value is None:
        return f"{'-':>17}"
    return f"{value:>17.3f}" if isinstance(value, float) else f"{value:>17}"


def format_table(results: dict) -> str:
    rows = summary_rows(results)
    header = f"{'policy':>15} " + " ".join(f"{name:>17}" for name in TABLE_FIELDS)
    ours = [r for r in rows if not r["policy"].startswith("hf_")]
    config = results["config"]
    # Absolute tokens/s depend on the CPU (sessions and users land on different ones): say which one this was.
    lines = []
    if config.get("machine"):
        target = f", target in {config['target_dtype']}" if config.get("target_dtype") else ""
        draft = f", draft in {config['draft_dtype']}" if config.get("draft_dtype") else ""
        linears = f", linear layers in {config['linear_backend']}" if config.get("linear_backend") else ""
        memory = f", peak memory {config['peak_rss_mib'] / 1024:.2f} GiB" if config.get("peak_rss_mib") else ""
        gpu = f", models on {config['accelerator']}" if config.get("accelerator") else ""
        lines.append(f"measured on {config['machine']}{gpu}, torch {config.get('torch', '?')}{target}{draft}{linears}"
                     f"{memory}")
    for point in dict.fromkeys(r["point"] for r in ours):
        group = [r for r in ours if r["point"] == point]
        lines += ([f"[{point}]"] if point else []) + [header]
        lines += [f"{r['policy']:>15} " + " ".join(_cell(r[name]) for name in TABLE_FIELDS) for r in group]
        lines += [f"quality {r['policy']}: ROUGE-L vs ar {_cell(r['rouge_l_ar']).strip()}, target NLL/token "
                  f"{_cell(r['target_nll']).strip()}, not the target's greedy token "
                  f"{_cell(r.get('target_disagreement')).strip()}" for r in group if r.get("target_nll") is not None]
        passing = [f"{r['policy']} {r['pass_at_1']:.3f}" for r in group if r.get("pass_at_1") is not None]
        lines += ["HumanEval pass@1: " + ", ".join(passing)] if passing else []
        speed = {r["policy"]: r["tokens_per_s"] for r in group if r["tokens_per_s"]}
        if "tetris" in speed:
            ratios = [f"tetris/{p} = {speed['tetris'] / speed[p]:.3f}" for p in ("sd", "dsd", "ar") if p in speed]
            baselines = [p for p in ("ar", "sd", "dsd") if p in speed]
            if len(baselines) > 1:
                best = max(baselines, key=speed.get)
                ratios.append(f"tetris/best of {'/'.join(baselines)} = {speed['tetris'] / speed[best]:.3f} ({best})")
            lines += ["tokens_per_s ratios: " + ", ".join(ratios)] if ratios else []
        lines += windows_by_kind(results, point)
    for baseline in baseline_rows(results):
        match = "-" if baseline.get("match_ar") is None else f"{baseline['match_ar']:.3f}"
        spread = (f", min {baseline['min_tokens_per_s']:.1f} max {baseline['max_tokens_per_s']:.1f} over "
                  f"{baseline['trials']} trials" if baseline["trials"] > 1 else "")
        lines.append(f"{baseline['policy']:>15} {baseline['tokens_per_s']:>17.3f} tokens/s  match_ar {match}  "
                     f"({baseline['library']}, batch {baseline['batch_size']}, {baseline['num_prompts']} prompts"
                     f"{spread})")
    ratio = baseline_ratios(results)
    if ratio:
        lines.append(ratio)
    lines += results["config"].get("baseline_notes") or []
    lines += pass_at_1_check_lines(results.get("pass_at_1_check"))
    skipped = results["config"].get("skipped_prompts")
    if skipped:
        lines.append(f"skipped {skipped} prompt(s) longer than the context window")
    return "\n".join(lines)


def pass_at_1_check_lines(check: dict | None) -> list[str]:
    """The harness check of --quality humaneval: lossless runs with ar's outputs must have ar's pass@1."""
    if not check:
        return []
    if check["ok"]:
        return [f"pass@1 check: ok ({check['checked_runs']} lossless runs with ar's outputs have ar's pass@1)"]
    return [f"WARNING: pass@1 check failed, the harness is broken: {m}" for m in check["mismatches"]]


def mean_windows_by_kind(results: dict, point: str) -> dict[str, dict[str, float]]:
    """{policy: {prompt kind: mean window l over that kind's requests and steps}} of the first trial at `point`,
    for datasets that mix kinds of prompts (`--dataset mixed`)."""
    kinds = results["config"].get("prompt_kinds") or []
    if len(set(k for k in kinds if k)) < 2:
        return {}
    swept = list(results["config"].get("sweep") or {})
    out: dict[str, dict[str, float]] = {}
    for run in results["runs"]:
        if run["trial"] != 0 or _point_label(run, swept) != point or not run.get("request_windows"):
            continue
        if not any(run["request_windows"]) or run["policy"] in out:
            continue
        totals: dict[str, list[int]] = {}
        for kind, windows in zip(kinds, run["request_windows"]):
            totals.setdefault(kind, []).extend(windows)
        out[run["policy"]] = {kind: sum(w) / len(w) for kind, w in totals.items() if w}
    return out


def windows_by_kind(results: dict, point: str) -> list[str]:
    means = mean_windows_by_kind(results, point)
    return ["mean window by prompt kind: " + "; ".join(
        f"{policy} " + " ".join(f"{kind} {mean:.2f}" for kind, mean in sorted(by_kind.items()))
        for policy, by_kind in means.items())] if means else []


def baseline_rows(results: dict) -> list[dict]:
    """One row per baseline: its median tokens/s over trials (min/max beside), the worst match_ar."""
    rows = []
    for trials in baselines_by_name(results).values():
        speeds = [r["tokens_per_s"] for r in trials]
        matches = [r["match_ar"] for r in trials if r.get("match_ar") is not None]
        rows.append({**trials[0], "tokens_per_s": statistics.median(speeds), "min_tokens_per_s": min(speeds),
                     "max_tokens_per_s": max(speeds), "match_ar": min(matches) if matches else None,
                     "trials": len(trials)})
    return rows


def baseline_ratios(results: dict) -> str | None:
    """batchspec's fastest policy over each baseline of the same batch size (medians of tokens/s).

    Like with like: a batch-1 baseline is compared with a batch-1 run of ours only (a sweep point or the bench's
    own batch size), never with a batched run; a baseline without a same-size run of ours gets no ratio.
    """
    baselines = [b for b in baseline_rows(results) if b["tokens_per_s"]]
    ours = [r for r in summary_rows(results) if r["tokens_per_s"]]
    if not baselines or not ours:
        return None
    swept = list(results["config"].get("sweep") or {})
    labels = {(_point_label(run, swept), run["policy"]): run["batch_size"] for run in results["runs"]}
    parts = []
    for baseline in baselines:
        same = [r for r in ours if labels.get((r["point"], r["policy"])) == baseline["batch_size"]]
        if not same:
            continue
        best = max(same, key=lambda r: r["tokens_per_s"])
        parts.append(f"{best['policy']}/{baseline['policy']} = {best['tokens_per_s'] / baseline['tokens_per_s']:.2f}x "
                     f"(batch {baseline['batch_size']})")
    return ("best batchspec policy vs each baseline at the same batch size: " + ", ".join(parts)) if parts else None


def write_results(results: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    """results.json, results.csv (one line per run and baseline) and, with `plots`, PNGs under plots/."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    flat = [{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in run.items() if k not in HISTORIES}
            for run in results["runs"] + results.get("baselines", [])]
    fields = list(dict.fromkeys(k for row in flat for k in row))
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(flat)
    if not plots:
        return []
    return write_plots(results, out_dir / "plots")
