"""`batchspec generate`: generate text for one or more prompts with the target (batched, speculative with --policy)."""

from __future__ import annotations

import argparse
import json
import sys

from batchspec.cli.options import (add_model_options, add_sampling_options, add_spec_options, positive_int,
                                   resolve_draft, spec_config)
from batchspec.errors import BatchspecError


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help="generate text for one or more prompts",
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
    return gen


def cmd_generate(args: argparse.Namespace) -> int:
    from batchspec.datasets.prompts import load_prompts_file
    from batchspec.engine.engine import Engine
    from batchspec.runtime.sampling import SamplingParams
    from batchspec.spec.policies import policy_class

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += load_prompts_file(args.prompts_file)
    if not prompts:
        raise BatchspecError("no prompts: give --prompt TEXT or --prompts-file PATH")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    speculative = policy_class(args.policy).speculative
    draft = args.draft if args.draft is not None or not speculative else "default"
    engine = Engine.from_pretrained(args.target, resolve_draft(draft, args.target), draft_dtype=args.draft_dtype,
                                    target_dtype=args.target_dtype, device=args.device, spec=spec_config(args),
                                    max_batch_size=min(args.batch_size, len(prompts)), seed=args.seed)
    show_progress = not args.no_progress and sys.stderr.isatty() and len(prompts) > 1
    outputs = engine.generate(prompts, params, chat=args.chat, progress=show_progress)
    stats = engine.metrics()
    if args.json:
        json.dump({"target": args.target, "draft": draft, "policy": args.policy,
                   "target_dtype": engine.target.transformer.precision,
                   "outputs": [o.as_dict() for o in outputs], "stats": stats}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for prompt, out in zip(prompts, outputs):
            if len(prompts) > 1:
                print(f"--- [{out.index}] {prompt[:60]!r}")
            print(out.text)
        summary = (f"{stats['emitted_tokens']} tokens in {stats['wall_s']:.2f} s: {stats['tokens_per_s']:.1f} "
                   f"tokens/s ({args.policy}, batch {min(args.batch_size, len(prompts))}, target in "
                   f"{engine.target.transformer.precision}, {stats['target_calls']} target calls")
        if stats["mean_accept_len"] is not None and speculative:
            summary += f", mean accepted length {stats['mean_accept_len']:.2f}, vsr {stats['vsr']:.2f}"
        print(summary + ")", file=sys.stderr)
    return 0
