"""`batchspec bench`: policies side by side on the same prompts and seeds, interleaved, written as data.

Each trial runs every policy once on the same prompts (so machine noise hits all alike), after an untimed warm-up.
Results: DIR/results.json (`{"config": ..., "runs": [...]}` with the DESIGN.md section 6 fields), DIR/results.csv,
and the table printed on stdout.
"""

from __future__ import annotations

import csv
import json
import platform
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from batchspec.engine import Engine
from batchspec.errors import BatchspecError
from batchspec.loading import LoadedModel
from batchspec.prompts import humaneval_chat_prompt, humaneval_prompts, load_prompts_file
from batchspec.sampling import SamplingParams
from batchspec.selection import POLICIES
from batchspec.speculative import SpecConfig

TABLE_FIELDS = ("tokens_per_s", "ter_tokens_per_s", "vsr", "mean_accept_len", "system_efficiency", "target_calls",
                "oracle_fraction", "match_ar", "select_us_per_step")


@dataclass
class BenchConfig:
    dataset: str = "humaneval"
    num_prompts: int = 32
    batch_size: int = 16
    policies: tuple[str, ...] = ("ar", "sd", "dsd", "tetris")
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    trials: int = 1
    chat: bool = True  # wrap prompts in the target's chat template (instruct models)

    def validate(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise BatchspecError(f"unknown policy {unknown[0]!r}; valid policies: {', '.join(POLICIES)}")
        if self.num_prompts < 1 or self.trials < 1:
            raise BatchspecError("--num-prompts and --trials must be at least 1")


def load_dataset(spec: str, limit: int) -> list[str]:
    """`humaneval` (chat-formatted task prompts), `jsonl:PATH` or `sharegpt:PATH` -> at most `limit` prompts."""
    if spec == "humaneval":
        prompts = [humaneval_chat_prompt(p) for p in humaneval_prompts()]
    elif spec.startswith(("jsonl:", "sharegpt:")):
        prompts = load_prompts_file(spec.split(":", 1)[1])
    else:
        raise BatchspecError(f"unknown dataset {spec!r}: use humaneval, jsonl:PATH or sharegpt:PATH")
    return prompts[:limit]


def run_bench(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None,
              progress: bool = False) -> dict:
    config.validate()
    prompts = load_dataset(config.dataset, config.num_prompts)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p,
                            seed=config.seed)
    engines = {policy: Engine(target, None if policy == "ar" else draft, replace(config.spec, policy=policy),
                              max_batch_size=config.batch_size, seed=config.seed)
               for policy in config.policies}
    for policy, engine in engines.items():  # untimed warm-up (and dsd's step-time profiling)
        engine.generate(prompts[:2], replace(params, max_tokens=8), chat=config.chat)

    runs, outputs = [], {}
    for trial in range(config.trials):
        for policy, engine in engines.items():
            result = engine.generate(prompts, params, chat=config.chat, progress=progress)
            outputs[(trial, policy)] = [o.token_ids for o in result]
            metrics = engine.metrics()
            metrics.update(policy=policy, trial=trial, window_history=engine.stats.window_history)
            runs.append(metrics)
    for run in runs:
        reference = outputs.get((run["trial"], "ar"))
        mine = outputs[(run["trial"], run["policy"])]
        run["match_ar"] = (sum(a == b for a, b in zip(mine, reference)) / len(mine)) if reference else None
    return {"config": _config_dict(config, target, draft, len(prompts)), "runs": runs}


def _config_dict(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None, num_prompts: int) -> dict:
    out = asdict(config)
    out["policies"] = list(config.policies)
    out["num_prompts"] = num_prompts
    out["target"] = str(target.model_dir)
    out["draft"] = str(draft.model_dir) if draft is not None else None
    out["torch"] = torch.__version__
    out["threads"] = torch.get_num_threads()
    out["machine"] = platform.processor() or platform.machine()
    return out


def summary_rows(results: dict) -> list[dict]:
    """One row per policy: the median over trials of each table field."""
    rows = []
    for policy in results["config"]["policies"]:
        runs = [r for r in results["runs"] if r["policy"] == policy]
        row = {"policy": policy}
        for name in TABLE_FIELDS:
            values = [r[name] for r in runs if r.get(name) is not None]
            row[name] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def format_table(results: dict) -> str:
    rows = summary_rows(results)
    header = f"{'policy':>8} " + " ".join(f"{name:>17}" for name in TABLE_FIELDS)
    lines = [header]
    for row in rows:
        cells = []
        for name in TABLE_FIELDS:
            value = row[name]
            cells.append(f"{'-':>17}" if value is None else f"{value:>17.3f}" if isinstance(value, float)
                         else f"{value:>17}")
        lines.append(f"{row['policy']:>8} " + " ".join(cells))
    base = {r["policy"]: r["tokens_per_s"] for r in rows}
    if "tetris" in base:
        ratios = [f"tetris/{p} = {base['tetris'] / base[p]:.3f}" for p in ("sd", "dsd", "ar") if base.get(p)]
        lines.append("tokens_per_s ratios: " + ", ".join(ratios))
    return "\n".join(lines)


def write_results(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    flat = [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in run.items() if k != "window_history"}
            for run in results["runs"]]
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
