"""What a decoding policy answers for itself: how much to draft, which drafts the target verifies, what it learns.

A step of the engine (and of the simulator) asks its policy, in order:
1. `plan(batch_size, step_time, requests, catch_up, remaining)` -> `Plan`: sd's window k, how many tokens K' the
   draft proposes per request (0: a plain decoding step, the draft does not run; goodput Tetris: at most K', each
   its own length) and the verification capacity C; `requests` names the request in each row (an id that stays
   with it from step to step), for policies that learn per request; `catch_up`, the tokens each row's draft cache
   lacks beyond the one every draft pass runs (a whole prompt before its first draft), and `remaining`, the tokens
   each may still emit, for policies that weigh the draft's catch-up (goodput Tetris);
2. `draft_scorer()`: a SPRINTER verifier to score every draft while drafting (and to stop a request's drafting), or
   None; `drafting_rule(plan, batch_size)`: which requests draft on after each draft pass (Tetris stops a request
   once none of its later drafts could be verified), or None;
3. `select(plan, proposal, accept_probs)` -> windows `l` of shape (B,), int64, each in [0, K'], sum(l) <= C: the
   target scores l[i] + 1 positions of request i (drafts plus bonus/correction). Only draft-side information may
   choose `l` in a real run (so verification stays lossless whatever it picks); the oracle's true acceptance
   probabilities exist for measurement only;
4. `trusted(windows)`: drafts kept without the target's check (SPRINTER), or None;
5. `observe(proposal, windows, accepted)`: the outcome of the verification, for policies that learn (dsd's
   acceptance EMA, Tetris's calibrated acceptance).

A new policy is one module defining a `Policy` subclass plus one line in `policies/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from torch import Tensor

from batchspec.errors import BatchspecError

if TYPE_CHECKING:
    from batchspec.spec.config import SpecConfig
    from batchspec.spec.proposal import KeepDrafting, Proposal
    from batchspec.spec.verifier import DraftScorer, Verifier

TETRIS_SCORES = ("q", "calibrated", "verifier")  # what Tetris may rank drafts by
StepTime = Callable[[int, int], float]  # T(B, k): seconds of one speculative step (dsd's goodput model)


@dataclass(frozen=True)
class Plan:
    """One step's drafting and verification budget."""

    k: int  # sd's window (dsd: the k it chose this step)
    k_prime: int  # K': tokens the draft proposes per request; 0 = a plain decoding step
    capacity: int  # C: most drafts the target verifies (a policy choosing its own C: the reference k * B)
    step_time: StepTime | None = field(default=None, compare=False)  # this step's cost model, when the policy uses one
    lengths: np.ndarray | None = field(default=None, compare=False)  # (B,) drafts per request, each <= K' (None: K')
    requests: tuple | None = field(default=None, compare=False)  # an id per row, when the policy asked for them

    def drafts(self, batch_size: int) -> np.ndarray:
        """(B,) int64 drafts each request is planned: its own length, or K' for every one."""
        return np.full(batch_size, self.k_prime, dtype=np.int64) if self.lengths is None else self.lengths

    def clamped(self, room: int, batch_size: int) -> Plan:
        """The plan with K' cut to `room` (never write past a cache; only near its end can this bind)."""
        k_prime = max(0, min(self.k_prime, room))
        lengths = None if self.lengths is None else np.minimum(self.lengths, k_prime)
        return Plan(self.k, k_prime, min(self.capacity, batch_size * k_prime), self.step_time, lengths, self.requests)


class Policy:
    """A decoding policy: subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True  # reproduces the target's greedy output / its distribution when sampling
    speculative: ClassVar[bool] = True  # runs a draft model (False: ar)
    needs_acceptance: ClassVar[bool] = False  # `select` reads the true acceptance a[i, j] (oracle: measurement only)
    needs_step_time: ClassVar[bool] = False  # `plan` reads the step-time model T(B, k) (dsd)
    needs_row_times: bool = False  # ... and the target's time by rows scored (Tetris choosing its capacity)
    sorts: ClassVar[bool] = False  # selection sorts the whole batch's scores (a cost the simulator charges)
    description: ClassVar[str] = ""

    def __init__(self, spec: SpecConfig, verifier: Verifier | None = None) -> None:
        self.spec = spec
        self.verifier = verifier

    @classmethod
    def validate(cls, spec: SpecConfig, batch_size: int) -> None:
        """Raise a one-line BatchspecError if this policy cannot run `spec` on `batch_size` requests."""
        check_windows(spec.k, spec.extra, spec.capacity_for(batch_size), batch_size)
        if spec.tetris_scores not in TETRIS_SCORES:
            raise BatchspecError(f"tetris scores must be one of {', '.join(TETRIS_SCORES)}, got {spec.tetris_scores!r}")

    def max_draft_length(self) -> int:
        """Most draft tokens one step may write past a request's committed length (cache head-room). k + extra for
        every window policy, so policies compared side by side run on the same caches."""
        return self.spec.k + self.spec.extra

    def draft_length(self, k: int, batch_size: int) -> int:
        """K' for this step, given sd's window k."""
        return k

    def plan(self, batch_size: int, step_time: StepTime | None = None, requests: Sequence | None = None,
             catch_up: Sequence[int] | None = None, remaining: Sequence[int] | None = None) -> Plan:
        k = self.spec.k
        k_prime = self.draft_length(k, batch_size)
        return Plan(k, k_prime, min(self.spec.capacity_for(batch_size), batch_size * k_prime))

    def draft_scorer(self) -> DraftScorer | None:
        return None

    def drafting_rule(self, plan: Plan, batch_size: int) -> KeepDrafting | None:
        """Which requests draft on after each draft pass (None: all of them, K' tokens)."""
        return None

    def select(self, plan: Plan, proposal: Proposal, accept_probs: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def trusted(self, windows: Tensor) -> Tensor | None:
        """(B,) drafts per request accepted without the target's check; None: the target checks every one."""
        return None

    def observe(self, proposal: Proposal, windows: list[int], accepted: list[int]) -> None:
        """Learn from one verification's outcome (per request: drafts verified, drafts accepted)."""


def check_windows(k: int, extra: int, capacity: int, batch_size: int) -> None:
    """Raise BatchspecError with a one-line message if (k, extra, capacity) cannot be run on `batch_size` requests."""
    if k < 1:
        raise BatchspecError(f"k must be >= 1 (got {k})")
    if extra < 0:
        raise BatchspecError(f"extra must be >= 0 (got {extra})")
    if batch_size < 1:
        raise BatchspecError(f"batch size must be >= 1 (got {batch_size})")
    if capacity < 0:
        raise BatchspecError(f"capacity must be >= 0 or auto (got {capacity})")
    most = (k + extra) * batch_size
    if capacity > most:
        raise BatchspecError(
            f"capacity {capacity} exceeds the drafted tokens (k + extra) * B = ({k} + {extra}) * {batch_size} = {most}"
        )


def sd_windows(batch_size: int, k: int, k_prime: int, device: torch.device | str | None = None) -> Tensor:
    """Standard SD: every request verifies min(k, K') drafts. Returns (B,) int64."""
    return torch.full((batch_size,), min(k, k_prime), dtype=torch.int64, device=device)
