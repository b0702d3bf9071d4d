"""`sd`: standard speculative decoding, every request drafts and verifies the same window k."""

from __future__ import annotations

from torch import Tensor

from batchspec.spec.policies.base import Plan, Policy, sd_windows


class SdPolicy(Policy):
    name = "sd"
    description = "fixed window k"

    def select(self, plan: Plan, proposal, accept_probs: Tensor | None = None) -> Tensor:
        batch_size, k_prime = proposal.logprobs.shape
        return sd_windows(batch_size, plan.k, k_prime, device=proposal.logprobs.device)
