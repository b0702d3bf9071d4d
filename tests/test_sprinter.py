"""SPRINTER's data and verifier on tiny random models: collect -> train -> eval end to end, resume, AUROC against a
brute-force count, refusal of a verifier trained for another draft, clear errors for bad files."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import batchspec.sprinter.data as sprinter_data
from batchspec.cli.main import main
from batchspec.errors import BatchspecError
from batchspec.spec.verifier import Verifier, calibrated_log_probs, load_verifier, save_verifier, verifier_probs
from batchspec.weights.fingerprint import weight_fingerprint
from batchspec.weights.loading import TOKENIZER_FILES, load_model
from batchspec.sprinter.train import (TrainConfig, auroc, balance_weight, best_accuracy_threshold, fit, rates,
                                      threshold_matching_fn, train_verifier)
from batchspec.sprinter.data import CollectConfig, load_data, run_collect, token_features, validation_prompts
from conftest import make_tiny_model

PROMPTS = [
    "Write a Python function `is_even(n)` that returns True when n is even.",
    "Explain what the following Python function does.\n\n```python\ndef f(x):\n    return x[::-1]\n```",
    "Write a Python function `mean(xs)` that returns the arithmetic mean of a list of numbers.",
    "Complete the following Python function.\n\n```python\ndef square(x):\n    \"\"\"Return x squared.\"\"\"\n```",
    "Write a Python function `clamp(x, lo, hi)` that limits x to the interval [lo, hi].",
    "Write a Python function `words(s)` that splits a sentence into words.",
]


def noisy_copy(source: Path, out: Path, noise: float, seed: int, flatten: float = 0.8) -> Path:
    """A draft that is the target plus Gaussian weight noise: same tokenizer and shapes, mixed acceptance.

    Its final norm is scaled by `flatten` (logits / temperature): a noisy copy alone is more peaked at its own
    argmax than the target is there, so q(d) <= p(d) would almost never hold.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(source / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * flatten
    out.mkdir(parents=True)
    save_file({name: (t + noise * torch.randn(t.shape, generator=generator)).contiguous()
               for name, t in weights.items()}, out / "model.safetensors")
    for name in ("config.json", *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("sprinter")
    target = make_tiny_model(root / "target", default_model_dir)
    return target, noisy_copy(target, root / "draft", noise=0.04, seed=1), root


def tiny_config(target: Path, draft: Path, **overrides) -> CollectConfig:
    settings = dict(target=str(target), draft=str(draft), num_prompts=6, max_tokens=8, shard_size=3,
                    batch_size=3, val_fraction=0.34)
    return CollectConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def collected(pair):
    target, draft, root = pair
    summary = run_collect(tiny_config(target, draft), root / "data", prompts=PROMPTS)
    return root / "data", summary


def test_collect_train_eval_end_to_end(pair, collected, tmp_path, capsys):
    target_dir, draft_dir, _ = pair
    data_dir, summary = collected
    data = load_data(data_dir)
    rows = data.tensors
    n = data.num_rows
    assert sorted(p.name for p in data_dir.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert summary["positions"] == n and 6 <= n <= 6 * 8
    assert rows["hidden"].shape == (n, 64) and rows["hidden"].dtype == torch.float16
    assert set(rows["prompt_index"].tolist()) == set(range(6))
    assert data.meta["val_prompts"] == validation_prompts(6, 0.34, 1000) and len(data.meta["val_prompts"]) == 2
    assert summary["val_positions"] == int(torch.isin(rows["prompt_index"], torch.tensor(data.meta["val_prompts"],
                                                                                        dtype=torch.int32)).sum())
    # labels are mixed (the draft is a noisy copy) and consistent with the stored log-probs and tokens
    assert 0 < int(rows["y_greedy"].sum()) < n and 0 < int(rows["y_sd"].sum()) < n
    assert torch.equal(rows["y_sd"].bool(), rows["logq"] <= rows["logp"])
    assert torch.equal(rows["y_greedy"].bool(), rows["draft_token"] == rows["target_argmax"])
    draft = load_model(draft_dir)
    assert data.meta["draft"]["fingerprint"] == weight_fingerprint(draft.transformer)
    assert data.meta["draft"]["config"]["hidden_size"] == 64

    # the first answer position of prompt 0 equals a plain forward of the chat-formatted prompt through the draft
    tok = draft.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    model = draft.transformer
    out = model.forward(model.new_cache(1, len(ids) + 1), torch.tensor([0]), torch.tensor([len(ids)]),
                        torch.tensor(ids), logit_rows=torch.tensor([len(ids) - 1]))
    first = int(((rows["prompt_index"] == 0) & (rows["position"] == 0)).nonzero()[0, 0])
    assert int(rows["draft_token"][first]) == int(out.logits.argmax())
    assert torch.allclose(rows["hidden"][first].float(), out.hidden[-1], atol=1e-2)

    # train through the CLI, evaluate through the CLI; load in Python and score
    verifier_dir = tmp_path / "verifier"
    assert main(["sprinter", "train", str(data_dir), "--out", str(verifier_dir), "--epochs", "40"]) == 0
    printed = capsys.readouterr().out
    assert "verifier" in printed and "AUROC" in printed and "log q, matched eta_FN" in printed
    info = json.loads((verifier_dir / "verifier.json").read_text())
    assert info["draft"]["fingerprint"] == data.meta["draft"]["fingerprint"]
    assert info["feature_set"] == "hidden+logq+entropy" and info["label"] == "greedy" and info["threshold"] == 0.5
    val = info["metrics"]["val"]
    assert {"accuracy", "auroc", "eta_fp", "eta_fn"} <= set(val["verifier"])
    assert {"auroc", "matched_fn", "best_accuracy"} <= set(val["logq_baseline"])
    assert info["metrics"]["train"]["verifier"]["auroc"] > 0.8  # 66 features, a few dozen rows: it fits them
    assert main(["sprinter", "eval", str(data_dir), "--verifier", str(verifier_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verifier"]["auroc"] == pytest.approx(val["verifier"]["auroc"])

    verifier = load_verifier(verifier_dir, draft)
    probs = verifier_probs(verifier, rows["hidden"][:5].float(), rows["logq"][:5], rows["entropy"][:5])
    assert probs.shape == (5,) and bool(((probs >= 0) & (probs <= 1)).all())


def test_mlp_hidden_only_and_confidence_only_verifiers(collected, tmp_path):
    data = load_data(collected[0])
    for cfg in (TrainConfig(features="hidden", label="sd", epochs=5), TrainConfig(mlp_hidden=8, epochs=5),
                TrainConfig(features="logq+entropy", epochs=5)):
        verifier = train_verifier(data, cfg)
        loaded = load_verifier(save_verifier(verifier, tmp_path / cfg.features / str(cfg.mlp_hidden)))
        rows = data.split("val")
        assert torch.allclose(verifier_probs(loaded, rows["hidden"], rows["logq"], rows["entropy"]),
                              verifier_probs(verifier, rows["hidden"], rows["logq"], rows["entropy"]))
        assert len(loaded.layers) == (2 if cfg.mlp_hidden else 1) and loaded.label == cfg.label
        assert loaded.balance_shift == pytest.approx(verifier.balance_shift) and verifier.balance_shift != 0.0


def test_verifier_for_another_draft_is_refused(pair, collected, tmp_path, default_model_dir):
    target_dir, draft_dir, root = pair
    verifier_dir = save_verifier(train_verifier(load_data(collected[0]), TrainConfig(epochs=2)), tmp_path / "v")
    load_verifier(verifier_dir, load_model(draft_dir))  # its own draft: fine
    other = load_model(noisy_copy(target_dir, tmp_path / "other", noise=0.04, seed=2))
    with pytest.raises(BatchspecError, match="trained for another draft"):
        load_verifier(verifier_dir, other)
    narrow = load_model(make_tiny_model(tmp_path / "narrow", default_model_dir, hidden_size=32, intermediate_size=64))
    with pytest.raises(BatchspecError, match="hidden size 64.*has 32"):
        load_verifier(verifier_dir, narrow)


def test_resume_skips_finished_shards(pair, collected, tmp_path, monkeypatch):
    target, draft, _ = pair
    out = tmp_path / "data"
    shutil.copytree(collected[0], out)
    before = load_data(out).tensors
    (out / "shard-00001.safetensors").unlink()  # as if interrupted during the second shard
    with pytest.raises(BatchspecError, match="--resume"):
        run_collect(tiny_config(target, draft), out, prompts=PROMPTS)
    with pytest.raises(BatchspecError, match=r"different settings.*max_tokens"):
        run_collect(tiny_config(target, draft, max_tokens=5), out, resume=True, prompts=PROMPTS)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "draft": {**meta["draft"], "fingerprint": "retrained"}}))
    with pytest.raises(BatchspecError, match="another draft model"):
        run_collect(tiny_config(target, draft), out, resume=True, prompts=PROMPTS)
    assert meta["draft_dtype"] in ("float32", "bfloat16")  # what `auto` resolved to on this machine
    (out / "meta.json").write_text(json.dumps({**meta, "draft_dtype": "float16"}))  # as if another machine's auto
    with pytest.raises(BatchspecError, match="collected in float16: pass --draft-dtype float16"):
        run_collect(tiny_config(target, draft), out, resume=True, prompts=PROMPTS)
    (out / "meta.json").write_text(json.dumps(meta))
    calls = []
    real = sprinter_data.shard_records
    monkeypatch.setattr(sprinter_data, "shard_records",
                        lambda t, d, pairs, first: calls.append(first) or real(t, d, pairs, first))
    summary = run_collect(tiny_config(target, draft), out, resume=True, prompts=PROMPTS)
    assert calls == [3] and summary["shards_skipped"] == 1
    after = load_data(out).tensors
    for name in ("draft_token", "y_greedy", "y_sd", "prompt_index", "position"):
        assert torch.equal(before[name], after[name]), name  # greedy: the redone shard is the same data


def test_auroc_matches_pairwise_count():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = int(torch.randint(2, 30, (1,), generator=generator))
        scores = torch.randint(0, 6, (n,), generator=generator).float()  # many ties
        labels = torch.randint(0, 2, (n,), generator=generator)
        if labels.min() == labels.max():
            labels[0] = 1 - labels[0]
        pos, neg = scores[labels == 1].tolist(), scores[labels == 0].tolist()
        wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
        assert auroc(scores, labels) == pytest.approx(wins / (len(pos) * len(neg)))
    assert auroc(torch.tensor([1.0, 2.0]), torch.tensor([1, 1])) != auroc(torch.tensor([1.0]), torch.tensor([1]))


def test_rates_and_baseline_thresholds():
    labels = torch.tensor([1, 1, 1, 1, 0, 0])
    accept = torch.tensor([True, True, True, False, True, False])
    r = rates(accept, labels)
    assert r == pytest.approx({"accuracy": 4 / 6, "eta_fp": 0.5, "eta_fn": 0.25})
    scores = torch.tensor([4.0, 3.0, 2.0, 1.0, 2.5, 0.0])
    t = threshold_matching_fn(scores, labels, 0.25)
    assert rates(scores >= t, labels)["eta_fn"] == 0.25
    best = best_accuracy_threshold(scores, labels)
    assert rates(scores >= best, labels)["accuracy"] == pytest.approx(5 / 6)
    assert best_accuracy_threshold(torch.tensor([1.0, 1.0]), torch.tensor([0, 0])) == float("inf")


def test_token_features_labels():
    target = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])  # argmax p: 1, 0
    draft = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 5.0]])  # d: 1 (agrees), 2 (disagrees)
    f = token_features(draft, target)
    assert f["draft_token"].tolist() == [1, 2] and f["y_greedy"].tolist() == [1, 0]
    q1, p1 = draft.log_softmax(-1)[0, 1], target.log_softmax(-1)[0, 1]
    assert f["y_sd"].tolist() == [int(q1 <= p1), 0]
    assert f["entropy"][1] < f["entropy"][0]


def test_bad_files_and_options_are_clear_errors(collected, tmp_path, capsys):
    with pytest.raises(BatchspecError, match="no SPRINTER data"):
        load_data(tmp_path / "missing")
    bad = tmp_path / "bad"
    shutil.copytree(collected[0], bad)
    (bad / "shard-00000.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BatchspecError, match="cannot read shard"):
        load_data(bad)
    (bad / "meta.json").write_text("{")
    with pytest.raises(BatchspecError, match="corrupt"):
        load_data(bad)
    with pytest.raises(BatchspecError, match="no verifier"):
        load_verifier(tmp_path / "nothing")
    verifier_dir = save_verifier(train_verifier(load_data(collected[0]), TrainConfig(epochs=1)), tmp_path / "v")
    (verifier_dir / "verifier.safetensors").write_bytes(b"junk")
    with pytest.raises(BatchspecError, match="cannot read"):
        load_verifier(verifier_dir)
    with pytest.raises(BatchspecError, match="held-out"):
        sprinter_data.candidate_prompts("humaneval", 4, 0)
    with pytest.raises(BatchspecError, match="val-fraction"):
        CollectConfig(val_fraction=1.0).validate()
    assert main(["sprinter", "eval", str(tmp_path / "missing"), "--verifier", str(verifier_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_logistic_fit_reaches_the_balanced_optimum_and_calibrates():
    # Synthetic logistic data (a pure-function test): y ~ Bernoulli(sigmoid(2 x0 - x1 + 0.7)), ~2/3 positives.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 2, generator=generator)
    y = (torch.rand(20000, generator=generator) < torch.sigmoid(2 * x[:, 0] - x[:, 1] + 0.7)).float()
    [(weight, bias)] = fit(x, y, TrainConfig(weight_decay=0.0))
    # Balancing multiplies the odds by w = negatives / positives: same slopes, intercept shifted by log w.
    shift = math.log(balance_weight(y))
    assert weight[0].tolist() == pytest.approx([2.0, -1.0], abs=0.08)
    assert float(bias[0]) == pytest.approx(0.7 + shift, abs=0.08)
    # Converged: the balanced loss is stationary there.
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    F.binary_cross_entropy_with_logits(x @ w[0] + b, y, pos_weight=torch.tensor(balance_weight(y))).backward()
    assert float(torch.cat([w.grad.flatten(), b.grad]).abs().max()) < 1e-4
    # Prior correction: the calibrated probabilities average to the positive rate; tau = 0.5 stays balanced.
    verifier = Verifier("logq+entropy", "greedy", 0.5, torch.zeros(2), torch.ones(2), [(weight, bias)],
                        {"hidden_size": 1}, balance_shift=shift)
    probs = verifier_probs(verifier, torch.zeros(len(y), 1), x[:, 0], x[:, 1])
    assert float(calibrated_log_probs(verifier, probs).exp().mean()) == pytest.approx(float(y.mean()), abs=0.01)
    unshifted = Verifier(**{**verifier.__dict__, "balance_shift": 0.0})
    assert torch.allclose(calibrated_log_probs(unshifted, probs), probs.log(), atol=1e-6)
