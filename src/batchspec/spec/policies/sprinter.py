"""`sprinter`: a learned verifier on the draft's hidden state decides which drafts need the target (approximate).

Each request drafts until the verifier scores a draft below tau (or L = `block_cap` drafts); the drafts before that
one are kept unchecked, and the target verifies only the block's last draft (the one the verifier doubted). Fewer
target calls for a bounded loss of fidelity: not lossless.
"""

from __future__ import annotations

from torch import Tensor

from batchspec.errors import BatchspecError
from batchspec.spec.policies.base import Plan, Policy, StepTime
from batchspec.spec.verifier import DraftScorer


class SprinterPolicy(Policy):
    name = "sprinter"
    lossless = False
    description = "learned verifier decides when to call the target (approximate)"

    @classmethod
    def validate(cls, spec, batch_size: int) -> None:
        if spec.verifier is None:
            raise BatchspecError("policy 'sprinter' needs a SPRINTER verifier (--verifier)")
        if spec.block_cap < 1:
            raise BatchspecError(f"--block-cap must be >= 1, got {spec.block_cap}")
        if spec.tau is not None and not 0.0 <= spec.tau <= 1.0:
            raise BatchspecError(f"--tau must be in [0, 1], got {spec.tau}")

    def max_draft_length(self) -> int:
        return self.spec.block_cap

    def plan(self, batch_size: int, step_time: StepTime | None = None, requests=None, catch_up=None,
             remaining=None) -> Plan:
        cap = self.spec.block_cap
        return Plan(cap, cap, min(self.spec.capacity_for(batch_size), batch_size * cap))

    def draft_scorer(self) -> DraftScorer:
        tau = self.spec.tau if self.spec.tau is not None else self.verifier.threshold
        return DraftScorer(self.verifier, stop_below=tau)

    def select(self, plan: Plan, proposal, accept_probs: Tensor | None = None) -> Tensor:
        return proposal.drafted  # each block ends at its first rejected draft (or at L)

    def trusted(self, windows: Tensor) -> Tensor:
        return (windows - 1).clamp(min=0)  # the target tests only each block's last draft
