"""Lossless verification of ragged draft windows: batched speculative sampling (DESIGN.md section 4).

Leviathan et al. 2023 / Chen et al. 2023, per request i over its own window l[i]:
accept d[i,j] with probability min(1, p/q), in order; at the first rejection sample a replacement from
normalise(max(0, p - q)) and stop; if all l[i] drafts pass, sample a bonus token from p at position l[i].
The emitted tokens of request i are drafts[i, :num_accepted[i]] followed by next_token[i].

SPRINTER (approximate, lossy) reuses both functions with `trusted` (B,): the first trusted[i] drafts of a window
count as accepted without the target's test (its verifier vouched for them); only the later ones are tested —
with trusted = window - 1, only each block's last token, as in the paper.

Positions are 0-based here: target_probs[:, j] is the target's distribution for the token at draft position j,
and target_probs[:, K'] the one after the last draft (the bonus slot).
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchspec.runtime.sampling import sample_with_uniforms


def _gather_token_probs(probs: Tensor, tokens: Tensor) -> Tensor:
    """probs (B, K', V), tokens (B, K') -> probability of each token (B, K')."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _accepted_prefix_length(accepted: Tensor, windows: Tensor, trusted: Tensor | None = None) -> Tensor:
    """Length of the leading run of accepted drafts inside each window. (B, K') bool, (B,) -> (B,) int64.

    trusted (B,): drafts before this position pass regardless of `accepted` (SPRINTER's unchecked tokens).
    """
    positions = torch.arange(accepted.shape[1], device=accepted.device)  # (K',)
    if trusted is not None:
        accepted = accepted | (positions[None, :] < trusted[:, None])
    ok = accepted & (positions[None, :] < windows[:, None])  # (B, K')
    # cumprod zeroes everything after the first failure, so the sum counts the accepted prefix only.
    return torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)  # (B,)


def accept_draft(uniforms: Tensor, p_of_draft: Tensor, q_of_draft: Tensor) -> Tensor:
    """The acceptance rule, written once: accept iff u < min(1, p(d)/q(d)).

    For u in [0, 1) this is u * q(d) < p(d), which needs no division (q(d) = 0 accepts iff p(d) > 0). Shapes (B, K').
    """
    return uniforms * q_of_draft < p_of_draft


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """Unnormalised correction distribution max(0, p - q), or p where that has no mass (p == q numerically). (B, V)."""
    residual = (p - q).clamp(min=0.0)  # (B, V)
    has_mass = residual.sum(dim=-1, keepdim=True) > 0.0  # (B, 1)
    return torch.where(has_mass, residual, p)


def acceptance_probs(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> Tensor:
    """True acceptance probability a[i,j] = min(1, p(d)/q(d)) of each draft, (B, K') (for the oracle policy).

    At temperature 0 use `greedy_acceptance_probs` instead (a = 1 iff d == argmax p).
    """
    k_prime = draft_tokens.shape[1]
    p_of_draft = _gather_token_probs(target_probs[:, :k_prime], draft_tokens)  # (B, K')
    q_of_draft = _gather_token_probs(draft_probs, draft_tokens)  # (B, K')
    ratio = p_of_draft / torch.where(q_of_draft > 0, q_of_draft, torch.ones_like(q_of_draft))
    # q(d) = 0 (a draft the draft model could not have sampled): accepted surely iff p(d) > 0, as in `accept_draft`.
    return torch.where(q_of_draft > 0, ratio.clamp(max=1.0), (p_of_draft > 0).to(ratio.dtype))


def greedy_acceptance_probs(draft_tokens: Tensor, target_argmax: Tensor) -> Tensor:
    """Temperature-0 acceptance: 1.0 iff d == argmax p. (B, K'), (B, K'+1) -> (B, K') float32."""
    return (draft_tokens == target_argmax[:, : draft_tokens.shape[1]]).to(torch.float32)


def verify(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    windows: Tensor,
    uniforms: Tensor,
    generator: torch.Generator | None = None,
    next_uniforms: Tensor | None = None,
    trusted: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Batched speculative sampling on ragged windows; returns (num_accepted (B,), next_token (B,)), both int64.

    draft_tokens (B, K') int64; draft_probs (B, K', V) the processed q each draft was drawn from; target_probs
    (B, K'+1, V) the processed p at every draft position plus the bonus slot; windows (B,) int64 in [0, K'];
    uniforms (B, K') in [0, 1) for the accept tests; the correction/bonus draw uses `next_uniforms` (B,) by inverse
    CDF when given (so each request can bring draws from its own seeded generator), else `generator`.
    A window of 0 is an ordinary decoding step: next_token ~ p[:, 0].
    """
    batch_size, k_prime = draft_tokens.shape
    rows = torch.arange(batch_size, device=draft_tokens.device)  # (B,)

    p_of_draft = _gather_token_probs(target_probs[:, :k_prime], draft_tokens)  # (B, K')
    q_of_draft = _gather_token_probs(draft_probs, draft_tokens)  # (B, K')
    num_accepted = _accepted_prefix_length(accept_draft(uniforms, p_of_draft, q_of_draft), windows, trusted)  # (B,)

    # The next token is drawn at position num_accepted: a correction if that position was inside the window
    # (a rejection), otherwise the bonus slot windows[i].
    rejected = num_accepted < windows  # (B,)
    p_next = target_probs[rows, num_accepted]  # (B, V)
    if k_prime > 0:
        # Clamp only keeps the index valid for bonus rows, whose q is not used.
        q_next = draft_probs[rows, num_accepted.clamp(max=k_prime - 1)]  # (B, V)
        next_dist = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)  # (B, V)
    else:
        next_dist = p_next
    if next_uniforms is not None:
        next_token = sample_with_uniforms(next_dist, next_uniforms)  # (B,)
    else:
        next_token = torch.multinomial(next_dist, 1, generator=generator).squeeze(1)  # (B,)
    return num_accepted, next_token


def verify_greedy(draft_tokens: Tensor, target_argmax: Tensor, windows: Tensor,
                  trusted: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Temperature 0: accept while d == argmax p; the next token is argmax p at the first mismatch or bonus slot.

    draft_tokens (B, K'), target_argmax (B, K'+1), windows (B,) -> (num_accepted (B,), next_token (B,)).
    """
    k_prime = draft_tokens.shape[1]
    matches = draft_tokens == target_argmax[:, :k_prime]  # (B, K')
    num_accepted = _accepted_prefix_length(matches, windows, trusted)  # (B,)
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # (B,)
    return num_accepted, next_token
