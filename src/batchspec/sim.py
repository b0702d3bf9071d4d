"""Trace-driven simulator: replay recorded draft statistics under any policy, batch size, cost model and pipeline.

The batch loop mirrors `Engine.generate`: requests wait, are admitted into free slots (a prefill iteration), and every
other iteration is one speculative step over the active ones: propose K' drafts, select windows with the real policy
functions (selection.py, tetris.py, dsd.py), verify (acceptance drawn from the recorded a[i,j]), commit, retire
finished requests.
Time comes from a cost model instead of a clock. Sequential pipeline: a step costs K' draft forwards + the target
forward + selection; parallel pipeline (the next step's drafting overlaps this step's verification):
max(drafting, target) + selection.

What a simulated step sees: each request replays one recorded request (the trace's own requests with `replay`, else
drawn with replacement), and at output position `pos` it sees the drafts a step starting there saw in the recorded
run (`trace.build_timelines`: exact at temperature 0, so a replay of the recorded run takes its steps token for token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from batchspec.cost_model import DraftRatioCostModel, draft_target_ratio
from batchspec.errors import BatchspecError
from batchspec.metrics import RunStats, summarize
from batchspec.dsd import AcceptanceEMA, dsd_choose_k
from batchspec.selection import draft_length, select_windows
from batchspec.tetris import expected_accepted, oracle_windows
from batchspec.trace import Timelines, build_timelines

SIM_POLICIES = ("sd", "dsd", "tetris", "oracle")
PIPELINES = ("sequential", "parallel")


@dataclass(frozen=True)
class SimConfig:
    policy: str = "tetris"
    batch_size: int = 16
    k: int = 4
    extra: int = 2
    capacity: int | None = None  # None: C = k x active batch, as in the engine
    pipeline: str = "sequential"
    num_requests: int | None = None  # None: 16 x batch_size, drawn with replacement (the drain tail stays small)
    replay: bool = False  # the trace's own requests, in order, once (the validation setting)
    seed: int = 0
    k_max: int = 8  # dsd's largest window (clamped to the trace's K')
    turn_on_batch_size: int = 1

    def validate(self, width: int) -> None:
        if self.policy not in SIM_POLICIES:
            raise BatchspecError(f"unknown sim policy {self.policy!r}; valid: {', '.join(SIM_POLICIES)}")
        if self.pipeline not in PIPELINES:
            raise BatchspecError(f"unknown pipeline {self.pipeline!r}; valid: {', '.join(PIPELINES)}")
        if self.k < 1 or self.extra < 0 or self.batch_size < 1:
            raise BatchspecError("need k >= 1, extra >= 0 and batch sizes >= 1")
        wanted = self.k + self.extra if self.policy in ("tetris", "oracle") else self.k
        if self.policy != "dsd" and wanted > width:
            raise BatchspecError(f"the trace has {width} drafts per step; {self.policy} needs {wanted} "
                                 f"(record with a larger k + extra)")
        if self.policy == "dsd" and self.k_max < 1:
            raise BatchspecError(f"k_max must be >= 1 for dsd (got {self.k_max})")
        if self.capacity is not None and self.capacity < 0:
            raise BatchspecError(f"capacity must be >= 0 (got {self.capacity})")


def simulate(timelines: Timelines, cost, config: SimConfig) -> dict:
    """One simulated run: the DESIGN.md section 6 metrics with simulated time (plus the time split)."""
    config.validate(timelines.width)
    batch_cap = config.batch_size
    rng = np.random.default_rng([config.seed, batch_cap, 1])  # acceptance draws; same stream for every policy
    pick = np.random.default_rng([config.seed, batch_cap, 2])
    num = len(timelines.output_len) if config.replay else (config.num_requests or 16 * batch_cap)
    chosen = np.arange(num) if config.replay else pick.integers(0, len(timelines.output_len), num)
    waiting = deque(int(r) for r in chosen)
    stats, clock, ema, prefill_s = RunStats(), 0.0, AcceptanceEMA(), 0.0
    pos = {}  # sim request id -> output position; ids index `chosen`
    first, finish = np.zeros(num), np.zeros(num)
    active: list[int] = []
    next_id = 0
    while waiting or active:
        if waiting and len(active) < batch_cap:  # prefill iteration: admit, emit each request's first token
            admitted = [waiting.popleft() for _ in range(min(batch_cap - len(active), len(waiting)))]
            ids = list(range(next_id, next_id + len(admitted)))
            next_id += len(admitted)
            tokens = int(timelines.prompt_len[admitted].sum())
            target_s, draft_s = cost.prefill_s(tokens, len(admitted))
            clock, prefill_s = clock + target_s + draft_s, prefill_s + target_s + draft_s
            stats.target_s, stats.draft_s = stats.target_s + target_s, stats.draft_s + draft_s
            stats.target_calls, stats.target_tokens = stats.target_calls + 1, stats.target_tokens + tokens
            stats.emitted_tokens += len(admitted)
            for i in ids:
                pos[i], first[i] = 1, clock
            active += ids
        else:
            seconds, ema = _step(timelines, cost, config, active, pos, chosen, stats, rng, ema)
            clock += seconds
        for i in [i for i in active if pos[i] >= timelines.output_len[chosen[i]]]:
            finish[i] = clock
            active.remove(i)
    stats.wall_s = clock
    out = summarize(stats, list(finish), list(first))
    decode_s = clock - prefill_s  # speculative steps only: throughput without prompt processing
    out.update(policy=config.policy, batch_size=batch_cap, pipeline=config.pipeline, num_requests=num,
               cost_model=cost.name, match_ar=None, prefill_s=prefill_s,
               decode_tokens_per_s=stats.step_emitted / decode_s if decode_s > 0 else 0.0)
    return out


def _step(timelines: Timelines, cost, config: SimConfig, active: list[int], pos: dict, chosen: np.ndarray,
          stats: RunStats, rng: np.random.Generator, ema: AcceptanceEMA) -> tuple[float, AcceptanceEMA]:
    """One speculative step over `active`: advances positions and counters; returns (seconds, dsd's new EMA)."""
    batch, width = len(active), timelines.width
    requests = chosen[active]  # (B,) trace request of each active sim request
    positions = np.array([pos[i] for i in active])  # (B,)
    context = int((timelines.prompt_len[requests] + positions).sum())
    k = config.k
    if config.policy == "dsd":  # goodput under the simulated hardware's step time, as if profiled there
        k = dsd_choose_k(ema.value, batch, min(config.k_max, width),
                         lambda b, kk: _step_time(cost, config.pipeline, config.policy, b, kk, b * (kk + 1), context))
    k_prime = draft_length(config.policy, k, config.extra, batch, config.turn_on_batch_size)
    rows = timelines.offset[requests] + positions  # (B,)
    logprobs = torch.from_numpy(timelines.logprobs[rows, :k_prime])  # (B, K')
    accept = torch.from_numpy(timelines.accept[rows, :k_prime])  # (B, K')
    capacity = min(k * batch if config.capacity is None else config.capacity, batch * k_prime)
    windows = np.zeros(batch, dtype=np.int64)  # (B,) k' = 0 (dsd chose plain decoding): one token per request
    if k_prime:
        windows = select_windows(config.policy, draft_logprobs=logprobs, k=k, capacity=capacity,
                                 turn_on_batch_size=config.turn_on_batch_size, accept_probs=accept).numpy()
    # Verification: draft j survives with probability a[i,j], in cascade; the uniforms are drawn for the widest
    # window so that every policy sees the same random stream (common random numbers).
    passed = rng.random((batch, width))[:, :k_prime] < accept.numpy()  # (B, K')
    survived = np.cumprod(passed, axis=1)  # (B, K')
    accepted = (survived * (np.arange(k_prime)[None, :] < windows[:, None])).sum(axis=1)  # (B,)
    emitted = np.minimum(accepted + 1, timelines.output_len[requests] - positions)  # (B,) stops at the request's end
    for i, n in zip(active, emitted.tolist()):
        pos[i] += n

    step_s = _step_time(cost, config.pipeline, config.policy, batch, k_prime, int(windows.sum()) + batch, context)
    stats.draft_s += k_prime * cost.draft_s(batch, context) if k_prime else 0.0
    stats.target_s += cost.target_s(batch, int(windows.sum()) + batch, context)
    stats.select_s += cost.select_s(config.policy)
    stats.target_calls += 1
    stats.target_tokens += int(windows.sum()) + batch
    stats.draft_tokens += batch * k_prime
    stats.emitted_tokens += int(emitted.sum())
    stats.steps += 1
    stats.request_steps += batch
    stats.verified += int(windows.sum())
    stats.accepted += int(accepted.sum())
    stats.step_emitted += int(emitted.sum())
    stats.record_positions(windows.tolist(), accepted.tolist())
    if k_prime:
        windows_t = torch.from_numpy(np.asarray(windows, dtype=np.int64))
        stats.policy_expected += expected_accepted(accept, windows_t)
        stats.oracle_expected += expected_accepted(accept, oracle_windows(accept, capacity))
    if config.policy == "dsd" and windows.sum():
        ema = ema.update(float(accepted.sum()) / float(windows.sum()))
    return step_s, ema


def _step_time(cost, pipeline: str, policy: str, batch: int, k_prime: int, target_tokens: int, context: int) -> float:
    """Seconds of one step: drafting K' tokens, one target forward over `target_tokens` positions, selection."""
    draft = k_prime * cost.draft_s(batch, context) if k_prime else 0.0
    target = cost.target_s(batch, target_tokens, context)
    overlap = max(draft, target) if pipeline == "parallel" else draft + target
    return overlap + cost.select_s(policy) + cost.step_overhead_s


# ---------------------------------------------------------------------------------------------------------------
# Grids, the draft-cost sweep, and the `batchspec sim` command
# ---------------------------------------------------------------------------------------------------------------

RATIOS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # draft forward / target decode forward, for the gain plot


def run_sim(trace, cost, policies: Sequence[str], batch_sizes: Sequence[int], pipelines: Sequence[str],
            base: SimConfig, sweep: bool = False) -> dict:
    """Every (pipeline, batch size, policy) run, plus optionally Tetris-vs-SD over draft/target cost ratios."""
    timelines = build_timelines(trace)
    runs = [simulate(timelines, cost, replace(base, policy=p, batch_size=b, pipeline=pl))
            for pl in pipelines for b in batch_sizes for p in policies]
    config = {"trace_meta": {k: v for k, v in trace.meta.items() if k != "run"}, "trace_batch_size":
              trace.meta.get("batch_size"), "cost_model": cost.name, "policies": list(policies),
              "batch_sizes": list(batch_sizes), "pipelines": list(pipelines), **asdict(base)}
    if hasattr(cost, "to_dict"):
        config["cost_model_params"] = cost.to_dict()
    if base.replay and trace.meta.get("bench_runs"):
        config["measured_tokens_per_s"] = {p: r["tokens_per_s"] for p, r in trace.meta["bench_runs"].items()}
    results = {"config": config, "runs": runs}
    if sweep:
        results["ratio_sweep"] = ratio_sweep(timelines, cost, max(batch_sizes), base, pipelines)
    return results


def ratio_sweep(timelines: Timelines, cost, batch_size: int, base: SimConfig, pipelines: Sequence[str],
                ratios: Sequence[float] = RATIOS) -> dict:
    """tokens_per_s of tetris over sd when one draft forward costs `ratio` x one target decode forward."""
    context = int(batch_size * (timelines.prompt_len.mean() + timelines.output_len.mean() / 2))  # a typical step
    points = []
    for pipeline in pipelines:
        for ratio in ratios:
            model = DraftRatioCostModel(cost, ratio)
            tps = {p: simulate(timelines, model, replace(base, policy=p, batch_size=batch_size, pipeline=pipeline))
                   ["tokens_per_s"] for p in ("sd", "tetris")}
            points.append({"pipeline": pipeline, "ratio": ratio, "sd_tokens_per_s": tps["sd"],
                           "tetris_tokens_per_s": tps["tetris"], "gain": tps["tetris"] / tps["sd"]})
    return {"batch_size": batch_size, "k": base.k, "extra": base.extra, "points": points,
            "native_ratio": draft_target_ratio(cost, batch_size, context)}


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BatchspecError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise BatchspecError(f"{what} must be positive integers, got {text!r}")
    return values


def add_sim_parser(subparsers):
    p = subparsers.add_parser(
        "sim", help="replay an acceptance trace under other policies, batch sizes and hardware cost models",
        description="Replay a trace recorded by `batchspec bench --record-trace` (bootstrapping its requests to "
                    "reach large batch sizes) and report the bench metrics with simulated time. Prints a table with "
                    "Tetris/SD ratios; --out DIR writes DIR/results.json and DIR/plots/*.png.")
    add = p.add_argument
    add("--trace", required=True, help="trace file from `batchspec bench --record-trace FILE`")
    add("--cost-model", default="trace",
        help="trace (fitted on this machine from the trace's own step timings), llama70b-h100x8, llama405b-h100x8 "
             "(analytic rooflines), or a JSON file (default trace)")
    add("--policies", default="sd,dsd,tetris,oracle", help="comma-separated, from sd,dsd,tetris,oracle")
    add("--batch-sizes", default="16,32,64", help="comma-separated batch sizes (default 16,32,64)")
    add("-k", "--k", type=int, default=4, help="draft window of sd / base window (default 4)")
    add("--extra", type=int, default=2, help="extra draft tokens Tetris may choose from (default 2)")
    add("--capacity", type=int, default=None, help="verification capacity C per step (default k x active batch)")
    add("--k-max", type=int, default=8, help="largest window dsd may choose, at most the trace's K' (default 8)")
    add("--pipeline", default="both", choices=("sequential", "parallel", "both"),
        help="sequential: draft then verify; parallel: drafting overlaps verification (default both)")
    add("--num-requests", type=int, default=None,
        help="requests per run, drawn with replacement from the trace (default 16 x batch size: fewer run faster "
             "but weigh the end of the run, where the batch drains, more)")
    add("--replay", action="store_true",
        help="replay the trace's own requests once, in order (validation against the recorded run)")
    add("--seed", type=int, default=0, help="seed of request sampling and acceptance draws (default 0)")
    add("--save-cost-model", default=None, help="also write the cost model used as JSON (editable, for --cost-model)")
    add("--no-sweep", action="store_true", help="with --out, skip the draft/target cost-ratio sweep and its plot")
    add("--out", default=None, help="write results.json and plots/ into this directory")
    add("--json", action="store_true", help="print results.json on stdout instead of the table")
    p.set_defaults(run=cmd_sim)
    return p


def cmd_sim(args) -> int:
    import json
    import sys
    from pathlib import Path

    from batchspec.cost_model import load_cost_model
    from batchspec.sim_report import format_table, write_results
    from batchspec.trace import load_trace

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in SIM_POLICIES]
    if unknown or not policies:
        raise BatchspecError(f"unknown sim policy {unknown[0] if unknown else ''!r}; valid: {', '.join(SIM_POLICIES)}")
    if args.num_requests is not None and args.num_requests < 1:
        raise BatchspecError(f"--num-requests must be at least 1 (got {args.num_requests})")
    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    trace = load_trace(args.trace)
    cost = load_cost_model(args.cost_model, trace)
    if args.save_cost_model:
        Path(args.save_cost_model).write_text(json.dumps(cost.to_dict(), indent=2) + "\n")
    base = SimConfig(k=args.k, extra=args.extra, capacity=args.capacity, num_requests=args.num_requests,
                     replay=args.replay, seed=args.seed, k_max=args.k_max)
    pipelines = PIPELINES if args.pipeline == "both" else (args.pipeline,)
    sweep = bool(args.out) and not args.no_sweep
    results = run_sim(trace, cost, policies, batch_sizes, pipelines, base, sweep=sweep)
    results["config"]["trace"] = str(args.trace)
    written = write_results(results, Path(args.out)) if args.out else []
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(results))
        if written:
            print("written: " + ", ".join(str(p) for p in written))
    return 0
