"""`batchspec distill`: train a small draft model for a target by distillation (`batchspec.distill.pipeline`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchspec.distill.config import DistillConfig


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    from batchspec.distill.gguf_export import MATRIX_TYPES
    from batchspec.runtime.precision import DTYPE_CHOICES

    d = DistillConfig()
    p = subparsers.add_parser(
        "distill", help="train a small draft model for a target by distillation",
        description="Generate teacher data with the target from prompts built from Python functions (the standard "
                    "library's ~12,400, then those of batchspec's pinned dependencies; never HumanEval), then "
                    "train a small Llama draft on the target's top-k distributions. Resumable (--resume).")
    p.add_argument("--target", default="default", help="target model: 'default', a GGUF file or an HF directory")
    p.add_argument("--out", required=True, help="output directory: the draft model, plus work/ (data, checkpoints)")
    add = p.add_argument
    add("--num-prompts", type=int, default=d.num_prompts, help=f"prompts answered by the target ({d.num_prompts})")
    add("--gen-tokens", type=int, default=d.gen_tokens, help=f"max response tokens per prompt ({d.gen_tokens})")
    add("--shard-size", type=int, default=d.shard_size, help=f"prompts per generation batch/shard ({d.shard_size})")
    add("--forced-prompts", type=int, default=d.forced_prompts,
        help=f"extra teacher-forced samples: stdlib functions as answers, no generation ({d.forced_prompts})")
    add("--top-k", type=int, default=d.top_k, help=f"teacher log-probs kept per position ({d.top_k})")
    add("--sample-fraction", type=float, default=d.sample_fraction,
        help=f"share of prompts answered at temperature 1 rather than greedily ({d.sample_fraction})")
    add("--hidden", type=int, default=d.hidden, help=f"draft hidden size ({d.hidden})")
    add("--layers", type=int, default=d.layers, help=f"draft layers ({d.layers})")
    add("--heads", type=int, default=d.heads, help=f"draft attention heads ({d.heads})")
    add("--kv-heads", type=int, default=d.kv_heads, help=f"draft key/value heads ({d.kv_heads})")
    add("--intermediate", type=int, default=d.intermediate, help=f"draft MLP size ({d.intermediate})")
    add("--init-layers", default=d.init_layers,
        help="copy these target layers, e.g. '0,1', with the target's embedding and head, instead of a fresh small "
             "model (--hidden/--layers/--heads/--kv-heads/--intermediate are then ignored)")
    add("--freeze-embedding", action="store_true", help="keep the embedding / LM head fixed while training")
    add("--steps", type=int, default=d.steps, help=f"optimiser steps ({d.steps})")
    add("--batch-tokens", type=int, default=d.batch_tokens, help=f"tokens per step ({d.batch_tokens})")
    add("--lr", type=float, default=d.lr, help=f"peak learning rate ({d.lr})")
    add("--ce-weight", type=float, default=d.ce_weight, help=f"weight of the top-1 cross-entropy ({d.ce_weight})")
    add("--save-every", type=int, default=d.save_every, help=f"checkpoint every N steps ({d.save_every})")
    add("--seed", type=int, default=d.seed, help=f"random seed ({d.seed})")
    add("--head-vocab", type=int, default=d.head_vocab,
        help="restrict the draft's LM head to the N tokens the target emits most often in the teacher data "
             "(0: the full vocabulary); 8192 cuts the default draft's step time by a third at ~no loss of acceptance")
    add("--train-dtype", default=d.train_dtype, choices=DTYPE_CHOICES,
        help=f"precision of the training step's matrix products ({d.train_dtype}: bfloat16 where the CPU computes "
             "it natively, else float32); bfloat16 runs them under autocast, weights and optimiser stay float32")
    add("--gguf-type", default=d.gguf_type, choices=MATRIX_TYPES,
        help=f"block format of the trained matrices in OUT/draft.gguf ({d.gguf_type}; beside the Q8_0 embedding, "
             "Q5_1 fits six layers in 50 MB, Q4_1 eight)")
    add("--threads", type=int, default=None, help="torch threads (default: all cores)")
    add("--resume", action="store_true",
        help="continue the run in --out: an interrupted one, or one given more --num-prompts / --forced-prompts "
             "(new teacher data, the held-out set kept) or more --steps")
    add("--data-only", action="store_true", help="stop after generating the teacher data")
    add("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(run=cmd_distill)
    return p


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    fields = DistillConfig.__dataclass_fields__
    cfg = DistillConfig(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    cfg.validate()
    return cfg


def cmd_distill(args: argparse.Namespace) -> int:
    from batchspec.distill.pipeline import run_distill
    from batchspec.runtime.threads import configure_threads

    cfg = config_from_args(args)
    configure_threads(args.threads)
    out = Path(args.out).expanduser()
    progress = not args.no_progress and sys.stderr.isatty()
    summary = run_distill(cfg, out, resume=args.resume, progress=progress, data_only=args.data_only)
    if args.data_only:
        print(f"teacher data in {out / 'work' / 'data'} ({summary['data_s'] / 60:.1f} min)")
        return 0
    first, last = summary["log"][0], summary["log"][-1]
    print(f"draft written to {out} ({summary['parameters'] / 1e6:.1f} M parameters, {cfg.steps} steps, "
          f"{summary['total_s'] / 60:.1f} min): held-out KL {first['val_kl']:.3f} -> {last['val_kl']:.3f}, "
          f"top-1 agreement {first['val_top1']:.3f} -> {last['val_top1']:.3f}")
    if (out / "draft.gguf").is_file():
        print(f"packed with the target's quantised embedding: {out / 'draft.gguf'} "
              f"({(out / 'draft.gguf').stat().st_size / 2**20:.1f} MiB)")
    return 0
