"""Tetris and the oracle: optimality against brute force, exact capacity under ties, prefix closure, sd equivalence."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec.spec.policies.base import sd_windows
from batchspec.spec.policies.tetris import expected_accepted, oracle_windows, tetris_keep_drafting, tetris_windows
from batchspec.spec.proposal import replay_drafting, undrafted

FAST = settings(max_examples=150, derandomize=True, deadline=None)


def reference_expected_accepted(accept: list[list[float]], windows: list[int]) -> float:
    """E[A] by its definition, one request and one position at a time."""
    total = 0.0
    for row, length in zip(accept, windows):
        survival = 1.0
        for j in range(length):
            survival *= row[j]
            total += survival
    return total


def brute_force_best(accept: list[list[float]], capacity: int) -> float:
    """max E[A] over every window assignment with sum(l) <= C."""
    k_prime = len(accept[0])
    return max(
        reference_expected_accepted(accept, list(windows))
        for windows in itertools.product(range(k_prime + 1), repeat=len(accept))
        if sum(windows) <= capacity
    )


def random_accept_probs(generator: torch.Generator, batch_size: int, k_prime: int) -> torch.Tensor:
    """Uniform acceptances salted with exact 0s, 1s and repeated values, so ties are common."""
    accept = torch.rand(batch_size, k_prime, generator=generator, dtype=torch.float64)
    salt = torch.randint(0, 6, (batch_size, k_prime), generator=generator)
    accept = torch.where(salt == 0, torch.zeros_like(accept), accept)
    accept = torch.where(salt == 1, torch.ones_like(accept), accept)
    return torch.where(salt == 2, torch.full_like(accept, 0.5), accept)


def test_tetris_and_oracle_match_brute_force_optimum() -> None:
    generator = torch.Generator().manual_seed(1234)
    for _ in range(300):
        batch_size = int(torch.randint(1, 5, (1,), generator=generator))
        k_prime = int(torch.randint(1, 5, (1,), generator=generator))
        capacity = int(torch.randint(0, batch_size * k_prime + 1, (1,), generator=generator))
        accept = random_accept_probs(generator, batch_size, k_prime)  # (B, K')
        best = brute_force_best(accept.tolist(), capacity)
        # Using the true acceptance as q makes Tetris the oracle: both must reach the optimum.
        for windows in (tetris_windows(torch.log(accept), capacity), oracle_windows(accept, capacity)):
            assert windows.dtype == torch.int64 and windows.shape == (batch_size,)
            assert int(windows.sum()) <= capacity
            assert bool(((windows >= 0) & (windows <= k_prime)).all())
            assert expected_accepted(accept, windows) == pytest.approx(best, abs=1e-9)


def test_expected_accepted_matches_definition() -> None:
    generator = torch.Generator().manual_seed(7)
    accept = torch.rand(5, 4, generator=generator, dtype=torch.float64)
    windows = torch.tensor([0, 4, 2, 1, 3])
    assert expected_accepted(accept, windows) == pytest.approx(
        reference_expected_accepted(accept.tolist(), windows.tolist()), abs=1e-12
    )


LOGPROB_ATOMS = st.sampled_from([0.0, -0.0, -math.inf, -0.5, -1.0, -2.5])
LOGPROBS = st.one_of(LOGPROB_ATOMS, st.floats(min_value=-6.0, max_value=0.0))


@st.composite
def logprob_instances(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    batch_size = draw(st.integers(1, 6))
    k_prime = draw(st.integers(1, 6))
    values = draw(st.lists(LOGPROBS, min_size=batch_size * k_prime, max_size=batch_size * k_prime))
    capacity = draw(st.integers(0, batch_size * k_prime + 3))
    return torch.tensor(values, dtype=torch.float32).reshape(batch_size, k_prime), capacity


@FAST
@given(logprob_instances())
def test_tetris_spends_capacity_exactly_on_a_top_c_prefix_closed_set(instance: tuple[torch.Tensor, int]) -> None:
    logprobs, capacity = instance
    batch_size, k_prime = logprobs.shape
    windows = tetris_windows(logprobs, capacity)
    assert bool(((windows >= 0) & (windows <= k_prime)).all())
    # Exactly C (never more, also with ties at 0 and -inf): the reference code overshoots here.
    assert int(windows.sum()) == min(capacity, batch_size * k_prime)
    # Windows are prefixes by construction; they must also be a top-C set: the weakest chosen score is no
    # worse than the best score left out.
    scores = torch.cumsum(logprobs, dim=1)  # (B, K')
    chosen = torch.arange(k_prime)[None, :] < windows[:, None]  # (B, K')
    if bool(chosen.any()) and bool((~chosen).any()):
        assert float(scores[chosen].min()) >= float(scores[~chosen].max())


@FAST
@given(
    alpha=st.floats(min_value=0.01, max_value=0.99),
    batch_size=st.integers(1, 6),
    k_prime=st.integers(1, 6),
    per_request=st.integers(0, 6),
)
def test_equal_acceptance_makes_tetris_uniform_like_sd(
    alpha: float, batch_size: int, k_prime: int, per_request: int
) -> None:
    k = min(per_request, k_prime)
    capacity = k * batch_size
    accept = torch.full((batch_size, k_prime), alpha, dtype=torch.float64)
    windows = tetris_windows(torch.log(accept), capacity)
    sd = sd_windows(batch_size, k, k_prime)
    assert torch.equal(windows, sd)
    assert expected_accepted(accept, windows) == pytest.approx(expected_accepted(accept, sd), abs=1e-12)


def test_certain_acceptance_ties_still_spend_exactly_capacity() -> None:
    # a = 1 everywhere: all scores tie at 0; any split is optimal, but the sum must be exactly C.
    accept = torch.ones(3, 4)
    windows = tetris_windows(torch.log(accept), 5)
    assert int(windows.sum()) == 5
    assert expected_accepted(accept, windows) == 5.0


def test_capacity_bounds() -> None:
    logprobs = -torch.rand(3, 4)
    assert torch.equal(tetris_windows(logprobs, 12), torch.full((3,), 4))
    assert torch.equal(tetris_windows(logprobs, 100), torch.full((3,), 4))
    assert torch.equal(tetris_windows(logprobs, 0), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(oracle_windows(torch.rand(3, 4), 100), torch.full((3,), 4))


def test_tetris_ranks_nan_and_positive_log_probs_safely() -> None:
    # NaN ranks as -inf (never ahead of a real draft), log q > 0 from rounding as 0; the input is not modified.
    logprobs = torch.tensor([[-0.1, math.nan, -0.1], [-0.5, -0.5, -0.5], [1e-7, -0.2, -math.inf]])
    before = logprobs.clone()
    as_meant = torch.tensor([[-0.1, -math.inf, -0.1], [-0.5, -0.5, -0.5], [0.0, -0.2, -math.inf]])
    for capacity in range(10):
        windows = tetris_windows(logprobs, capacity)
        assert torch.equal(windows, tetris_windows(as_meant, capacity)) and int(windows.sum()) == capacity
    assert torch.equal(logprobs.isnan(), before.isnan()) and torch.equal(logprobs.nan_to_num(), before.nan_to_num())
    assert tetris_windows(logprobs, 3).tolist() == [1, 0, 2]


def test_tetris_prefers_easy_requests() -> None:
    # Request 0 is confident, request 1 is not: the staircase gives request 0 the long window.
    logprobs = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9]]))
    assert tetris_windows(logprobs, 4).tolist() == [4, 0]
    assert tetris_windows(logprobs, 5).tolist() == [4, 1]


@FAST
@given(st.integers(1, 6), st.integers(2, 6), st.integers(0, 10_000), st.integers(0, 40))
def test_pruned_drafting_keeps_every_draft_the_selection_verifies(batch_size, k_prime, seed, capacity):
    """Drafting with `tetris_keep_drafting` and then selecting gives the windows of drafting everything, and no
    window reaches past what a request drafted (ties salted in: repeated and zero log-probabilities)."""
    capacity = min(capacity, batch_size * k_prime)
    generator = torch.Generator().manual_seed(seed)
    logprobs = random_accept_probs(generator, batch_size, k_prime).float().log()  # (B, K'), -inf included

    def rule(so_far, drafting):
        return torch.from_numpy(tetris_keep_drafting(so_far.numpy(), drafting.numpy(), capacity))

    drafted = replay_drafting(rule, logprobs)
    windows = tetris_windows(undrafted(logprobs, drafted), capacity)
    assert windows.tolist() == tetris_windows(logprobs, capacity).tolist()
    assert bool((windows <= drafted).all())
    if capacity == 0:
        assert drafted.tolist() == [1] * batch_size  # nothing can be verified: one pass, then stop


def test_requests_planned_no_drafts_do_not_run_the_draft(tiny_model_factory):
    """`propose` with `first`: the requests left out draft nothing and their draft cache is untouched (their pending
    tokens wait); the others draft exactly what they draft in a pass over the whole batch."""
    from batchspec.spec.proposal import propose
    from batchspec.weights.loading import load_model

    model = load_model(tiny_model_factory(name="draft", seed=3)).transformer
    pending = [[5, 6, 7], [8, 9], [10]]
    results = []
    for first in (None, torch.tensor([True, False, True])):
        cache = model.new_cache(3, 32)
        slots = torch.tensor([cache.allocate() for _ in range(3)])
        proposal = propose(model, cache, slots, pending, 3, sampling=None, uniforms=None, first=first)
        results.append((proposal, cache.lengths[slots].tolist()))
    (every, every_lengths), (some, some_lengths) = results
    assert some.drafted.tolist() == [3, 0, 3] and every.drafted.tolist() == [3, 3, 3]
    assert torch.isinf(some.logprobs[1]).all()
    assert some.tokens[[0, 2]].tolist() == every.tokens[[0, 2]].tolist()
    assert some_lengths == [every_lengths[0], 0, every_lengths[2]]
