"""`batchspec sim`: replay an acceptance trace under other policies, batch sizes and hardware cost models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from batchspec.cli.options import capacity_or_auto
from batchspec.errors import BatchspecError
from batchspec.sim.simulate import PIPELINES, SIM_POLICIES, SimConfig, run_sim


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
    add("--capacity", type=capacity_or_auto, default="auto",
        help="tetris's capacity C per step: auto (default; K' and C chosen per step), fixed (k x active batch, the "
             "paper's) or a number")
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
    from batchspec.engine.trace import load_trace
    from batchspec.sim.cost_models import load_cost_model
    from batchspec.sim.report import format_table, write_results

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
