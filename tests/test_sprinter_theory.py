"""SPRINTER's closed forms (DESIGN.md section 5) against Monte-Carlo simulation: within 2 % relative."""

from __future__ import annotations

import numpy as np
import pytest

from batchspec.sprinter.theory import (expected_block_length, sd_latency_per_token, simulate_blocks,
                                       simulate_token_distribution, sprinter_distribution,
                                       sprinter_latency_per_token, sprinter_tv, tokens_per_target_call,
                                       total_variation)


def _pair(rng, vocab=8):
    p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    return p, q


@pytest.mark.parametrize("eta_fp,eta_fn", [(0.0, 0.3), (0.25, 0.1), (0.6, 0.5)])
def test_output_distribution_and_tv_match_simulation(eta_fp, eta_fn):
    rng = np.random.default_rng(0)
    p, q = _pair(rng)
    empirical = simulate_token_distribution(p, q, eta_fp, eta_fn, samples=2_000_000, rng=rng)
    predicted = sprinter_distribution(p, q, eta_fp)
    assert np.abs(empirical - predicted).max() < 2e-3
    assert sprinter_tv(p, q, eta_fp) == pytest.approx(total_variation(p, predicted), rel=1e-12)
    if eta_fp > 0:  # TV(p, p_S) = eta_fp TV(p, q), measured
        assert total_variation(p, empirical) == pytest.approx(sprinter_tv(p, q, eta_fp), rel=0.02)
    else:  # a verifier that never false-accepts is lossless, whatever its false rejects
        assert total_variation(p, empirical) < 3e-3


@pytest.mark.parametrize("alpha,eta_fp,eta_fn,cap", [(0.8, 0.1, 0.1, 20), (0.5, 0.3, 0.2, 8), (0.95, 0.0, 0.05, 4),
                                                     (0.3, 0.6, 0.0, 3)])
def test_tokens_per_call_match_simulation(alpha, eta_fp, eta_fn, cap):
    simulated = simulate_blocks(alpha, eta_fp, eta_fn, cap, calls=400_000, rng=np.random.default_rng(1))
    assert tokens_per_target_call(alpha, eta_fp, eta_fn, cap) == pytest.approx(simulated, rel=0.02)


def test_limits():
    # A perfect verifier with L = 1 is standard SD with window 1: 1 + alpha tokens per call.
    assert tokens_per_target_call(0.7, 0.0, 0.0, 1) == pytest.approx(1.7)
    assert expected_block_length(0.7, 0.0, 0.0, 1) == 1.0
    # A perfect verifier and a free draft: latency per token is c_target / E[tokens per call].
    latency = sprinter_latency_per_token(0.9, 0.0, 0.0, 20, c_draft=0.0, c_target=1.0)
    assert latency == pytest.approx(1.0 / tokens_per_target_call(0.9, 0.0, 0.0, 20))
    # SD's latency formula at alpha = 0: every step emits one token at the price of gamma drafts + one target pass.
    assert sd_latency_per_token(0.0, 4, c_draft=0.1, c_target=1.0) == pytest.approx(1.4)
    # SPRINTER needs fewer target calls than SD when the verifier is good and acceptance high.
    assert tokens_per_target_call(0.9, 0.05, 0.05, 20) > (1 - 0.9 ** 5) / (1 - 0.9)
