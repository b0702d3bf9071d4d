"""The decoding policies, one module each, and their registry: a new policy is a module plus one line here."""

from __future__ import annotations

from batchspec.errors import BatchspecError
from batchspec.spec.policies.ar import ArPolicy
from batchspec.spec.policies.base import Plan, Policy, StepTime
from batchspec.spec.policies.dsd import DsdPolicy
from batchspec.spec.policies.oracle import OraclePolicy
from batchspec.spec.policies.sd import SdPolicy
from batchspec.spec.policies.sprinter import SprinterPolicy
from batchspec.spec.policies.sprinter_exact import SprinterExactPolicy
from batchspec.spec.policies.tetris import TetrisPolicy

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (ArPolicy, SdPolicy, DsdPolicy, TetrisPolicy, OraclePolicy, SprinterPolicy,
                              SprinterExactPolicy)
}
POLICIES: tuple[str, ...] = tuple(REGISTRY)
LOSSLESS_POLICIES: tuple[str, ...] = tuple(name for name, cls in REGISTRY.items() if cls.lossless)


def policy_class(name: str) -> type[Policy]:
    """The policy named `name`, or a one-line error listing the valid names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise BatchspecError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}") from None


def make_policy(spec, verifier=None, batch_size: int = 1) -> Policy:
    """The policy object of `spec.policy`, its settings checked for `batch_size` requests."""
    cls = policy_class(spec.policy)
    cls.validate(spec, batch_size)
    return cls(spec, verifier)


__all__ = ["LOSSLESS_POLICIES", "POLICIES", "REGISTRY", "Plan", "Policy", "StepTime", "make_policy", "policy_class"]
