"""Training and evaluating SPRINTER's verifier (`batchspec sprinter train` / `eval`): pure metrics, the fit.

The loss is class-balanced BCE (pos_weight = negatives / positives) on standardised features, over the training
prompts of a `sprinter collect` directory: logistic regression is fitted to convergence (full-batch L-BFGS, L2
penalty; the problem is convex), the optional MLP by AdamW on minibatches. Balancing scales the fitted odds by
pos_weight; the verifier records log(pos_weight) so that Tetris can rank by the calibrated probability. Reported on
its validation prompts: accuracy, AUROC (rank-based, ties averaged), eta_FP = P(accept | y = 0) — costs
fidelity, see sprinter/theory.py — and eta_FN = P(reject | y = 1) — costs speed — beside a baseline that thresholds
log q alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.spec.verifier import FEATURE_SETS, LABELS, Verifier, feature_matrix, mlp_logits, verifier_probs
from batchspec.sprinter.data import SprinterData

# --- metrics (pure) ------------------------------------------------------------------------------------------------


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a random positive > score of a random negative), ties counting 1/2 (Mann-Whitney U / n+ n-).

    scores, labels: (N,). Average ranks over ties; NaN when a class is absent.
    """
    scores, positive = scores.double().flatten(), labels.flatten().bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    last_rank = torch.cumsum(counts, 0).double()  # (U,) 1-based rank of the last element of each tie group
    mean_rank = last_rank - (counts.double() - 1) / 2  # (U,) average rank within the group
    rank_sum = mean_rank[inverse][positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rates(accept: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """accuracy, eta_FP = P(accept | y = 0), eta_FN = P(reject | y = 1); accept, labels: (N,) bool/0-1."""
    accept, positive = accept.bool(), labels.bool()
    nan = float("nan")
    return {"accuracy": float((accept == positive).float().mean()) if accept.numel() else nan,
            "eta_fp": float(accept[~positive].float().mean()) if (~positive).any() else nan,
            "eta_fn": float((~accept[positive]).float().mean()) if positive.any() else nan}


def threshold_matching_fn(scores: torch.Tensor, labels: torch.Tensor, eta_fn: float) -> float:
    """A threshold t such that rejecting scores < t rejects a fraction ~eta_fn of the positives."""
    positive = scores[labels.bool()].sort().values  # (P,) ascending
    if positive.numel() == 0 or math.isnan(eta_fn):
        return float("-inf")
    k = round(eta_fn * positive.numel())
    return float("inf") if k >= positive.numel() else float(positive[k])


def best_accuracy_threshold(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The threshold t (accept iff score >= t) with the best accuracy on these scores."""
    order = scores.argsort(descending=True)
    s, y = scores[order].double(), labels[order].double()  # (N,)
    n_neg = float((1 - y).sum())
    # accepting the top m: correct = true accepts + negatives not accepted
    correct = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(y, 0) - torch.cumsum(1 - y, 0)]) + n_neg
    valid = torch.ones(len(s) + 1, dtype=torch.bool)
    valid[1:-1] = s[1:] != s[:-1]  # cut only between different scores
    m = int(torch.where(valid, correct, torch.full_like(correct, -1.0)).argmax())
    return float("inf") if m == 0 else float(s[m - 1])


# --- training ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    label: str = "greedy"
    features: str = "hidden+logq+entropy"
    mlp_hidden: int = 0  # 0: logistic regression
    threshold: float = 0.5
    epochs: int = 30
    lr: float = 3e-3
    weight_decay: float = 1e-3  # logistic: L2 penalty on the weights; MLP: AdamW's decoupled weight decay
    batch_size: int = 1024
    seed: int = 0

    def validate(self) -> None:
        if self.label not in LABELS:
            raise BatchspecError(f"unknown --label {self.label!r}: use one of {', '.join(LABELS)}")
        if self.features not in FEATURE_SETS:
            raise BatchspecError(f"unknown --features {self.features!r}: use one of {', '.join(FEATURE_SETS)}")
        if self.mlp_hidden < 0 or self.epochs < 1 or self.batch_size < 1 or self.lr <= 0 or self.weight_decay < 0:
            raise BatchspecError("--mlp must be >= 0, --epochs >= 1, --lr > 0, --l2 >= 0")
        if not 0.0 < self.threshold < 1.0:
            raise BatchspecError(f"--threshold must be in (0, 1), got {self.threshold}")


def split_xy(rows: dict[str, torch.Tensor], feature_set: str, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = feature_matrix(feature_set, rows["hidden"], rows["logq"], rows["entropy"])  # (N, F)
    return x, rows[f"y_{label}"].float()  # (N,)


def balance_weight(y: torch.Tensor) -> float:
    """negatives / positives: the weight that gives both classes the same total weight in the loss."""
    n_pos = float(y.sum())
    return (len(y) - n_pos) / max(n_pos, 1.0)


def fit(x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Class-balanced BCE; x (N, F) standardised, y (N,) in {0, 1}. Returns the layers.

    Logistic regression: full-batch L-BFGS with a strong-Wolfe line search until the gradient vanishes (a few
    hundred iterations at most), plus `weight_decay` * ||w||^2. The MLP: AdamW on seeded minibatches.
    """
    sizes = [x.shape[1]] + ([cfg.mlp_hidden] if cfg.mlp_hidden else []) + [1]
    with torch.random.fork_rng(devices=[]):  # a seeded initialisation that leaves the global generator alone
        torch.manual_seed(cfg.seed)
        modules = [torch.nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
    pos_weight = torch.tensor(balance_weight(y))
    if not cfg.mlp_hidden:
        return _fit_logistic(modules[0], x, y, pos_weight, cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * math.ceil(len(y) / cfg.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(cfg.epochs):
        for batch in torch.randperm(len(y), generator=generator).split(cfg.batch_size):
            layers = [(m.weight, m.bias) for m in modules]
            loss = F.binary_cross_entropy_with_logits(mlp_logits(layers, x[batch]), y[batch], pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    return [(m.weight.detach().clone(), m.bias.detach().clone()) for m in modules]


def _fit_logistic(linear: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, pos_weight: torch.Tensor,
                  l2: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
    optimizer = torch.optim.LBFGS(linear.parameters(), lr=1.0, max_iter=500, history_size=20,
                                  tolerance_grad=1e-7, tolerance_change=1e-10, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logits = linear(x)[:, 0]
        loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight) + l2 * linear.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return [(linear.weight.detach().clone(), linear.bias.detach().clone())]


def evaluate(verifier: Verifier, rows: dict[str, torch.Tensor], train_rows: dict[str, torch.Tensor] | None = None
             ) -> dict:
    """The verifier's and the log q baseline's metrics on `rows` at the verifier's threshold.

    The baseline accepts iff log q >= t, with t set so that its eta_FN matches the verifier's (`matched_fn`: then
    eta_FP compares fidelity at equal speed), and t with the best accuracy on `train_rows` (`best_accuracy`).
    """
    labels = rows[f"y_{verifier.label}"].bool()
    probs = verifier_probs(verifier, rows["hidden"], rows["logq"], rows["entropy"])
    ours = {"auroc": auroc(probs, labels), **rates(probs >= verifier.threshold, labels)}
    logq = rows["logq"]
    t_match = threshold_matching_fn(logq, labels, ours["eta_fn"])
    baseline = {"auroc": auroc(logq, labels),
                "matched_fn": {"logq_threshold": t_match, **rates(logq >= t_match, labels)}}
    if train_rows is not None:
        t_best = best_accuracy_threshold(train_rows["logq"], train_rows[f"y_{verifier.label}"].bool())
        baseline["best_accuracy"] = {"logq_threshold": t_best, **rates(logq >= t_best, labels)}
    return {"positions": int(labels.numel()), "positive_rate": float(labels.float().mean()), "verifier": ours,
            "logq_baseline": baseline}


def train_verifier(data: SprinterData, cfg: TrainConfig) -> Verifier:
    """Fit on the data's training prompts; metrics on its validation prompts go into `verifier.meta`."""
    cfg.validate()
    train_rows, val_rows = data.split("train"), data.split("val")
    x, y = split_xy(train_rows, cfg.features, cfg.label)
    if len(y) == 0 or float(y.min()) == float(y.max()):
        raise BatchspecError(f"training data needs both labels: {len(y)} training positions, "
                             f"{int(y.sum())} with y_{cfg.label} = 1")
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)  # (F,)
    layers = fit((x - mean) / std, y, cfg)
    draft = {**data.meta["draft"], "precision": data.meta.get("draft_dtype")}  # what its features were computed in
    verifier = Verifier(cfg.features, cfg.label, cfg.threshold, mean, std, layers, draft,
                        balance_shift=math.log(balance_weight(y)))
    verifier.meta = {"train": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                     "target": data.meta.get("target", {}).get("name"),
                     "metrics": {"train": evaluate(verifier, train_rows)}}
    if len(val_rows["logq"]):
        verifier.meta["metrics"]["val"] = evaluate(verifier, val_rows, train_rows)
    return verifier



def format_metrics(metrics: dict, threshold: float) -> str:
    """The validation metrics as a small table: verifier vs the log q baselines."""
    lines = [f"{metrics['positions']} positions, positive rate {metrics['positive_rate']:.3f}, tau = {threshold}",
             f"{'':28} {'accuracy':>8} {'AUROC':>7} {'eta_FP':>7} {'eta_FN':>7}"]
    ours, base = metrics["verifier"], metrics["logq_baseline"]
    rows = [("verifier", ours, ours["auroc"]), ("log q, matched eta_FN", base["matched_fn"], base["auroc"])]
    if "best_accuracy" in base:
        rows.append(("log q, best train accuracy", base["best_accuracy"], base["auroc"]))
    for name, r, area in rows:
        lines.append(f"{name:28} {r['accuracy']:8.3f} {area:7.3f} {r['eta_fp']:7.3f} {r['eta_fn']:7.3f}")
    return "\n".join(lines)
