"""`batchspec bench`: run decoding policies side by side on the same prompts and seeds, and write the results."""

from __future__ import annotations

import argparse
import json
import sys

from batchspec.cli.options import (add_model_options, add_sampling_options, add_spec_options, positive_int,
                                   resolve_draft, spec_config)
from batchspec.errors import BatchspecError

DEFAULT_BASELINES = ("hf_generate", "hf_generate_b1", "hf_assisted_b1", "llama_cpp_b1")  # baselines.BASELINES


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="run decoding policies side by side and write results",
                                  description="Run policies on the same prompts and seeds, interleaved; print the "
                                              "metrics table and write DIR/results.json and DIR/results.csv.")
    add_model_options(bench)
    bench.add_argument("--dataset", default="humaneval",
                       help="humaneval, truthfulqa (non-code questions; `batchspec fetch truthfulqa` first), mixed "
                            "(the two in turn), jsonl:PATH or sharegpt:PATH")
    bench.add_argument("--num-prompts", type=positive_int, default=32)
    bench.add_argument("--batch-size", type=positive_int, default=16)
    bench.add_argument("--policies", default="ar,sd,dsd,tetris", help="comma-separated (ar,sd,dsd,tetris,oracle)")
    add_spec_options(bench, policies=False)
    add_sampling_options(bench, allow_auto=True)
    bench.add_argument("--trials", type=positive_int, default=1)
    bench.add_argument("--no-chat", action="store_true", help="send prompts as raw text, not chat messages")
    bench.add_argument("--out", default=None, help="write results.json and results.csv into this directory")
    bench.add_argument("--json", action="store_true", help="print results.json on stdout instead of the table")
    bench.add_argument("--sweep", nargs="+", default=[], metavar="AXIS=VALUES",
                       help="run every combination, e.g. --sweep batch_size=1,8,16 k=1..6 (axes: batch_size, k, "
                            "extra, capacity, tau, tetris_scores=q,calibrated,verifier, prune_drafts=1,0, "
                            "max_draft); one results file, plus plots against each axis")
    bench.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                       help="extra rows from other libraries, comma-separated: transformers on the same weights, "
                            "hf_generate (batch --batch-size), hf_generate_b1, hf_assisted_b1 (assistant_model = the "
                            "draft); llama_cpp_b1 (llama.cpp on the target's GGUF file, batch 1; left out with a "
                            "note where llama-cpp-python is not installed); 'none' for no baseline rows (default: "
                            "all four)")
    bench.add_argument("--baseline-prompts", type=positive_int, default=4,
                       help="prompts for the slow batch-1 baselines, hf_generate_b1 and hf_assisted_b1 (default 4; "
                            "hf_generate and llama_cpp_b1 use all)")
    bench.add_argument("--quality", choices=("humaneval",), default=None,
                       help="humaneval: run every output's HumanEval tests in sandboxed processes after the measured "
                            "runs and report pass_at_1 per policy (needs --dataset humaneval)")
    bench.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plots")
    bench.add_argument("--record-trace", default=None, metavar="FILE",
                       help="write an acceptance trace for `batchspec sim` (implies --measure-oracle); it records "
                            "trial 0 of the first of tetris, oracle, sd, dsd among --policies")
    bench.set_defaults(run=cmd_bench)
    return bench


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from batchspec.bench.run import BenchConfig, format_table, parse_sweep, run_bench, write_results
    from batchspec.spec.policies import policy_class
    from batchspec.weights.loading import load_model

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    baselines = () if args.baselines.strip() == "none" else tuple(b.strip() for b in args.baselines.split(",")
                                                                   if b.strip())
    args.measure_oracle = args.measure_oracle or bool(args.record_trace)  # the trace needs the true a[i,j]
    config = BenchConfig(dataset=args.dataset, num_prompts=args.num_prompts, batch_size=args.batch_size,
                         policies=policies, spec=spec_config(args), max_tokens=args.max_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed, trials=args.trials,
                         chat=not args.no_chat, record_trace=args.record_trace, sweep=parse_sweep(args.sweep),
                         baselines=baselines,
                         baseline_prompts=args.baseline_prompts, quality=args.quality)
    config.validate()  # every policy name known before policy_class asks
    needs_draft = any(policy_class(p).speculative for p in policies) or "hf_assisted_b1" in baselines
    if args.device != "cpu" and baselines:
        raise BatchspecError(f"--baselines run on the CPU (transformers, llama.cpp): with --device {args.device} "
                             "pass --baselines none")
    target = load_model(args.target, dtype=args.target_dtype, device=args.device)
    # The draft's shipped head vocabulary, except under a SPRINTER verifier (it reads log q and entropy over the full
    # head).
    draft = (load_model(resolve_draft(args.draft or "default", args.target), dtype=args.draft_dtype,
                        device=args.device, shipped_head=config.spec.verifier is None)
             if needs_draft else None)
    log = None if sys.stderr.isatty() else (lambda line: print(line, file=sys.stderr, flush=True))
    results = run_bench(config, target, draft, progress=sys.stderr.isatty(), log=log)
    plots = write_results(results, Path(args.out), plots=not args.no_plots) if args.out else []
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(results))
        if args.out:
            print(f"results: {Path(args.out) / 'results.json'}, {Path(args.out) / 'results.csv'}"
                  + (f", {len(plots)} plots in {Path(args.out) / 'plots'}" if plots else ""))
        if args.record_trace:
            print(f"trace: {args.record_trace}")
    return 0
