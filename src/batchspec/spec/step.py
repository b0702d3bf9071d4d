"""One speculative step, as its stages: propose (draft) -> select (policy) -> verify (target); the engine commits.

`run` takes everything it needs as arguments — the policy and its plan for this step, the two models and their
caches, what it must know of the B requests (`StepInputs`) — and returns what happened (`StepResult`): per request,
the accepted drafts and the next token, which the engine appends to its requests. It leaves the target's cache rolled
back to the accepted prefix; the engine then rolls the draft's back (`engine.model_runner.resync_draft`), since only
it knows where each request ended. The stages themselves: `proposal.py` (draft and target passes), the policy's
`select` (`policies/`), `verification.py` (the acceptance rule).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from batchspec.runtime.kv_cache import KVCache
from batchspec.runtime.model import Transformer
from batchspec.spec.policies import Plan, Policy
from batchspec.spec.policies.tetris import expected_accepted, oracle_windows
from batchspec.spec.proposal import Proposal, propose, score
from batchspec.spec.stats import RunStats
from batchspec.spec.verification import acceptance_probs, greedy_acceptance_probs, verify, verify_greedy

Measured = Callable[[Tensor, Tensor], None]  # (draft log-probs (B, K'), true acceptance a (B, K')) of a step


@dataclass
class SpecModels:
    """The draft and the target with their caches (both caches use the same slot numbers)."""

    target: Transformer
    draft: Transformer
    target_cache: KVCache
    draft_cache: KVCache


@dataclass
class StepInputs:
    """What a speculative step needs to know of its B requests."""

    slots: Tensor  # (B,) cache slots
    last: Tensor  # (B,) each request's pending target token: the last one it emitted
    draft_pending: list[list[int]]  # per request, the committed tokens the draft's cache lacks (1 or 2)
    sampling: tuple[Tensor, Tensor, Tensor] | None  # (temperature, top_k, top_p) each (B,); None when all greedy
    draws: Tensor | None  # (B, 2K'+1) uniforms: K' draft draws, K' accept tests, 1 next token; None when all greedy


@dataclass
class StepResult:
    """What the step decided, per request."""

    drafts: list[list[int]]  # the K' drafted tokens
    drafted: list[int]  # how many the draft proposed (K', or a SPRINTER block's length)
    windows: list[int]  # l: how many the target verified
    accepted: list[int]  # how many it accepted
    next_tokens: list[int]  # bonus or correction token
    expected: tuple[float, float] | None  # E[A] of the policy's windows and of the oracle's, when a was measured

    def emitted(self, row: int) -> list[int]:
        """Request `row`'s new tokens: its accepted drafts, then the next token."""
        return self.drafts[row][:self.accepted[row]] + [self.next_tokens[row]]


def run(policy: Policy, plan: Plan, models: SpecModels, inputs: StepInputs, stats: RunStats,
        measure: bool = False, on_measured: Measured | None = None) -> StepResult:
    """Advance B requests by one speculative step of `plan.k_prime` drafts each.

    Model time and calls go into `stats` as each model runs (a trace snapshot taken mid-step sees them as before);
    `measure`: also run the untimed oracle pass (true acceptance a) and hand it to `on_measured`.
    """
    k_prime = plan.k_prime
    # A measured step drafts everything: the oracle and a recorded trace need every draft (pruning is exact, so the
    # policy's windows are the same either way).
    keep_drafting = None if measure else policy.drafting_rule(plan, len(inputs.draft_pending))
    # A plan with a length per request: those planned none do not run the draft at all.
    first = None if measure or plan.lengths is None or plan.lengths.all() else torch.from_numpy(plan.lengths > 0)
    started = time.perf_counter()
    proposal = propose(models.draft, models.draft_cache, inputs.slots, inputs.draft_pending, k_prime,
                       inputs.sampling, None if inputs.draws is None else inputs.draws[:, :k_prime],
                       scorer=policy.draft_scorer(), keep_drafting=keep_drafting, first=first)
    stats.draft_s += time.perf_counter() - started
    drafted = proposal.drafted.tolist()
    stats.draft_tokens += sum(drafted)

    accept_probs = None
    if measure or policy.needs_acceptance:
        accept_probs = measure_acceptance(models, inputs, proposal, stats)
        if on_measured is not None:
            on_measured(proposal.logprobs, accept_probs)

    started = time.perf_counter()
    windows = policy.select(plan, proposal, accept_probs)  # (B,)
    stats.select_s += time.perf_counter() - started

    accepted, next_token = _verify(policy, models, inputs, proposal, windows, stats)
    expected = None
    if accept_probs is not None:  # judged against the oracle at the same number of verified drafts (Theorem 1: <= 1)
        expected = (expected_accepted(accept_probs, windows),
                    expected_accepted(accept_probs, oracle_windows(accept_probs, int(windows.sum()))))
    windows_list, accepted_list = windows.tolist(), accepted.tolist()
    policy.observe(proposal, windows_list, accepted_list)
    return StepResult(proposal.tokens.tolist(), drafted, windows_list, accepted_list, next_token.tolist(), expected)


def _verify(policy: Policy, models: SpecModels, inputs: StepInputs, proposal: Proposal, windows: Tensor,
            stats: RunStats) -> tuple[Tensor, Tensor]:
    """One target pass over [last, d_1 .. d_l] per request, the acceptance rule, and the target's cache rolled back
    to the accepted prefix. Returns (accepted (B,), next token (B,))."""
    batch, k_prime = proposal.tokens.shape
    cache, slots = models.target_cache, inputs.slots
    before = cache.lengths[slots].clone()  # (B,) committed tokens minus the pending one
    started = time.perf_counter()
    scored = score(models.target, cache, slots, inputs.last, proposal, windows, inputs.sampling)
    trusted = policy.trusted(windows)  # SPRINTER: drafts kept unchecked
    if inputs.draws is None:
        accepted, next_token = verify_greedy(proposal.tokens, scored.argmax, windows, trusted)
    else:
        accepted, next_token = verify(proposal.tokens, proposal.probs, scored.probs, windows,
                                      inputs.draws[:, k_prime:2 * k_prime], next_uniforms=inputs.draws[:, -1],
                                      trusted=trusted)
    stats.count_target(time.perf_counter() - started, int(windows.sum()) + batch)
    cache.truncate_many(slots, before + 1 + accepted)
    return accepted, next_token


def measure_acceptance(models: SpecModels, inputs: StepInputs, proposal: Proposal, stats: RunStats) -> Tensor:
    """Untimed target pass over all K' drafts: the true acceptance a[i,j] (B, K'), then roll the cache back."""
    started = time.perf_counter()
    cache, slots = models.target_cache, inputs.slots
    before = cache.lengths[slots].clone()
    full = torch.full((len(slots),), proposal.tokens.shape[1], dtype=torch.int64)
    scored = score(models.target, cache, slots, inputs.last, proposal, full, inputs.sampling)
    cache.truncate_many(slots, before)
    if inputs.draws is None:
        probs = greedy_acceptance_probs(proposal.tokens, scored.argmax)
    else:
        probs = acceptance_probs(proposal.tokens, proposal.probs, scored.probs)
    stats.measure_s += time.perf_counter() - started
    return probs
