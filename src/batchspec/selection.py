"""Selection policies: which draft tokens of which requests the target verifies (DESIGN.md sections 2-3).

Every policy is a pure function from draft-side statistics to window lengths `l` of shape (B,), int64, each in
[0, K'], with sum(l) <= C. The target then scores l[i] + 1 positions of request i (drafts plus bonus/correction).
Only draft-side information may choose `l` in a real run; `oracle_windows` (true acceptance probabilities) exists
for measurement only.

This module names the policies, validates (k, extra, C) and dispatches; the rules live in one module each:
`tetris.py` (Tetris and the oracle: top-C cumulative acceptance), `dsd.py` (DSD's goodput-chosen k), and `sd`'s
constant window below.
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchspec.errors import BatchspecError
from batchspec.tetris import oracle_windows, tetris_windows

POLICIES: tuple[str, ...] = ("ar", "sd", "dsd", "tetris", "oracle", "sprinter")
LOSSLESS_POLICIES: tuple[str, ...] = ("ar", "sd", "dsd", "tetris", "oracle")  # sprinter trades fidelity for speed


# ---------------------------------------------------------------------------------------------------------------
# Validation at the edge (user-facing messages)
# ---------------------------------------------------------------------------------------------------------------


def check_policy(policy: str) -> str:
    """Return `policy` unchanged if it names a selection policy, else raise with the valid names."""
    if policy not in POLICIES:
        raise BatchspecError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    return policy


def default_capacity(k: int, batch_size: int) -> int:
    """C = k * B: the verification cost of standard SD with window k (the Tetris paper's default)."""
    return k * batch_size


def validate_spec(k: int, extra: int, capacity: int, batch_size: int) -> None:
    """Raise BatchspecError with a one-line message if (k, extra, capacity) cannot be run on `batch_size` requests."""
    if k < 1:
        raise BatchspecError(f"k must be >= 1 (got {k})")
    if extra < 0:
        raise BatchspecError(f"extra must be >= 0 (got {extra})")
    if batch_size < 1:
        raise BatchspecError(f"batch size must be >= 1 (got {batch_size})")
    if capacity < 0:
        raise BatchspecError(f"capacity must be >= 0 (got {capacity})")
    most = (k + extra) * batch_size
    if capacity > most:
        raise BatchspecError(
            f"capacity {capacity} exceeds the drafted tokens (k + extra) * B = ({k} + {extra}) * {batch_size} = {most}"
        )


def draft_length(policy: str, k: int, extra: int, batch_size: int, turn_on_batch_size: int = 0) -> int:
    """K': how many tokens the draft proposes per request this step under `policy`."""
    check_policy(policy)
    if policy == "ar":
        return 0
    if policy == "oracle" or (policy == "tetris" and batch_size >= turn_on_batch_size):
        return k + extra
    return k  # sd, dsd (k already chosen by dsd_choose_k), tetris below its turn-on batch size; sprinter: k = L


# ---------------------------------------------------------------------------------------------------------------
# Window rules
# ---------------------------------------------------------------------------------------------------------------


def sd_windows(batch_size: int, k: int, k_prime: int, device: torch.device | str | None = None) -> Tensor:
    """Standard SD: every request verifies min(k, K') drafts. Returns (B,) int64."""
    return torch.full((batch_size,), min(k, k_prime), dtype=torch.int64, device=device)


def select_windows(
    policy: str,
    *,
    draft_logprobs: Tensor,
    k: int,
    capacity: int,
    turn_on_batch_size: int = 0,
    accept_probs: Tensor | None = None,
) -> Tensor:
    """Dispatch to a policy's window rule. `draft_logprobs` is (B, K'); returns (B,) int64.

    `k` is the per-request window of sd (and of dsd, whose k the caller chose with `dsd_choose_k`). Tetris behaves
    as sd below `turn_on_batch_size` requests, where there is too little choice across requests to pay off.
    """
    check_policy(policy)
    batch_size, k_prime = draft_logprobs.shape
    device = draft_logprobs.device
    if policy == "ar":
        return torch.zeros(batch_size, dtype=torch.int64, device=device)
    if policy in ("sd", "dsd") or (policy == "tetris" and batch_size < turn_on_batch_size):
        return sd_windows(batch_size, k, k_prime, device=device)
    if policy == "tetris":
        return tetris_windows(draft_logprobs, capacity)
    if policy == "sprinter":
        raise BatchspecError("sprinter's windows are its verifier's blocks (speculative.propose), not a selection")
    if accept_probs is None:
        raise BatchspecError("the oracle policy needs the true acceptance probabilities (accept_probs)")
    return oracle_windows(accept_probs, capacity)
