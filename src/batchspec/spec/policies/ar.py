"""`ar`: the target alone, one token per request per step (the reference every lossless policy must reproduce)."""

from __future__ import annotations

from batchspec.spec.policies.base import Plan, Policy, StepTime


class ArPolicy(Policy):
    name = "ar"
    speculative = False
    description = "target only"

    @classmethod
    def validate(cls, spec, batch_size: int) -> None:
        """Nothing to check: ar reads none of the speculation settings."""

    def max_draft_length(self) -> int:
        return 0

    def plan(self, batch_size: int, step_time: StepTime | None = None, requests=None, catch_up=None,
             remaining=None) -> Plan:
        return Plan(k=0, k_prime=0, capacity=0)
