"""Options shared by the subcommands (models, policy, sampling) and the argparse flavour they all use."""

from __future__ import annotations

import argparse


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    from batchspec.runtime.precision import DEFAULT_TARGET_DTYPE, DRAFT_PRECISION_CHOICES, TARGET_PRECISION_CHOICES
    from batchspec.weights.known_models import KNOWN_MODELS

    names = ", ".join(KNOWN_MODELS)
    parser.add_argument("--target", default="default",
                        help=f"target model: 'default' (SmolLM2-135M-Instruct), a known name ({names}; "
                             "`batchspec fetch NAME` first), a GGUF file or an HF directory")
    parser.add_argument("--draft", default=None,
                        help="draft model for speculative policies: 'default' (the named target's paired draft, "
                             "else the shipped SmolLM2 draft), a known name, a GGUF file or an HF directory")
    parser.add_argument("--target-dtype", default=DEFAULT_TARGET_DTYPE, choices=TARGET_PRECISION_CHOICES,
                        help="the target's weights: float32 (default; the reference tests compare with "
                             "transformers), bfloat16 (about 2x faster where the CPU computes it natively, "
                             "AVX512-BF16 or AMX; emulated and ~20x slower on AVX2-only CPUs), int8 (weight-only, "
                             "bfloat16 activations) or auto (bfloat16 where native or on a GPU, else float32). "
                             "Lossless policies reproduce ar at the same dtype")
    parser.add_argument("--device", default="cpu",
                        help="where both models run: cpu (default) or cuda / cuda:N (a CUDA build of PyTorch; "
                             "float32 or bfloat16 weights, the draft's auto means bfloat16 there)")
    parser.add_argument("--draft-dtype", default="auto", choices=DRAFT_PRECISION_CHOICES,
                        help="the draft's weights: auto (bfloat16 where the CPU computes it natively, AVX512-BF16 "
                             "or AMX; else float32), float32, bfloat16, int8 or int4 (weight-only; int4 about 3x "
                             "faster than bfloat16 at batch 1, no faster from ~8 rows). Lossless whatever it is: "
                             "the target decides every token")


def add_spec_options(parser: argparse.ArgumentParser, policies: bool = True) -> None:
    from batchspec.spec.policies import POLICIES

    if policies:
        parser.add_argument("--policy", default="ar", choices=POLICIES,
                            help="ar (target only), sd, dsd, tetris, oracle (all lossless) or sprinter "
                                 "(learned verifier, approximate) (default ar)")
    parser.add_argument("-k", "--k", type=int, default=4, help="draft window of sd / base window (default 4)")
    parser.add_argument("--extra", type=int, default=2, help="extra draft tokens Tetris may choose from (default 2)")
    parser.add_argument("--capacity", type=capacity_or_auto, default="auto",
                        help="tetris's verification capacity C per step: auto (default) chooses K' and C each step "
                             "for the most expected tokens per second, from calibrated acceptance and this "
                             "machine's profiled step times; fixed: k x active batch (the Tetris paper's); or a "
                             "number. The oracle verifies k x active batch unless given a number")
    parser.add_argument("--turn-on-batch-size", type=int, default=1,
                        help="below this many active requests Tetris behaves as sd (default 1)")
    parser.add_argument("--k-max", type=int, default=8,
                        help="largest window dsd may choose (default 8)")
    parser.add_argument("--max-draft", type=int, default=None,
                        help="most drafts tetris --capacity auto gives a request in a step, K' "
                             "(default: twice --k-max)")
    parser.add_argument("--measure-oracle", action="store_true",
                        help="extra untimed target pass over all drafts to report oracle_fraction")
    parser.add_argument("--verifier", default=None,
                        help="SPRINTER verifier directory ('default': the one shipped for the default draft); "
                             "needed by --policy sprinter and --tetris-scores verifier")
    parser.add_argument("--tau", type=float, default=None,
                        help="sprinter: keep a draft unchecked iff verifier prob >= tau (default: the verifier's)")
    parser.add_argument("--block-cap", type=int, default=20, help="sprinter: most drafts per block, L (default 20)")
    parser.add_argument("--tetris-scores", default="q", choices=("q", "calibrated", "verifier"),
                        help="tetris ranks drafts by cumulative draft probability q (default), by survival on "
                             "acceptance calibrated from earlier steps' outcomes (what --capacity auto ranks by), or "
                             "by the verifier's learned acceptance probability (lossless in every case)")
    parser.add_argument("--no-prune-drafts", dest="prune_drafts", action="store_false",
                        help="tetris: draft all k + extra tokens for every request (default: a request stops drafting "
                             "once none of its later drafts could be verified; the windows are the same either way)")


def spec_config(args: argparse.Namespace):
    from batchspec.spec.config import SpecConfig

    return SpecConfig(policy=getattr(args, "policy", "ar"), k=args.k, extra=args.extra, capacity=args.capacity,
                      turn_on_batch_size=args.turn_on_batch_size, k_max=args.k_max, max_draft=args.max_draft,
                      measure_oracle=args.measure_oracle,
                      verifier=resolve_verifier(args.verifier, getattr(args, "draft", None),
                                                getattr(args, "target", None), getattr(args, "draft_dtype", None),
                                                getattr(args, "device", "cpu")),
                      tau=args.tau, block_cap=args.block_cap, tetris_scores=args.tetris_scores,
                      prune_drafts=args.prune_drafts)


def resolve_verifier(spec: str | None, draft: str | None = None, target: str | None = None,
                     draft_dtype: str | None = None, device: str = "cpu") -> str | None:
    """`default` -> the verifier shipped for the draft (`--draft default` meaning the target's paired draft) in the
    precision it runs in (`--draft-dtype` on `--device`; None: the first one shipped)."""
    if spec == "default":
        from batchspec.runtime.precision import resolve_precision
        from batchspec.weights.known_models import default_verifier_dir

        precision = resolve_precision(draft_dtype, device) if draft_dtype is not None else None
        return str(default_verifier_dir(resolve_draft(draft, target), precision))
    return spec


def resolve_draft(spec: str | None, target: str | None = None) -> str | None:
    """`default` -> the named target's paired draft (qwen2.5-coder-1.5b-instruct: qwen2.5-coder-0.5b-instruct),
    else the draft shipped for the default target."""
    if spec == "default":
        from batchspec.weights.known_models import default_draft_dir, paired_draft

        return paired_draft(target) or str(default_draft_dir())
    return spec


def capacity_or_auto(text: str) -> int | str | None:
    """`--capacity`: auto (chosen per step), fixed (k x active batch, the Tetris paper's C: None) or a number."""
    if text in ("auto", "fixed"):
        return None if text == "fixed" else text
    return _int_at_least(text, 0, "a non-negative integer, auto or fixed")


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
