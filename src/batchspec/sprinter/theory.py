"""SPRINTER's analysis (DESIGN.md section 5) as pure functions: output distribution, fidelity, speed.

Model. The draft proposes x ~ q. Standard speculative decoding (SD) would accept x with probability min(1, p/q)
(coupled: x is "SD-acceptable" or not). The verifier accepts x without asking the target; its errors are
    eta_fp = P(verifier accepts | SD would reject)   (false accept: costs fidelity)
    eta_fn = P(verifier rejects | SD would accept)   (false reject: costs speed, not fidelity).
A request's block ends at the first token the verifier rejects, or after L tokens; the target runs once and applies
the SD test to the block's last token only (accepted: keep it and sample a bonus token from p; rejected: replace it
by a sample of the residual). Tokens before the last are kept unchecked.

Results (acceptance i.i.d. per token with rate alpha = 1 - TV(p, q)):
- an unchecked token has distribution p_S = (1 - eta_fp) p + eta_fp q, so TV(p, p_S) = eta_fp TV(p, q);
- r = P(verifier accepts) = alpha (1 - eta_fn) + (1 - alpha) eta_fp; the block length N = min(Geometric, L) has
  E[N] = (1 - r^L) / (1 - r);
- tokens per target call = E[N] + P(the block's last token passes the SD test);
- latency per token = (E[N] (c_draft + c_verifier) + c_target) / tokens per call, against SD's
  (gamma c_draft + c_target) (1 - alpha) / (1 - alpha^(gamma + 1)).
"""

from __future__ import annotations

import numpy as np


def sprinter_distribution(p: np.ndarray, q: np.ndarray, eta_fp: float) -> np.ndarray:
    """p_S = (1 - eta_fp) p + eta_fp q: the law of a token kept without a target check."""
    return (1.0 - eta_fp) * p + eta_fp * q


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def sprinter_tv(p: np.ndarray, q: np.ndarray, eta_fp: float) -> float:
    """TV(p, p_S) = eta_fp * TV(p, q)."""
    return eta_fp * total_variation(p, q)


def verifier_accept_rate(alpha: float, eta_fp: float, eta_fn: float) -> float:
    """r = P(verifier accepts a token) = alpha (1 - eta_fn) + (1 - alpha) eta_fp."""
    return alpha * (1.0 - eta_fn) + (1.0 - alpha) * eta_fp


def expected_block_length(alpha: float, eta_fp: float, eta_fn: float, block_cap: int) -> float:
    """E[N], N = tokens drafted before the target call: min(first verifier rejection, L)."""
    r = verifier_accept_rate(alpha, eta_fp, eta_fn)
    if r >= 1.0:
        return float(block_cap)
    return (1.0 - r ** block_cap) / (1.0 - r)


def last_token_pass_rate(alpha: float, eta_fp: float, eta_fn: float, block_cap: int) -> float:
    """P(the block's last token passes the SD test).

    The last token is verifier-accepted only when the block hit the cap with every token accepted (prob r^L);
    otherwise it is the verifier's first rejection. Bayes gives the SD acceptance in each case.
    """
    r = verifier_accept_rate(alpha, eta_fp, eta_fn)
    capped = r ** block_cap
    pass_if_accepted = alpha * (1.0 - eta_fn) / r if r > 0 else 0.0
    pass_if_rejected = alpha * eta_fn / (1.0 - r) if r < 1 else 0.0
    return capped * pass_if_accepted + (1.0 - capped) * pass_if_rejected


def tokens_per_target_call(alpha: float, eta_fp: float, eta_fn: float, block_cap: int) -> float:
    """E[tokens emitted per target call]: the N - 1 unchecked tokens, the checked (or resampled) one, a bonus."""
    return (expected_block_length(alpha, eta_fp, eta_fn, block_cap)
            + last_token_pass_rate(alpha, eta_fp, eta_fn, block_cap))


def sprinter_latency_per_token(alpha: float, eta_fp: float, eta_fn: float, block_cap: int, c_draft: float,
                               c_target: float, c_verifier: float = 0.0) -> float:
    n = expected_block_length(alpha, eta_fp, eta_fn, block_cap)
    return (n * (c_draft + c_verifier) + c_target) / tokens_per_target_call(alpha, eta_fp, eta_fn, block_cap)


def sd_latency_per_token(alpha: float, gamma: int, c_draft: float, c_target: float) -> float:
    """Standard SD with window gamma: (gamma c_draft + c_target) (1 - alpha) / (1 - alpha^(gamma + 1))."""
    if alpha >= 1.0:
        return (gamma * c_draft + c_target) / (gamma + 1)
    return (gamma * c_draft + c_target) * (1.0 - alpha) / (1.0 - alpha ** (gamma + 1))


def simulate_blocks(alpha: float, eta_fp: float, eta_fn: float, block_cap: int, calls: int,
                    rng: np.random.Generator) -> float:
    """Monte-Carlo tokens per target call of the block process above (for tests of the closed forms)."""
    acceptable = rng.random((calls, block_cap)) < alpha  # (calls, L) SD would accept token j
    flip = rng.random((calls, block_cap))
    verifier = np.where(acceptable, flip >= eta_fn, flip < eta_fp)  # (calls, L) verifier accepts token j
    rejected = ~verifier
    first_reject = np.where(rejected.any(1), rejected.argmax(1), block_cap - 1)  # index of the block's last token
    length = first_reject + 1  # (calls,)
    passed = acceptable[np.arange(calls), first_reject]
    return float((length + passed).mean())


def simulate_token_distribution(p: np.ndarray, q: np.ndarray, eta_fp: float, eta_fn: float, samples: int,
                                rng: np.random.Generator) -> np.ndarray:
    """Empirical law of one SPRINTER token: kept unchecked if the verifier accepts, else SD-tested by the target."""
    vocab = len(p)
    x = rng.choice(vocab, size=samples, p=q)
    acceptable = rng.random(samples) < np.minimum(1.0, p[x] / q[x])
    flip = rng.random(samples)
    verifier = np.where(acceptable, flip >= eta_fn, flip < eta_fp)
    residual = np.maximum(p - q, 0.0)
    replacement = rng.choice(vocab, size=samples, p=residual / residual.sum())
    out = np.where(acceptable | verifier, x, replacement)
    return np.bincount(out, minlength=vocab) / samples
