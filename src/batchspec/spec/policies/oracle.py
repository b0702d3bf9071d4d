"""`oracle`: Tetris on the true acceptance probabilities, the upper bound of any draft-side selection (measurement
only: it needs the target's output on every draft before choosing which ones the target verifies)."""

from __future__ import annotations

from torch import Tensor

from batchspec.errors import BatchspecError
from batchspec.spec.policies.base import Plan, Policy
from batchspec.spec.policies.tetris import oracle_windows


class OraclePolicy(Policy):
    name = "oracle"
    needs_acceptance = True
    sorts = True
    description = "Tetris on the true acceptance (upper bound)"

    def draft_length(self, k: int, batch_size: int) -> int:
        return k + self.spec.extra

    def select(self, plan: Plan, proposal, accept_probs: Tensor | None = None) -> Tensor:
        if accept_probs is None:
            raise BatchspecError("the oracle policy needs the true acceptance probabilities (accept_probs)")
        return oracle_windows(accept_probs, plan.capacity)
