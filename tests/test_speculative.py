"""The speculative engine end to end on the real target: every lossless policy reproduces `ar` at temperature 0."""

from __future__ import annotations

import json

import pytest
import torch

from batchspec import Engine, SamplingParams
from batchspec.datasets.prompts import humaneval_chat_prompt, humaneval_prompts
from batchspec.errors import BatchspecError
from batchspec.runtime.model import Transformer
from batchspec.spec.config import SpecConfig
from batchspec.spec.step_time import RowTimeTable, StepCost, StepTimeModel
from batchspec.weights.loading import LoadedModel, load_model

pytestmark = pytest.mark.slow  # real models end to end: left out of `pytest -m "not slow"`

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash table is in two sentences."] + [humaneval_chat_prompt(p) for p in humaneval_prompts()[:2]]
# The noisy draft costs as much as the target, so a profiled dsd would rightly never speculate; this model makes
# drafting look cheap so that dsd's window choice and verification paths run.
CHEAP_DRAFT = StepTimeModel(c_fixed=1.0, c_draft_step=0.0, c_draft_token=0.0, c_target_token=0.001)
# The same for Tetris choosing its capacity: every verified row costs 1 % of a step, so some steps verify many drafts
# and (as acceptance is learned to be ~0.5) some few.
CHEAP_STEPS = StepCost(CHEAP_DRAFT, RowTimeTable((1, 64), (1.0, 1.63)), RowTimeTable((1, 64), (0.01, 0.01)))


@pytest.fixture(scope="module")
def noisy_draft(default_model) -> LoadedModel:
    """The target with a perturbed LM head: same tokenizer, acceptance ~0.5, so both accept and reject paths run."""
    base = default_model.transformer
    noise = 0.05 * torch.randn(base.lm_head.shape, generator=torch.Generator().manual_seed(0))
    model = Transformer(base.config, base.embed, base.layers, base.final_norm, base.lm_head + noise)
    return LoadedModel("noisy-target", default_model.model_dir, model, default_model.tokenizer)


@pytest.fixture(scope="module")
def ar_outputs(default_model):
    engine = Engine(default_model, max_batch_size=4)
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=20), chat=True)]


@pytest.mark.parametrize("policy", ["sd", "dsd", "tetris", "oracle", "tetris-auto", "tetris-pruned",
                                    "tetris-calibrated"])
def test_greedy_output_equals_ar(default_model, noisy_draft, ar_outputs, policy):
    # Batch 3 < 4 prompts: a request also joins mid-run; extra=3 gives Tetris real choices.
    # auto: C chosen per step from calibrated acceptance; pruned: C = B binds, so requests stop drafting early (a
    # measured step drafts everything, so the oracle-measured tetris run does not prune).
    capacity = {"tetris-auto": "auto", "tetris-pruned": 3}.get(policy)
    scores = "calibrated" if policy == "tetris-calibrated" else "q"  # top-C survival on learned acceptance
    policy = policy.split("-")[0]
    spec = SpecConfig(policy=policy, k=3, extra=3, k_max=5, capacity=capacity, tetris_scores=scores,
                      measure_oracle=policy in ("tetris", "oracle") and capacity is None)
    engine = Engine(default_model, noisy_draft, spec, max_batch_size=3, step_time=CHEAP_STEPS)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=20), chat=True)
    assert [o.token_ids for o in outputs] == ar_outputs
    m = engine.metrics()
    assert 0.05 < m["vsr"] < 0.95  # both accept and reject paths were exercised
    assert m["emitted_tokens"] >= sum(len(ids) for ids in ar_outputs)
    assert 1.0 <= m["mean_accept_len"] <= spec.k + spec.extra + 1
    if spec.measure_oracle:
        assert 0.0 < m["oracle_fraction"] <= 1.0 + 1e-9
    if capacity == 3:
        assert m["draft_tokens"] < sum(len(windows) for windows in engine.stats.window_history) * (spec.k + spec.extra)
    if policy == "oracle":
        assert m["oracle_fraction"] == pytest.approx(1.0)
    if policy in ("sd", "tetris", "oracle") and capacity is None:  # C = k*B: never more verified drafts than sd
        for windows in engine.stats.window_history:
            assert sum(windows) <= spec.k * len(windows)


def test_each_run_of_an_engine_tells_the_policy_its_requests_apart_from_the_last_runs(default_model, noisy_draft):
    """Request ids restart at 0 in every run; the keys a policy learns per request by (goodput Tetris's own
    estimates) do not, so a second `generate` never starts from what the first run's requests of the same ids did."""
    engine = Engine(default_model, noisy_draft, SpecConfig(policy="tetris", k=3, extra=3, capacity="auto"),
                    max_batch_size=2, step_time=CHEAP_STEPS)
    seen: list[set] = []
    plan = engine.policy.plan

    def recording(batch_size, step_time=None, requests=None, **kwargs):
        seen[-1].update(requests)
        return plan(batch_size, step_time, requests, **kwargs)

    engine.policy.plan = recording
    for _ in range(2):
        seen.append(set())
        engine.generate(PROMPTS[:2], SamplingParams(max_tokens=4), chat=True)
    assert len(seen[0]) == len(seen[1]) == 2 and not seen[0] & seen[1]


def test_seeded_sampling_reproducible_across_batches(default_model, noisy_draft):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7)
    spec = SpecConfig(policy="tetris", k=3, extra=2)
    alone = Engine(default_model, noisy_draft, spec, max_batch_size=1).generate([PROMPTS[0]], params, chat=True)[0]
    together = Engine(default_model, noisy_draft, spec, max_batch_size=3).generate(PROMPTS[:3], params, chat=True)[0]
    assert alone.token_ids == together.token_ids


def test_tokenizer_mismatch_is_refused(default_model, tiny_model_factory):
    model_dir = tiny_model_factory()
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    ids = vocab["model"]["vocab"]  # swap two ids: same strings (merges stay valid), different id mapping
    first, second = (k for k, v in ids.items() if v in (1000, 1001))
    ids[first], ids[second] = ids[second], ids[first]
    (model_dir / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(BatchspecError, match="draft tokenizer does not match the target's"):
        Engine(default_model, load_model(model_dir), SpecConfig(policy="sd"))


@pytest.mark.parametrize("spec,needle", [
    (SpecConfig(policy="sd", k=0), "k must be >= 1"),
    (SpecConfig(policy="tetris", extra=-1), "extra must be >= 0"),
    (SpecConfig(policy="tetris", capacity=-2), "capacity must be >= 0"),
    (SpecConfig(policy="tetris", k=2, extra=1, capacity=13), "capacity 13 exceeds"),
    (SpecConfig(policy="beam"), "unknown policy 'beam'"),
])
def test_bad_spec_is_refused(default_model, noisy_draft, spec, needle):
    with pytest.raises(BatchspecError, match=needle):
        Engine(default_model, noisy_draft, spec, max_batch_size=4)


def test_speculative_policy_needs_a_draft(default_model):
    with pytest.raises(BatchspecError, match="needs a draft model"):
        Engine(default_model, None, SpecConfig(policy="tetris"))


@pytest.mark.parametrize("policy", ["sd", "tetris"])
def test_bfloat16_draft_stays_lossless(default_model, ar_outputs, policy):
    # The shipped draft in bfloat16 (the `auto` choice on CPUs with native bfloat16): only the target decides.
    from batchspec.weights.known_models import default_draft_dir

    draft = load_model(default_draft_dir(), dtype=torch.bfloat16)
    engine = Engine(default_model, draft, SpecConfig(policy=policy, k=3, extra=2), max_batch_size=3)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=20), chat=True)
    assert draft.transformer.dtype == torch.bfloat16
    assert [o.token_ids for o in outputs] == ar_outputs
    assert engine.metrics()["vsr"] > 0.1  # the draft still proposes tokens the target accepts


def test_pruned_drafting_on_recorded_steps(default_model):
    """Every step of a real run (the shipped draft, HumanEval, batch 8), drafted in full and recorded: replaying
    Tetris's pruned drafting on it gives the windows of drafting everything, at fixed C and with goodput's C on a
    linear and a staircase step cost, and it does leave drafts out."""
    import numpy as np

    from batchspec.engine.trace import TraceRecorder
    from batchspec.spec.policies import Plan
    from batchspec.spec.policies.tetris import TetrisPolicy, tetris_windows
    from batchspec.spec.proposal import Proposal, replay_drafting, undrafted
    from batchspec.weights.known_models import default_draft_dir

    draft = load_model(default_draft_dir())
    spec = SpecConfig(policy="tetris", k=3, extra=3, measure_oracle=True)  # measured: every draft is made
    recorder = TraceRecorder()
    prompts = [humaneval_chat_prompt(p) for p in humaneval_prompts()[:8]]
    engine = Engine(default_model, draft, spec, max_batch_size=8)
    engine.generate(prompts, SamplingParams(max_tokens=24), chat=True, trace=recorder)
    trace = recorder.to_trace(engine.last_requests, {})
    steps = [(torch.from_numpy(trace.logprobs[trace.step == s]), trace.accept[trace.step == s])
             for s in range(int(trace.step.max()) + 1)]
    linear = StepCost(CHEAP_DRAFT, RowTimeTable((1, 64), (1.0, 1.63)), RowTimeTable((1, 64), (0.05, 0.1)))
    stairs = StepCost(CHEAP_DRAFT, RowTimeTable((1, 16, 17, 32, 33, 64), (1.0, 1.0, 1.2, 1.2, 1.4, 1.4)),
                      RowTimeTable((1, 64), (0.05, 0.1)))
    left_out = 0
    for capacity in (1, 4, 8, 24):
        policy = TetrisPolicy(SpecConfig(policy="tetris", k=3, extra=3, capacity=capacity))
        for logprobs, _ in steps:
            batch, k_prime = logprobs.shape
            plan = Plan(3, k_prime, min(capacity, batch * k_prime))
            drafted = replay_drafting(policy.drafting_rule(plan, batch), logprobs)
            pruned = tetris_windows(undrafted(logprobs, drafted), plan.capacity)
            assert pruned.tolist() == tetris_windows(logprobs, plan.capacity).tolist()
            left_out += batch * k_prime - int(drafted.sum())
    # Policies that learn (calibrated survival at fixed C, goodput's C), step after step as in a run.
    learning = [(SpecConfig(policy="tetris", k=3, extra=3, capacity=c, tetris_scores="calibrated"), None)
                for c in (4, 8)] + [(SpecConfig(policy="tetris", k=3, extra=3, capacity="auto"), cost)
                                    for cost in (linear, stairs)]
    for spec, cost in learning:
        policy = TetrisPolicy(spec)
        policy.replans = False  # the exact pruning alone (re-planning chooses lengths on purpose: tests/test_goodput.py)
        for logprobs, accept in steps:
            batch, k_prime = logprobs.shape
            plan = Plan(3, k_prime, min(spec.capacity_for(batch), batch * k_prime), cost)
            drafted = replay_drafting(policy.drafting_rule(plan, batch), logprobs)
            full = Proposal(torch.zeros_like(logprobs, dtype=torch.int64), None, logprobs)
            windows = policy.select(plan, full)
            pruned = policy.select(plan, Proposal(full.tokens, None, undrafted(logprobs, drafted), drafted))
            assert pruned.tolist() == windows.tolist()
            passed = np.cumprod(accept > 0.5, axis=1) * (np.arange(k_prime) < windows.numpy()[:, None])
            policy.observe(full, windows.tolist(), passed.sum(axis=1).tolist())  # it learns as in a run
            left_out += batch * k_prime - int(drafted.sum())
    assert left_out > 0
