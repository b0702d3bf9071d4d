"""The policy objects: what each one drafts, which windows it picks, what it learns; (k, extra, C) validation;
the registry of names."""

from __future__ import annotations

import pytest
import torch

from batchspec.errors import BatchspecError
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies import LOSSLESS_POLICIES, POLICIES, Plan, make_policy, policy_class
from batchspec.spec.policies.base import check_windows
from batchspec.spec.proposal import Proposal


def _proposal(logprobs: torch.Tensor) -> Proposal:
    return Proposal(tokens=torch.zeros(logprobs.shape, dtype=torch.int64), probs=None, logprobs=logprobs)


def test_each_policy_picks_its_windows() -> None:
    proposal = _proposal(torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.9, 0.9]])))
    accept = torch.tensor([[0.1, 1.0, 1.0], [1.0, 1.0, 0.0]])
    plan = Plan(k=1, k_prime=3, capacity=2)

    def windows(name: str, **settings) -> list[int]:
        return make_policy(SpecConfig(policy=name, k=1, extra=2, **settings)).select(plan, proposal, accept).tolist()

    assert windows("sd") == [1, 1]
    assert windows("dsd") == [1, 1]
    assert windows("tetris") == [2, 0]
    assert windows("tetris", turn_on_batch_size=3) == [1, 1]  # below its turn-on batch size: sd
    assert windows("oracle") == [0, 2]
    with pytest.raises(BatchspecError, match="accept_probs"):
        make_policy(SpecConfig(policy="oracle", k=1, extra=2)).select(plan, proposal)


def test_plans_draft_length_and_capacity() -> None:
    def plan(name: str, batch: int = 8, **settings) -> Plan:
        return make_policy(SpecConfig(policy=name, k=3, extra=2, **settings), batch_size=batch).plan(batch)

    assert plan("ar") == Plan(0, 0, 0)
    assert plan("sd") == Plan(3, 3, 24)
    assert plan("tetris") == Plan(3, 5, 24)
    assert plan("tetris", turn_on_batch_size=16) == Plan(3, 3, 24)
    assert plan("oracle") == Plan(3, 5, 24)
    assert plan("tetris", capacity=30) == Plan(3, 5, 30)
    assert Plan(3, 5, 30).clamped(room=2, batch_size=8) == Plan(3, 2, 16)  # never past the cache's end


def test_dsd_chooses_k_by_goodput_and_learns_acceptance() -> None:
    policy = make_policy(SpecConfig(policy="dsd", k_max=6))
    with pytest.raises(BatchspecError, match="step-time model"):
        policy.plan(4)
    cheap_drafts = lambda batch, k: 1.0 + 0.01 * k  # noqa: E731
    long_window = policy.plan(4, cheap_drafts).k
    for _ in range(20):
        policy.observe(None, [4, 4], [0, 0])  # nothing accepted: the estimate falls, and so does k
    assert policy.plan(4, cheap_drafts).k < long_window
    before = policy.acceptance
    policy.observe(None, [0, 0], [0, 0])  # nothing verified: nothing learned
    assert policy.acceptance == before


def test_policy_attributes() -> None:
    assert POLICIES == ("ar", "sd", "dsd", "tetris", "oracle", "sprinter", "sprinter-exact")
    assert LOSSLESS_POLICIES == ("ar", "sd", "dsd", "tetris", "oracle", "sprinter-exact")
    assert not policy_class("ar").speculative and all(policy_class(p).speculative for p in POLICIES[1:])
    assert [p for p in POLICIES if policy_class(p).needs_acceptance] == ["oracle"]
    assert [p for p in POLICIES if policy_class(p).needs_step_time] == ["dsd"]
    sprinter = policy_class("sprinter")
    assert sprinter(SpecConfig(policy="sprinter")).trusted(torch.tensor([0, 1, 3])).tolist() == [0, 0, 2]
    assert make_policy(SpecConfig(policy="sd")).trusted(torch.tensor([2])) is None
    assert policy_class("sprinter-exact")(SpecConfig(policy="sprinter-exact")).trusted(torch.tensor([3])) is None


def test_check_windows_errors() -> None:
    check_windows(k=3, extra=2, capacity=12, batch_size=4)
    check_windows(k=3, extra=2, capacity=20, batch_size=4)
    cases = [
        ({"k": 0, "extra": 0, "capacity": 0, "batch_size": 1}, "k must be >= 1"),
        ({"k": 2, "extra": -1, "capacity": 2, "batch_size": 1}, "extra must be >= 0"),
        ({"k": 2, "extra": 0, "capacity": -1, "batch_size": 1}, "capacity must be >= 0"),
        ({"k": 2, "extra": 1, "capacity": 7, "batch_size": 2}, r"exceeds .* = 6"),
        ({"k": 2, "extra": 1, "capacity": 0, "batch_size": 0}, "batch size must be >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(BatchspecError, match=message):
            check_windows(**kwargs)


def test_settings_are_checked_by_their_policy() -> None:
    make_policy(SpecConfig(policy="ar", k=0), batch_size=4)  # ar reads none of them
    with pytest.raises(BatchspecError, match="k must be >= 1"):
        make_policy(SpecConfig(policy="sd", k=0), batch_size=4)
    with pytest.raises(BatchspecError, match="k_max must be >= 1"):
        make_policy(SpecConfig(policy="dsd", k_max=0), batch_size=4)
    with pytest.raises(BatchspecError, match="needs a SPRINTER verifier"):
        make_policy(SpecConfig(policy="sprinter"), batch_size=4)
    with pytest.raises(BatchspecError, match="needs a SPRINTER verifier"):
        make_policy(SpecConfig(policy="tetris", tetris_scores="verifier"), batch_size=4)
    with pytest.raises(BatchspecError, match="--tau must be in"):
        make_policy(SpecConfig(policy="sprinter", verifier="v", tau=1.5), batch_size=4)
    with pytest.raises(BatchspecError, match="ar, sd, dsd, tetris, oracle, sprinter"):
        policy_class("tetirs")
