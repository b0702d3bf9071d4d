"""`batchspec sprinter collect | train | eval`: SPRINTER's verifier data, training and evaluation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from batchspec.errors import BatchspecError
from batchspec.spec.verifier import FEATURE_SETS, LABELS, load_verifier, save_verifier


def add_sprinter_parser(subparsers) -> argparse.ArgumentParser:
    from batchspec.runtime.precision import DRAFT_PRECISION_CHOICES, PRECISIONS
    from batchspec.sprinter.data import CollectConfig
    from batchspec.sprinter.train import TrainConfig

    parser = subparsers.add_parser("sprinter", help="SPRINTER's learned verifier: collect data, train, evaluate",
                                   description="Collect verifier data from a draft/target pair, train the verifier, "
                                               "evaluate a saved one.")
    sub = parser.add_subparsers(dest="sprinter_command", required=True, metavar="STEP", parser_class=type(parser))
    d = CollectConfig()
    c = sub.add_parser("collect", help="features and labels of draft tokens on real prompts (never HumanEval)")
    c.add_argument("--target", default=d.target, help="target model: 'default', a GGUF file or an HF directory")
    c.add_argument("--draft", default=d.draft, help="draft model: 'default' (the shipped draft) or a path")
    c.add_argument("--draft-dtype", default=d.draft_dtype, choices=DRAFT_PRECISION_CHOICES,
                   help="the draft's weights, as the engine will run it (auto: bfloat16 on CPUs with native "
                        "bfloat16, else float32); a verifier belongs to its draft in one precision")
    c.add_argument("--target-dtype", default=d.target_dtype, choices=PRECISIONS,
                   help=f"the target's weights, as the engine will run it: its greedy answers label the data "
                        f"({d.target_dtype})")
    c.add_argument("--prompts", default=d.prompts, help="stdlib (default) | jsonl:PATH | sharegpt:PATH")
    c.add_argument("--num-prompts", type=int, default=d.num_prompts, help=f"prompts ({d.num_prompts})")
    c.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"target answer tokens ({d.max_tokens})")
    c.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help=f"skip longer prompts ({d.max_prompt_tokens})")
    c.add_argument("--shard-size", type=int, default=d.shard_size, help=f"prompts per shard ({d.shard_size})")
    c.add_argument("--batch-size", type=int, default=d.batch_size, help=f"target decode batch ({d.batch_size})")
    c.add_argument("--seed", type=int, default=d.seed, help=f"prompt choice and split ({d.seed})")
    c.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help=f"share of prompts held out for validation ({d.val_fraction})")
    c.add_argument("--out", required=True, help="data directory (meta.json + shards)")
    c.add_argument("--resume", action="store_true", help="continue an interrupted collection in --out")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    c.set_defaults(run=cmd_collect)

    t = TrainConfig()
    tr = sub.add_parser("train", help="train a verifier on collected data")
    tr.add_argument("data", help="directory written by `sprinter collect`")
    tr.add_argument("--out", required=True, help="verifier directory (verifier.safetensors + verifier.json)")
    tr.add_argument("--label", default=t.label, choices=LABELS, help=f"target label ({t.label})")
    tr.add_argument("--features", default=t.features, choices=FEATURE_SETS, help=f"feature set ({t.features})")
    tr.add_argument("--mlp", type=int, default=t.mlp_hidden, help="hidden units of a tiny MLP (0: logistic)")
    tr.add_argument("--threshold", type=float, default=t.threshold, help=f"accept iff prob >= tau ({t.threshold})")
    tr.add_argument("--epochs", type=int, default=t.epochs, help=f"MLP: passes over the data ({t.epochs})")
    tr.add_argument("--lr", type=float, default=t.lr, help=f"MLP: AdamW learning rate ({t.lr})")
    tr.add_argument("--l2", type=float, default=t.weight_decay,
                    help=f"L2 penalty of the logistic fit / the MLP's AdamW weight decay ({t.weight_decay})")
    tr.add_argument("--seed", type=int, default=t.seed, help=f"random seed ({t.seed})")
    tr.add_argument("--json", action="store_true", help="print the metrics as JSON")
    tr.set_defaults(run=cmd_train)

    ev = sub.add_parser("eval", help="metrics of a saved verifier on collected data")
    ev.add_argument("data", help="directory written by `sprinter collect`")
    ev.add_argument("--verifier", required=True, help="verifier directory")
    ev.add_argument("--threshold", type=float, default=None, help="override the saved threshold")
    ev.add_argument("--split", default="val", choices=("val", "train", "all"), help="rows to evaluate (val)")
    ev.add_argument("--json", action="store_true", help="print the metrics as JSON")
    ev.set_defaults(run=cmd_eval)
    return parser


def cmd_collect(args: argparse.Namespace) -> int:
    from batchspec.cli.options import resolve_draft
    from batchspec.sprinter.data import CollectConfig, run_collect

    cfg = CollectConfig(target=args.target, draft=resolve_draft(args.draft, args.target), prompts=args.prompts,
                        num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                        max_prompt_tokens=args.max_prompt_tokens, shard_size=args.shard_size,
                        batch_size=args.batch_size, seed=args.seed, val_fraction=args.val_fraction,
                        draft_dtype=args.draft_dtype, target_dtype=args.target_dtype)
    out = Path(args.out).expanduser()
    summary = run_collect(cfg, out, resume=args.resume, progress=not args.no_progress and sys.stderr.isatty())
    print(f"{summary['positions']} draft positions ({summary['train_positions']} train, {summary['val_positions']} "
          f"validation) in {out}: greedy accept rate {summary['greedy_accept_rate']:.3f}, "
          f"q <= p rate {summary['sd_accept_rate']:.3f}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from batchspec.sprinter.data import load_data
    from batchspec.sprinter.train import TrainConfig, format_metrics, train_verifier

    cfg = TrainConfig(label=args.label, features=args.features, mlp_hidden=args.mlp, threshold=args.threshold,
                      epochs=args.epochs, lr=args.lr, weight_decay=args.l2, seed=args.seed)
    cfg.validate()
    verifier = train_verifier(load_data(args.data), cfg)
    out = save_verifier(verifier, Path(args.out).expanduser())
    metrics = verifier.meta["metrics"].get("val")
    if args.json:
        print(json.dumps(verifier.meta["metrics"], indent=2))
    else:
        if metrics is None:
            print("no validation positions yet (unfinished collection?): metrics on the training positions")
        print(format_metrics(metrics or verifier.meta["metrics"]["train"], verifier.threshold))
        print(f"verifier ({cfg.features}, label {cfg.label}) written to {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from batchspec.sprinter.data import load_data
    from batchspec.sprinter.train import evaluate, format_metrics

    verifier = load_verifier(args.verifier)
    data = load_data(args.data)
    if data.meta["draft"].get("fingerprint") != verifier.draft.get("fingerprint"):
        raise BatchspecError(f"the data in {args.data} comes from another draft than the verifier's")
    if args.threshold is not None:
        if not 0.0 < args.threshold < 1.0:
            raise BatchspecError(f"--threshold must be in (0, 1), got {args.threshold}")
        verifier.threshold = args.threshold
    rows = data.split(args.split)
    if len(rows["logq"]) == 0:
        raise BatchspecError(f"no {args.split} rows in {args.data}")
    metrics = evaluate(verifier, rows, data.split("train") if args.split == "val" else None)
    print(json.dumps(metrics, indent=2) if args.json else format_metrics(metrics, verifier.threshold))
    return 0
