"""`batchspec bench`: policies side by side on the same prompts and seeds, interleaved, written as data.

Each trial runs every policy once on the same prompts (so machine noise hits all alike), after an untimed warm-up,
in an order rotated by one per trial (`trial_order`).
`sweep` repeats that for every combination of batch size, k, extra and capacity values. Prompts too long for the
context are skipped and counted. Transformers baselines (`baselines.py`) run on the same prompts in every trial, after
that trial's policies (at the first sweep point), so their ratios to the policies see the same stretch of the host.
Results (`report.py`): DIR/results.json (`{"config": ..., "runs": [...], "baselines": [...]}` with the
DESIGN.md section 6 fields), DIR/results.csv, DIR/plots/*.png, and the table printed on stdout.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace

import torch

from batchspec.bench.baselines import ALL_PROMPTS, check_baselines, run_baseline, unavailable_reason
from batchspec.bench.humaneval import add_pass_at_1
from batchspec.bench.report import (HISTORIES, POINT_FIELDS, TABLE_FIELDS, format_table, summary_rows,  # noqa: F401
                                   write_results)
from batchspec.datasets.prompts import (humaneval_chat_prompt, humaneval_prompts, interleave, load_prompts_file,
                                       sharegpt_prompts, truthfulqa_questions)
from batchspec.engine.engine import Engine
from batchspec.errors import BatchspecError
from batchspec.runtime.device import device_description
from batchspec.runtime.machine import machine_description, peak_rss_mib
from batchspec.runtime.sampling import SamplingParams
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies import LOSSLESS_POLICIES, POLICIES, policy_class
from batchspec.spec.policies.base import TETRIS_SCORES
from batchspec.weights.loading import LoadedModel


# Sweep axes that matter to some policies only (capacity: sd and dsd verify their window whatever C is).
ONLY_CHANGES = {"tau": ("sprinter", "sprinter-exact"), "tetris_scores": ("tetris",), "capacity": ("tetris", "oracle"),
                "prune_drafts": ("tetris",), "max_draft": ("tetris",)}


@dataclass
class BenchConfig:
    dataset: str = "humaneval"
    num_prompts: int = 32
    batch_size: int = 16
    policies: tuple[str, ...] = ("ar", "sd", "dsd", "tetris")
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_tokens: int | None = 128  # None: each ShareGPT prompt's reply length in tokens (`--max-tokens auto`)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    trials: int = 1
    chat: bool = True  # wrap prompts in the target's chat template (instruct models)
    record_trace: str | None = None  # write an acceptance trace of trial 0 of `trace_policy(policies)` here
    sweep: dict[str, tuple] = field(default_factory=dict)  # axis (POINT_FIELDS) -> values
    baselines: tuple[str, ...] = ()  # baselines.BASELINES
    baseline_prompts: int = 4  # prompts for the (slow) batch-1 baselines; hf_generate uses all
    quality: str | None = None  # "humaneval": run every output's HumanEval tests (pass_at_1 per run)

    def validate(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise BatchspecError(f"unknown policy {unknown[0]!r}; valid policies: {', '.join(POLICIES)}")
        if self.num_prompts < 1 or self.trials < 1 or self.baseline_prompts < 1:
            raise BatchspecError("--num-prompts, --trials and --baseline-prompts must be at least 1")
        if self.max_tokens is None and not self.dataset.startswith("sharegpt:"):
            raise BatchspecError("--max-tokens auto needs a sharegpt:PATH dataset (the reply lengths)")
        for axis, values in self.sweep.items():
            if axis not in POINT_FIELDS:
                raise BatchspecError(f"cannot sweep {axis!r}; sweepable: {', '.join(POINT_FIELDS)}")
            if axis == "tau" and not all(0.0 <= v <= 1.0 for v in values):
                raise BatchspecError("--sweep tau: values must be probabilities in [0, 1]")
            if axis == "tetris_scores":
                if not values or not set(values) <= set(TETRIS_SCORES):
                    raise BatchspecError(f"--sweep tetris_scores: values must be among {', '.join(TETRIS_SCORES)}")
                continue
            if axis == "capacity":
                values = tuple(v for v in values if isinstance(v, int)) or (0,)  # auto, fixed (None): valid
            positive = axis in ("batch_size", "k", "max_draft")
            if not values or min(values) < (1 if positive else 0):
                raise BatchspecError(f"--sweep {axis}: values must be {'>= 1' if positive else '>= 0'}")
        check_baselines(self.baselines)
        if self.quality not in (None, "humaneval"):
            raise BatchspecError(f"unknown --quality {self.quality!r}; valid: humaneval")
        if self.quality == "humaneval" and self.dataset != "humaneval":
            raise BatchspecError(f"--quality humaneval needs --dataset humaneval, not {self.dataset}")
        if self.baselines and self.max_tokens is None:
            raise BatchspecError("--baselines needs a fixed --max-tokens (not auto)")
        if self.record_trace and (not self.spec.measure_oracle or trace_policy(self.policies) is None):
            raise BatchspecError("--record-trace needs --measure-oracle and a speculative policy (sd, dsd, tetris "
                                 "or oracle)")


def trace_policy(policies) -> str | None:
    """The run a trace records: tetris or oracle first (they draft all k + extra tokens the simulator needs)."""
    return next((p for p in ("tetris", "oracle", "sd", "dsd") if p in policies), None)


DATASETS = "humaneval, truthfulqa, mixed (humaneval and truthfulqa in turn), jsonl:PATH or sharegpt:PATH"


def load_dataset(spec: str, limit: int) -> list[str]:
    """A dataset (`DATASETS`) -> at most `limit` prompts."""
    return [prompt for prompt, _, _ in load_dataset_with_kinds(spec, limit)]


def load_dataset_with_kinds(spec: str, limit: int) -> list[tuple[str, str | None, str | None]]:
    """(prompt, reference reply or None, kind: "code", "prose" or None) for at most `limit` prompts. ShareGPT files
    carry the reply that `--max-tokens auto` measures."""
    if spec == "humaneval":
        rows = [(p, None, "code") for p in _humaneval()]
    elif spec == "truthfulqa":
        rows = [(p, None, "prose") for p in _truthfulqa()]
    elif spec == "mixed":
        rows = [(p, None, ("code", "prose")[which]) for p, which in interleave(_humaneval(), _truthfulqa())]
    elif spec.startswith("sharegpt:"):
        rows = [(p, reply, None) for p, reply in sharegpt_prompts(spec.split(":", 1)[1])]
    elif spec.startswith("jsonl:"):
        rows = [(p, None, None) for p in load_prompts_file(spec.split(":", 1)[1])]
    else:
        raise BatchspecError(f"unknown dataset {spec!r}: use {DATASETS}")
    if not rows:
        raise BatchspecError(f"dataset {spec} holds no prompts")
    return rows[:limit]


def _humaneval() -> list[str]:
    return [humaneval_chat_prompt(p) for p in humaneval_prompts()]


def _truthfulqa() -> list[str]:
    from batchspec.weights.known_models import fetched_prompt_set

    return truthfulqa_questions(fetched_prompt_set("truthfulqa"))


def parse_sweep(items: list[str]) -> dict[str, tuple]:
    """["batch_size=1,8,16", "k=1..6"] -> {"batch_size": (1, 8, 16), "k": (1, 2, 3, 4, 5, 6)}.

    tau takes probabilities (tau=0.3,0.5) and tetris_scores names (tetris_scores=q,calibrated,verifier).
    """
    sweep = {}
    for item in items:
        axis, _, values = item.partition("=")
        axis = axis.strip().replace("-", "_")
        try:
            if axis == "tetris_scores":  # what Tetris ranks by: q, calibrated survival or the SPRINTER verifier
                numbers = tuple(v.strip() for v in values.split(",") if v.strip())
            elif ".." in values:
                low, high = (int(v) for v in values.split(".."))
                numbers = tuple(range(low, high + 1))
            elif axis == "capacity":  # numbers, auto (Tetris chooses C per step) or fixed (k x B: None)
                numbers = tuple({"auto": "auto", "fixed": None}[v.strip()] if v.strip() in ("auto", "fixed")
                                else int(v) for v in values.split(",") if v.strip())
            else:
                kind = float if axis == "tau" else int  # tau is sprinter's probability threshold
                numbers = tuple(kind(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise BatchspecError(f"--sweep {item!r}: expected AXIS=1,2,4 or AXIS=LOW..HIGH with integers "
                                 "(tau=0.3,0.5,0.7 with probabilities, capacity=8,fixed,auto)") from None
        if not numbers:
            raise BatchspecError(f"--sweep {item!r}: no values")
        sweep[axis] = numbers
    return sweep


def sweep_points(config: BenchConfig) -> list[BenchConfig]:
    """One config per combination of swept values (just `config` without a sweep)."""
    axes = list(config.sweep)
    points = []
    for values in itertools.product(*(config.sweep[a] for a in axes)):
        point = dict(zip(axes, values))
        spec = replace(config.spec, **{a: point[a] for a in ("k", "extra", "capacity", "tau", "tetris_scores",
                                                              "prune_drafts", "max_draft") if a in point})
        points.append(replace(config, batch_size=point.get("batch_size", config.batch_size), spec=spec))
    return points


def prepare_prompts(config: BenchConfig, target: LoadedModel,
                    draft: LoadedModel | None) -> tuple[list[str], list[int], list[str | None], int]:
    """(prompts, max_tokens per prompt, kind of each prompt ("code", "prose" or None), number skipped): prompts too
    long for the context are dropped, not fatal."""
    engine, tokenizer = Engine(target, draft), target.tokenizer
    context = engine.context_length
    kept, limits, kinds, skipped = [], [], [], 0
    for prompt, reply, kind in load_dataset_with_kinds(config.dataset, config.num_prompts):
        if not prompt.strip():
            skipped += 1
            continue
        limit = config.max_tokens if config.max_tokens is not None else max(1, len(tokenizer.encode(reply or "")))
        if len(engine.encode_prompt(prompt, config.chat)) + limit > context:
            skipped += 1
            continue
        kept.append(prompt)
        limits.append(limit)
        kinds.append(kind)
    if not kept:
        raise BatchspecError(f"no prompt of {config.dataset} fits the context window of {context} tokens")
    return kept, limits, kinds, skipped


def trial_order(policies: list[str], trial: int) -> list[str]:
    """The order the policies run in at `trial`: rotated by one per trial, so that over as many trials as policies
    each runs once in every position. Position matters on a shared host: in one process (Qwen pair, batch 8, the same
    prompts) dsd then tetris measured 55.76 / 52.90 tokens/s, tetris then dsd 54.42 / 53.30 — the later run lost
    2-5 % either way (its prompts' identical prefill took 6-18 % longer), so a fixed order biases every ratio."""
    shift = trial % len(policies) if policies else 0
    return policies[shift:] + policies[:shift]


def run_bench(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None,
              progress: bool = False, log=None) -> dict:
    """log: called with one line per finished run and baseline (for output that goes to a file)."""
    config.validate()
    prompts, limits, kinds, skipped = prepare_prompts(config, target, draft)
    params = [SamplingParams(max_tokens=m, temperature=config.temperature, top_p=config.top_p, seed=config.seed)
              for m in limits]
    runs, outputs, texts, baselines, baseline_models = [], {}, {}, [], {}
    reasons = {name: unavailable_reason(name, target) for name in config.baselines}  # None: it can run here
    baseline_notes = [note for note in reasons.values() if note]
    runnable = [name for name, note in reasons.items() if note is None]
    for note in baseline_notes:
        if log is not None:
            log(note)
    recorder, traced_requests = _trace_recorder(config), None
    lossy = any(p not in LOSSLESS_POLICIES for p in config.policies)
    if lossy or config.baselines:  # both score or re-run the prompts as token ids, encoded once here
        encoder = Engine(target)
        prompt_ids = [encoder.encode_prompt(p, config.chat) for p in prompts]
    for index, point in enumerate(sweep_points(config)):
        # A sweep over axes that change some policies only (ONLY_CHANGES) runs the others at its first point only.
        policies = [p for p in config.policies
                    if index == 0 or not set(config.sweep) <= set(ONLY_CHANGES) or
                    any(p in ONLY_CHANGES[axis] for axis in config.sweep)]
        engines = {policy: Engine(target, draft if policy_class(policy).speculative else None,
                                  replace(point.spec, policy=policy),
                                  max_batch_size=point.batch_size, seed=config.seed)
                   for policy in policies}
        for engine in engines.values():  # untimed warm-up (and dsd's step-time profiling)
            engine.generate(prompts[:2], replace(params[0], max_tokens=8), chat=config.chat)
        for trial in range(config.trials):
            for policy in trial_order(list(engines), trial):
                engine = engines[policy]
                traced = recorder is not None and (index, trial) == (0, 0) and policy == trace_policy(config.policies)
                result = engine.generate(prompts, params, chat=config.chat, progress=progress,
                                         trace=recorder if traced else None)
                if traced:
                    traced_requests = engine.last_requests
                outputs[(index, trial, policy)] = [o.token_ids for o in result]
                texts[(index, trial, policy)] = [o.text for o in result]
                metrics = engine.metrics()
                metrics.update(policy=policy, trial=trial, point=index, batch_size=point.batch_size, k=point.spec.k,
                               extra=point.spec.extra, capacity=point.spec.capacity, tau=point.spec.tau,
                               tetris_scores=point.spec.tetris_scores, prune_drafts=point.spec.prune_drafts,
                               max_draft=point.spec.max_draft,
                               window_history=engine.stats.window_history,
                               request_windows=[r.windows for r in sorted(engine.last_requests, key=lambda r: r.index)])
                runs.append(metrics)
                if log is not None:
                    log(f"point {index} trial {trial} {policy}: {metrics['tokens_per_s']:.2f} tokens/s, "
                        f"{metrics['target_calls']} target calls")
            if index == 0:  # the baseline rows, in every trial beside the policies: noise hits all alike
                reference = outputs.get((0, trial, "ar"))
                for name in runnable:
                    count = len(prompts) if name in ALL_PROMPTS else min(len(prompts), config.baseline_prompts)
                    baselines.append(run_baseline(name, target, draft, prompt_ids[:count], limits[0],
                                                  config.batch_size, reference[:count] if reference else None,
                                                  trial=trial, loaded=baseline_models))
                    if log is not None:
                        log(f"trial {trial} {name}: {baselines[-1]['tokens_per_s']:.2f} tokens/s")
    for run in runs:
        reference = outputs.get((run["point"], run["trial"], "ar"), outputs.get((0, run["trial"], "ar")))
        mine = outputs[(run["point"], run["trial"], run["policy"])]
        run["match_ar"] = (sum(a == b for a, b in zip(mine, reference)) / len(mine)) if reference else None
    if lossy:
        _add_quality(runs, outputs, texts, target, prompt_ids)
    results = {"config": {**_config_dict(config, target, draft, len(prompts)), "skipped_prompts": skipped,
                          "prompt_kinds": kinds,
                          "peak_rss_mib": peak_rss_mib(), "baseline_notes": baseline_notes},
               "runs": runs, "baselines": baselines}
    if config.quality == "humaneval":  # every run, lossless ones too: the harness check compares them with ar's
        results["pass_at_1_check"] = add_pass_at_1(runs, texts, prompts, progress=progress, log=log)  # untimed
    if recorder is not None:
        _save_trace(recorder, traced_requests, results)
    return results


def _add_quality(runs: list[dict], outputs: dict, texts: dict, target: LoadedModel,
                 prompt_ids: list[list[int]]) -> None:
    """Lossy policies (and ar, the reference): ROUGE-L against ar's text, the target's NLL per token and the share of
    tokens that are not the target's greedy choice on the output's own prefix."""
    from batchspec.bench.quality import rouge_l, target_scores

    for run in runs:
        key = (run["point"], run["trial"], run["policy"])
        if run["policy"] in LOSSLESS_POLICIES and run["policy"] != "ar":
            continue  # identical to ar at temperature 0; their quality is ar's
        reference = texts.get((run["point"], run["trial"], "ar"), texts.get((0, run["trial"], "ar")))
        run["rouge_l_ar"] = rouge_l(texts[key], reference) if reference else None
        run["target_nll"], run["target_disagreement"] = target_scores(target.transformer, prompt_ids, outputs[key])


def _trace_recorder(config: BenchConfig):
    if not config.record_trace:
        return None
    from batchspec.engine.trace import TraceRecorder

    return TraceRecorder()


def _save_trace(recorder, requests, results: dict) -> None:
    """The trace file: the recorded steps, the bench configuration, and trial 0's measured metrics of every policy."""
    from batchspec.engine.trace import save_trace

    config = results["config"]
    policy = trace_policy(config["policies"])
    # The trace holds the first sweep point's drafts: the measured runs beside it are that point's too.
    first = {r["policy"]: {k: v for k, v in r.items() if k not in HISTORIES} for r in results["runs"]
             if r["trial"] == 0 and r["point"] == 0}
    meta = {**{k: v for k, v in config.items() if k not in ("spec", "policies", "trials")}, **config["spec"],
            "policy": policy, "run": first[policy], "bench_runs": first}
    save_trace(recorder.to_trace(requests, meta), config["record_trace"])


def _config_dict(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None, num_prompts: int) -> dict:
    out = asdict(config)
    out["policies"] = list(config.policies)
    out["num_prompts"] = num_prompts
    out["target"] = str(target.model_dir)
    out["draft"] = str(draft.model_dir) if draft is not None else None
    out["target_dtype"] = target.transformer.precision
    out["draft_dtype"] = draft.transformer.precision if draft is not None else None
    out["linear_backend"] = target.transformer.linear_backend
    out["torch"] = torch.__version__
    out["threads"] = torch.get_num_threads()
    out["machine"] = machine_description()
    out["device"] = str(target.transformer.device)
    if target.transformer.device.type != "cpu":
        out["accelerator"] = device_description(target.transformer.device)
    return out
