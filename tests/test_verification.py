"""Batched ragged speculative sampling is lossless: emitted tokens follow the target; greedy mode is exact.

The distribution test uses synthetic per-position distributions p[t] that do not depend on the prefix. The
lossless property then says: given that request i reaches output position t (all earlier drafts accepted), the
token it emits there is distributed as p[t], whatever its window. Every (group, window, position) cell is checked
with a chi-square test, and the same test must reject deliberately broken samplers.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import batchspec.spec.verification as verification
from batchspec.spec.policies.tetris import expected_accepted
from batchspec.spec.verification import (
    acceptance_probs,
    greedy_acceptance_probs,
    residual_distribution,
    verify,
    verify_greedy,
)

GROUPS, K_PRIME, VOCAB = 2, 3, 6
BATCH, CALLS = 25_000, 4  # 100k requests in total


def random_distributions(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Dirichlet(1) rows mixed with a little uniform mass, so every expected chi-square count stays large."""
    raw = -torch.log(torch.rand(*shape, generator=generator, dtype=torch.float64))
    return 0.9 * raw / raw.sum(-1, keepdim=True) + 0.1 / shape[-1]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of Pearson's chi-square statistic, (V,) observed counts against (V,) probabilities."""
    n = counts.sum()
    expected = n * probs
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2.0))


def emitted_tokens(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """(B, K'+1) output tokens of each request: accepted drafts, then next_token, then -1 padding."""
    batch_size, k_prime = draft_tokens.shape
    positions = torch.arange(k_prime + 1)[None, :]  # (1, K'+1)
    padded = torch.cat([draft_tokens, torch.full((batch_size, 1), -1)], dim=1)  # (B, K'+1)
    out = torch.where(positions < num_accepted[:, None], padded, torch.full_like(padded, -1))
    return torch.where(positions == num_accepted[:, None], next_token[:, None], out)


def sample_cells(seed: int, head: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    """Run `verify` on CALLS batches of BATCH requests drawn from GROUPS fixed (p, q) pairs.

    head < VOCAB: q is zero outside the first `head` tokens, as for a draft with a restricted head vocabulary.

    Returns p (G, K'+1, V), q (G, K', V), token counts (G, W, K'+1, V) indexed by (group, window, output position),
    and the sum and count of num_accepted per (group, window), (G, W).
    """
    generator = torch.Generator().manual_seed(seed)
    p = random_distributions(generator, GROUPS, K_PRIME + 1, VOCAB)  # (G, K'+1, V)
    q = random_distributions(generator, GROUPS, K_PRIME, VOCAB)  # (G, K', V)
    q[..., head:] = 0.0
    q = q / q.sum(-1, keepdim=True)
    windows_count = K_PRIME + 1
    counts = torch.zeros(GROUPS, windows_count, K_PRIME + 1, VOCAB, dtype=torch.float64)
    accepted_sum = torch.zeros(GROUPS, windows_count, dtype=torch.float64)
    requests = torch.zeros(GROUPS, windows_count, dtype=torch.float64)
    group = torch.arange(BATCH) % GROUPS  # (B,)
    for _ in range(CALLS):
        draft_probs = q[group]  # (B, K', V)
        draft_tokens = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1, generator=generator).reshape(BATCH, K_PRIME)
        windows = torch.randint(0, windows_count, (BATCH,), generator=generator)  # (B,)
        uniforms = torch.rand(BATCH, K_PRIME, generator=generator, dtype=torch.float64)
        num_accepted, next_token = verify(draft_tokens, draft_probs, p[group], windows, uniforms, generator)
        assert bool((num_accepted <= windows).all())
        tokens = emitted_tokens(draft_tokens, num_accepted, next_token)  # (B, K'+1)
        for t in range(K_PRIME + 1):  # a loop over test cells, not over tokens
            reached = tokens[:, t] >= 0
            cell = (group * windows_count + windows) * (K_PRIME + 1) * VOCAB + t * VOCAB + tokens[:, t]
            counts.view(-1).index_add_(0, cell[reached], torch.ones(int(reached.sum()), dtype=torch.float64))
        accepted_sum.view(-1).index_add_(0, group * windows_count + windows, num_accepted.to(torch.float64))
        requests.view(-1).index_add_(0, group * windows_count + windows, torch.ones(BATCH, dtype=torch.float64))
    return p, q, counts, accepted_sum, requests


def min_p_value(p: torch.Tensor, counts: torch.Tensor) -> float:
    """Smallest chi-square p-value over every reachable (group, window, position) cell."""
    p_values = [
        chi_square_p_value(counts[g, w, t], p[g, t])
        for g in range(GROUPS)
        for w in range(K_PRIME + 1)
        for t in range(w + 1)
    ]
    return min(p_values)


def test_ragged_verification_reproduces_target_distribution() -> None:
    p, q, counts, _, _ = sample_cells(seed=0)
    # Make sure the test has teeth: p and q differ a lot, so drafts are often rejected.
    assert float(0.5 * (p[:, :K_PRIME] - q).abs().sum(-1).min()) > 0.15
    assert int(counts[:, :, 3].sum()) > 1000  # the deepest cells are populated
    # 20 cells: a 1e-5 threshold keeps the false-alarm rate near 2e-4 for any seed; broken samplers score ~0.
    assert min_p_value(p, counts) > 1e-5


def test_draft_with_restricted_head_vocabulary_stays_lossless() -> None:
    # A draft that can only propose 4 of the 6 tokens: the residual max(0, p - q) must supply the other two.
    p, q, counts, _, _ = sample_cells(seed=1, head=VOCAB - 2)
    assert float(q[..., VOCAB - 2:].sum()) == 0.0
    assert float(p[..., VOCAB - 2:].sum(-1).min()) > 0.05  # the target does want the tokens the draft lacks
    assert min_p_value(p, counts) > 1e-5


def test_mean_accepted_matches_expected_accepted() -> None:
    p, q, _, accepted_sum, requests = sample_cells(seed=1)
    alpha = torch.minimum(p[:, :K_PRIME], q).sum(-1)  # (G, K'): E_{d~q} min(1, p(d)/q(d))
    for g in range(GROUPS):
        for w in range(K_PRIME + 1):
            expected = expected_accepted(alpha[g : g + 1], torch.tensor([w]))
            mean = float(accepted_sum[g, w] / requests[g, w])
            standard_error = w / requests[g, w].sqrt()  # num_accepted lies in [0, w]
            assert abs(mean - expected) < 5 * float(standard_error) + 1e-12


@pytest.mark.parametrize(
    ("target", "broken"),
    [
        # Correction drawn from p instead of the residual max(0, p - q).
        ("residual_distribution", lambda p, q: p),
        # Accept with probability p(d) instead of min(1, p(d)/q(d)).
        ("accept_draft", lambda u, p_d, q_d: u < p_d),
        # Accept every draft: the output follows q.
        ("accept_draft", lambda u, p_d, q_d: torch.ones_like(u, dtype=torch.bool)),
    ],
)
def test_broken_samplers_fail_the_same_test(
    monkeypatch: pytest.MonkeyPatch, target: str, broken: Callable[..., torch.Tensor]
) -> None:
    monkeypatch.setattr(verification, target, broken)
    p, _, counts, _, _ = sample_cells(seed=0)
    assert min_p_value(p, counts) < 1e-8


def test_window_zero_and_no_drafts_sample_from_first_target_position() -> None:
    generator = torch.Generator().manual_seed(3)
    target = torch.nn.functional.one_hot(torch.tensor([[4], [1]]), 6).to(torch.float32)  # (2, 1, 6)
    num_accepted, next_token = verify(
        torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, 6), target, torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, 0), generator,
    )
    assert num_accepted.tolist() == [0, 0] and next_token.tolist() == [4, 1]


def test_residual_without_mass_falls_back_to_p() -> None:
    p = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.5, 0.0]])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.0, 0.8]]))


def test_acceptance_probs() -> None:
    draft_tokens = torch.tensor([[0, 2]])
    draft_probs = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]]])
    target_probs = torch.tensor([[[0.25, 0.75, 0.0], [0.1, 0.1, 0.8], [1.0, 0.0, 0.0]]])
    assert torch.allclose(acceptance_probs(draft_tokens, draft_probs, target_probs), torch.tensor([[0.5, 1.0]]))
    # q(d) = 0 cannot come from sampling q; accepted surely iff p(d) > 0, matching the accept rule.
    impossible_draft = acceptance_probs(
        torch.tensor([[2]]), torch.tensor([[[0.5, 0.5, 0.0]]]), torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    )
    assert impossible_draft.item() == 1.0
    assert greedy_acceptance_probs(draft_tokens, torch.tensor([[0, 1, 2]])).tolist() == [[1.0, 0.0]]


def reference_greedy(draft_tokens: list[int], target_argmax: list[int], window: int) -> tuple[int, int]:
    accepted = 0
    while accepted < window and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, target_argmax[accepted]


def random_greedy_case(
    generator: torch.Generator, batch_size: int, k_prime: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target_argmax = torch.randint(0, vocab, (batch_size, k_prime + 1), generator=generator)
    draft_tokens = torch.randint(0, vocab, (batch_size, k_prime), generator=generator)
    # Copy the target's choice often so that long accepted runs occur.
    copy = torch.rand(batch_size, k_prime, generator=generator) < 0.7
    draft_tokens = torch.where(copy, target_argmax[:, :k_prime], draft_tokens)
    windows = torch.randint(0, k_prime + 1, (batch_size,), generator=generator)
    return draft_tokens, target_argmax, windows


def test_verify_greedy_matches_reference() -> None:
    generator = torch.Generator().manual_seed(11)
    draft_tokens, target_argmax, windows = random_greedy_case(generator, 500, 4, 5)
    num_accepted, next_token = verify_greedy(draft_tokens, target_argmax, windows)
    for i in range(500):
        expected = reference_greedy(draft_tokens[i].tolist(), target_argmax[i].tolist(), int(windows[i]))
        assert (int(num_accepted[i]), int(next_token[i])) == expected


def test_one_hot_target_makes_verify_equal_verify_greedy() -> None:
    generator = torch.Generator().manual_seed(12)
    batch_size, k_prime, vocab = 2000, 4, 5
    draft_tokens, target_argmax, windows = random_greedy_case(generator, batch_size, k_prime, vocab)
    target_probs = torch.nn.functional.one_hot(target_argmax, vocab).to(torch.float32)  # (B, K'+1, V)
    draft_probs = torch.softmax(torch.randn(batch_size, k_prime, vocab, generator=generator), dim=-1)
    # Degenerate draft distributions: one-hot on the draft (q(argmax) = 0) or on the target's argmax while the
    # draft differs (q(d) = 0 and max(0, p - q) has no mass, exercising the fallback to p).
    kind = torch.randint(0, 3, (batch_size, k_prime, 1), generator=generator)
    draft_probs = torch.where(kind == 1, torch.nn.functional.one_hot(draft_tokens, vocab).float(), draft_probs)
    draft_probs = torch.where(kind == 2, target_probs[:, :k_prime], draft_probs)
    uniforms = torch.rand(batch_size, k_prime, generator=generator)
    stochastic = verify(draft_tokens, draft_probs, target_probs, windows, uniforms, generator)
    greedy = verify_greedy(draft_tokens, target_argmax, windows)
    assert torch.equal(stochastic[0], greedy[0]) and torch.equal(stochastic[1], greedy[1])


def test_verify_is_deterministic_given_seed() -> None:
    def run(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        probs = torch.softmax(torch.randn(64, 4, 7, generator=generator), dim=-1)
        drafts = torch.multinomial(probs[:, :3].reshape(-1, 7), 1, generator=generator).reshape(64, 3)
        windows = torch.randint(0, 4, (64,), generator=generator)
        uniforms = torch.rand(64, 3, generator=generator)
        return verify(drafts, probs[:, :3].flip(-1), probs, windows, uniforms, generator)

    first, second = run(5), run(5)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_trusted_prefix_checks_only_the_last_token() -> None:
    """SPRINTER: with trusted = window - 1 only each block's last draft meets the target's test."""
    drafts = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    argmax = torch.tensor([[9, 9, 7, 0, 3],  # window 3: drafts 1-2 wrong but trusted, 3rd right -> 3 + bonus
                           [5, 6, 9, 0, 3],  # window 3: last wrong -> 2 kept, correction argmax[2]
                           [9, 6, 7, 8, 3],  # window 1: its only draft is tested (and wrong)
                           [1, 2, 3, 4, 5]])  # window 0: plain decoding step
    windows = torch.tensor([3, 3, 1, 0])
    accepted, nxt = verify_greedy(drafts, argmax, windows, trusted=(windows - 1).clamp(min=0))
    assert accepted.tolist() == [3, 2, 0, 0] and nxt.tolist() == [0, 9, 9, 1]
    plain, _ = verify_greedy(drafts, argmax, windows)
    assert plain.tolist() == [0, 2, 0, 0]
    # The sampling path agrees with the greedy one on one-hot distributions.
    vocab = 10
    p = torch.nn.functional.one_hot(argmax, vocab).float()
    q = torch.nn.functional.one_hot(drafts, vocab).float()
    sampled, nxt_sampled = verify(drafts, q, p, windows, torch.full((4, 4), 0.5),
                                  next_uniforms=torch.full((4,), 0.5), trusted=(windows - 1).clamp(min=0))
    assert sampled.tolist() == [3, 2, 0, 0] and nxt_sampled.tolist() == [0, 9, 9, 1]
