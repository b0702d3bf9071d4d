"""The `sprinter` policy in the engine, and Tetris scored by the verifier, on tiny models with a constant verifier.

A verifier that never vouches for a draft (every probability below tau) makes each block one token that the target
tests: that is SD with k = 1, so the output equals the target's greedy output exactly. One that vouches for every
draft keeps whole blocks of L unchecked: far fewer target calls, and outputs that may differ.
"""

from __future__ import annotations

import pytest
import torch

from batchspec.engine.engine import Engine
from batchspec.errors import BatchspecError
from batchspec.runtime.model import Transformer
from batchspec.runtime.sampling import SamplingParams
from batchspec.spec.config import SpecConfig
from batchspec.spec.verifier import Verifier, save_verifier
from batchspec.weights.fingerprint import weight_fingerprint
from batchspec.weights.loading import LoadedModel, load_model

PROMPTS = ["def add(a, b):", "The capital of France is", "for i in range(", "import numpy as"]


def _noisy_copy(model: LoadedModel, scale: float) -> LoadedModel:
    base = model.transformer
    noise = scale * torch.randn(base.lm_head.shape, generator=torch.Generator().manual_seed(0))
    return LoadedModel("noisy", model.model_dir, Transformer(base.config, base.embed, base.layers, base.final_norm,
                                                             base.lm_head + noise), model.tokenizer)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_model_dir):
    from conftest import make_tiny_model

    target = load_model(make_tiny_model(tmp_path_factory.mktemp("sprinter") / "target", default_model_dir))
    draft = _noisy_copy(target, 0.02)
    hidden = draft.config.hidden_size
    verifier = Verifier("hidden", "greedy", 0.5, torch.zeros(hidden), torch.ones(hidden),
                        [(torch.zeros(1, hidden), torch.zeros(1))],  # P(accept) = sigmoid(0) = 0.5 everywhere
                        {"hidden_size": hidden, "fingerprint": weight_fingerprint(draft.transformer)})
    path = save_verifier(verifier, tmp_path_factory.mktemp("verifier") / "v")
    return target, draft, str(path)


def _run(target, draft, spec, batch=4):
    engine = Engine(target, draft, spec, max_batch_size=batch)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    return [o.token_ids for o in outputs], engine.metrics()


def test_never_trusting_verifier_is_lossless(pair):
    target, draft, verifier = pair
    reference, _ = _run(target, None, SpecConfig(policy="ar"))
    tokens, metrics = _run(target, draft, SpecConfig(policy="sprinter", verifier=verifier, tau=0.6, block_cap=5))
    assert tokens == reference
    assert metrics["mean_accept_len"] <= 2.0  # one tested draft per step (+ the bonus or correction)


def test_trusting_verifier_cuts_target_calls(pair):
    target, draft, verifier = pair
    _, sd = _run(target, draft, SpecConfig(policy="sd", k=4))
    tokens, trusting = _run(target, draft, SpecConfig(policy="sprinter", verifier=verifier, tau=0.4, block_cap=5))
    assert all(len(t) == 12 for t in tokens)
    assert trusting["target_calls"] < sd["target_calls"]
    assert trusting["mean_accept_len"] >= 5  # every block of L = 5 is kept: 4 unchecked + the tested last + bonus


@pytest.mark.parametrize("tau", [0.4, 0.6])  # blocks of L = 5 drafts, or of one
def test_sprinter_exact_is_lossless_whatever_the_verifier_says(pair, tau):
    """`sprinter-exact` keeps SPRINTER's blocks but the target checks every draft: the target's greedy output,
    whether the blocks are long (every draft vouched for) or one draft."""
    target, draft, verifier = pair
    reference, _ = _run(target, None, SpecConfig(policy="ar"))
    tokens, exact = _run(target, draft, SpecConfig(policy="sprinter-exact", verifier=verifier, tau=tau, block_cap=5))
    assert tokens == reference
    if tau < 0.5:  # whole blocks drafted, and the target accepted some of them
        assert exact["draft_tokens"] > exact["steps"] and exact["mean_accept_len"] > 1.0


def test_tetris_scored_by_verifier_stays_lossless(pair):
    target, draft, verifier = pair
    reference, _ = _run(target, None, SpecConfig(policy="ar"))
    tokens, _ = _run(target, draft, SpecConfig(policy="tetris", k=2, extra=2, verifier=verifier,
                                               tetris_scores="verifier"))
    assert tokens == reference


def test_verifier_for_another_draft_is_refused(pair):
    target, _, verifier = pair
    other = _noisy_copy(target, 0.05)
    with pytest.raises(BatchspecError, match="another draft"):
        Engine(target, other, SpecConfig(policy="sprinter", verifier=verifier))
    with pytest.raises(BatchspecError, match="verifier"):
        Engine(target, other, SpecConfig(policy="sprinter"))


def test_bench_reports_quality_of_lossy_runs(pair, tmp_path):
    from batchspec.bench.run import BenchConfig, format_table, run_bench

    target, draft, verifier = pair
    config = BenchConfig(dataset="humaneval", num_prompts=3, batch_size=3, policies=("ar", "sd", "sprinter"),
                         spec=SpecConfig(k=2, extra=0, verifier=verifier, tau=0.4, block_cap=4), max_tokens=6,
                         sweep={"tau": (0.4, 0.6)})
    results = run_bench(config, target, draft)
    assert [(r["policy"], r["tau"]) for r in results["runs"]] == [("ar", 0.4), ("sd", 0.4), ("sprinter", 0.4),
                                                                  ("sprinter", 0.6)]
    assert results["runs"][-1]["match_ar"] == 1.0  # tau above every verifier probability: lossless
    from batchspec.bench.plots import write_plots

    assert any(p.name == "sprinter_speed_quality.png" for p in write_plots(results, tmp_path))
    runs = {r["policy"]: r for r in results["runs"][:3]}
    assert runs["ar"]["rouge_l_ar"] == 1.0 and runs["sd"].get("target_nll") is None
    assert 0.0 <= runs["sprinter"]["rouge_l_ar"] <= 1.0 and runs["sprinter"]["target_nll"] > 0.0
    # The target's own greedy output is its argmax on its own prefix: no disagreement (same numerics teacher-forced).
    assert runs["ar"]["target_disagreement"] == 0.0 and 0.0 <= runs["sprinter"]["target_disagreement"] <= 1.0
    assert "quality sprinter" in format_table({"config": {}, "runs": list(runs.values())})


def test_bench_sweeps_tetris_scores_in_one_run(pair):
    """Learned-score Tetris beside plain Tetris: a tetris_scores sweep re-runs only tetris; both stay lossless."""
    from batchspec.bench.run import BenchConfig, parse_sweep, run_bench

    target, draft, verifier = pair
    config = BenchConfig(dataset="humaneval", num_prompts=3, batch_size=3, policies=("ar", "tetris"),
                         spec=SpecConfig(k=2, extra=1, verifier=verifier, measure_oracle=True), max_tokens=6,
                         sweep=parse_sweep(["tetris_scores=q,verifier"]))
    results = run_bench(config, target, draft)
    assert [(r["policy"], r["tetris_scores"]) for r in results["runs"]] == [("ar", "q"), ("tetris", "q"),
                                                                            ("tetris", "verifier")]
    assert all(r["match_ar"] == 1.0 and 0.0 < r["oracle_fraction"] <= 1.0 + 1e-9 for r in results["runs"][1:])
    with pytest.raises(BatchspecError, match="tetris_scores"):
        BenchConfig(sweep={"tetris_scores": ("logits",)}).validate()
