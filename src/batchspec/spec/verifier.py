"""SPRINTER's learned verifier: what it computes and its files (`batchspec sprinter` is in cli/sprinter.py).

The verifier is logistic regression sigma(w . f + b) (or, with an MLP width, one hidden ReLU layer) on standardised
features f of a draft token: the draft's last hidden state at the position that produced it (`hidden`, the paper's
only input), optionally with log q(d) and the draft's entropy (`hidden+logq+entropy`), or on those two alone
(`logq+entropy`: a calibrated map from the draft's confidence; on the default pair it generalises better than the
578-feature sets trained on ~8.5k positions, which overfit). It predicts y = 1, "the target
would accept d" (label `greedy`: d == argmax p; label `sd`: q(d) <= p(d)). A token is accepted iff its probability
is >= the threshold tau. Training and metrics: `sprinter/train.py`; the data: `sprinter/data.py`.

The engine's `sprinter` policy loads it with `load_verifier(path, draft)` (which refuses a verifier trained for
another draft) and calls `verifier_probs(verifier, hidden, logq, entropy)` once per draft step, with the features
computed as in `sprinter/data.py`: hidden = the draft's `ForwardOutput.hidden` row of the position that produced the
token; logq and entropy from the draft's plain softmax (temperature 1, before any top-k/top-p).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from batchspec.errors import BatchspecError
from batchspec.weights.fingerprint import weight_fingerprint

FEATURE_SETS = ("hidden", "hidden+logq+entropy", "logq+entropy")
FEATURE_WIDTH_EXTRA = {"hidden": 0, "hidden+logq+entropy": 2, "logq+entropy": 2}  # beyond the hidden size
LABELS = ("greedy", "sd")
VERIFIER_FORMAT = "batchspec-sprinter-verifier/1"

# --- the verifier ---------------------------------------------------------------------------------------------------


@dataclass
class Verifier:
    feature_set: str
    label: str
    threshold: float
    mean: torch.Tensor  # (F,) feature standardisation
    std: torch.Tensor  # (F,)
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # [(weight (out, in), bias (out,))], ReLU between, last out = 1
    draft: dict  # identity of the draft it was trained for: hidden_size, config, fingerprint, ...
    meta: dict = field(default_factory=dict)  # metrics, training settings, the data it came from
    # log of the weight class balancing gave the positives (negatives / positives): balancing scales the fitted odds
    # by it, so logit - balance_shift is the calibrated logit of P(accept) (prior correction; 0: none recorded).
    balance_shift: float = 0.0

    @property
    def hidden_size(self) -> int:
        return int(self.draft["hidden_size"])


def feature_matrix(feature_set: str, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """(N, F) float32 features: hidden (N, H), plus logq and entropy (N,) for the richer set."""
    hidden = hidden.float()
    if feature_set == "hidden":
        return hidden
    if feature_set == "logq+entropy":  # a calibrated map from the draft's own confidence, no hidden state
        return torch.stack([logq.float(), entropy.float()], dim=1)
    if feature_set == "hidden+logq+entropy":
        return torch.cat([hidden, logq.float()[:, None], entropy.float()[:, None]], dim=1)
    raise BatchspecError(f"unknown feature set {feature_set!r}: use one of {', '.join(FEATURE_SETS)}")


def mlp_logits(layers: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """(N, F) standardised features -> (N,) logits."""
    for i, (weight, bias) in enumerate(layers):
        x = F.linear(x, weight, bias)
        if i < len(layers) - 1:
            x = F.relu(x)
    return x[:, 0]


def verifier_probs(verifier: Verifier, hidden: torch.Tensor, logq: torch.Tensor,
                   entropy: torch.Tensor) -> torch.Tensor:
    """P(the target accepts) for N draft tokens: hidden (N, H), logq (N,), entropy (N,) -> (N,) float32.

    Pure; the caller accepts a token iff the result is >= `verifier.threshold`.
    """
    x = feature_matrix(verifier.feature_set, hidden, logq.to(hidden.device), entropy.to(hidden.device))  # (N, F)
    dev = x.device  # the verifier's tensors are tiny: move them to the features, not the other way round
    layers = [(w.to(dev), b.to(dev)) for w, b in verifier.layers]
    with torch.no_grad():
        return torch.sigmoid(mlp_logits(layers, (x - verifier.mean.to(dev)) / verifier.std.to(dev)))


def calibrated_log_probs(verifier: Verifier, probs: torch.Tensor) -> torch.Tensor:
    """log P(accept) from `verifier_probs`, undoing class balancing: log sigmoid(logit - balance_shift). (N,) -> (N,).

    The class-balanced probabilities are what tau thresholds (0.5 = the balanced decision); ranking by acceptance
    probability (Tetris scored by the verifier) wants the calibrated ones.
    """
    eps = torch.finfo(probs.dtype).eps
    return F.logsigmoid(torch.logit(probs, eps=eps) - verifier.balance_shift)


@dataclass(frozen=True)
class DraftScorer:
    """The verifier as the draft loop uses it: every draft scored; with `stop_below`, a request stops drafting after
    its first draft scored below it (SPRINTER's blocks)."""

    verifier: Verifier
    stop_below: float | None = None

    def __call__(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        return verifier_probs(self.verifier, hidden, logq, entropy)


def check_verifier_draft(verifier: Verifier, draft) -> None:
    """Refuse a verifier trained for another draft (hidden size, then weights)."""
    if draft.config.hidden_size != verifier.hidden_size:
        raise BatchspecError(f"the verifier was trained for a draft with hidden size {verifier.hidden_size}, but "
                             f"this draft ({draft.model_dir}) has {draft.config.hidden_size}")
    expected = verifier.draft.get("fingerprint")
    actual = weight_fingerprint(draft.transformer)
    if expected != actual and draft.transformer.context_head:
        raise BatchspecError(f"{Path(draft.model_dir).name} runs its shipped head vocabulary, but a SPRINTER verifier "
                             "reads log q and the entropy over the head it was trained on: load the draft without it "
                             "(load_model's default; the CLI does so whenever --verifier is given)")
    if expected != actual:
        if Path(str(verifier.draft.get("model_dir"))).name == Path(draft.model_dir).name:  # same model, other weights
            trained = verifier.draft.get("precision") or "another precision"
            raise BatchspecError(f"the verifier was trained on {Path(draft.model_dir).name} in {trained} "
                                 f"(weights {str(expected)[:12]}; here {draft.transformer.precision}, weights "
                                 f"{actual[:12]}): run the draft as it was collected (--draft-dtype), or collect and "
                                 f"train a verifier for this precision")
        raise BatchspecError(f"the verifier was trained for another draft ({verifier.draft.get('model_dir')}, weights "
                             f"{str(expected)[:12]}), not {draft.model_dir} (weights {actual[:12]})")


# --- files ---------------------------------------------------------------------------------------------------------


def save_verifier(verifier: Verifier, out: Path) -> Path:
    """OUT/verifier.safetensors (layers, feature mean/std) + OUT/verifier.json (everything else)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"mean": verifier.mean, "std": verifier.std}
    for i, (weight, bias) in enumerate(verifier.layers):
        tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.bias"] = weight, bias
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, out / "verifier.safetensors")
    info = {"format": VERIFIER_FORMAT, "feature_set": verifier.feature_set, "label": verifier.label,
            "threshold": verifier.threshold, "num_layers": len(verifier.layers),
            "balance_shift": verifier.balance_shift, "draft": verifier.draft, **verifier.meta}
    (out / "verifier.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def load_verifier(path: str | Path, draft=None) -> Verifier:
    """Read a saved verifier (its directory or either file); with `draft` (a LoadedModel), check it belongs to it."""
    path = Path(path)
    folder = path.parent if path.suffix in (".json", ".safetensors") else path
    info_path, weights_path = folder / "verifier.json", folder / "verifier.safetensors"
    for p in (info_path, weights_path):
        if not p.is_file():
            raise BatchspecError(f"no verifier at {folder}: {p.name} not found")
    try:
        info = json.loads(info_path.read_text())
        tensors = load_file(weights_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise BatchspecError(f"corrupt {info_path}: {bad}") from None
    except (SafetensorError, OSError, ValueError) as bad:
        raise BatchspecError(f"cannot read {weights_path}: {bad}") from None
    try:
        if info["format"] != VERIFIER_FORMAT:
            raise BatchspecError(f"{info_path} is not a SPRINTER verifier (format {info['format']!r})")
        if info["feature_set"] not in FEATURE_SETS or info["label"] not in LABELS or info["num_layers"] < 1:
            raise BatchspecError(f"{info_path}: unknown feature set, label or layer count")
        layers = [(tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.bias"]) for i in range(info["num_layers"])]
        verifier = Verifier(info["feature_set"], info["label"], float(info["threshold"]), tensors["mean"],
                            tensors["std"], layers, info["draft"],
                            {k: v for k, v in info.items() if k in ("train", "target", "metrics")},
                            float(info.get("balance_shift", 0.0)))
        width = (0 if verifier.feature_set == "logq+entropy" else verifier.hidden_size) + \
            FEATURE_WIDTH_EXTRA[verifier.feature_set]
    except KeyError as bad:
        raise BatchspecError(f"incomplete verifier in {folder}: {bad} missing") from None
    except TypeError as bad:
        raise BatchspecError(f"malformed {info_path}: {bad}") from None
    if verifier.mean.shape != (width,) or layers[0][0].shape[1] != width or layers[-1][0].shape[0] != 1:
        raise BatchspecError(f"inconsistent verifier in {folder}: weights do not match {width} features")
    if draft is not None:
        check_verifier_draft(verifier, draft)
    return verifier
