"""Run counters and the metrics of DESIGN.md section 6, computed from them (pure arithmetic, no timing here).

The engine's steps and the simulator's write the same counters the same way: model time and calls as each model runs,
a step's outcome with `RunStats.record_step`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepOutcome:
    """What one decoding or speculative step did, per request (B of them)."""

    emitted: int  # tokens appended to outputs (accepted + 1 per request, less what finishing requests dropped)
    windows: list[int] | None = None  # drafts verified, l; None for a plain decoding step
    accepted: list[int] | None = None  # drafts accepted
    expected: tuple[float, float] | None = None  # E[A] of the policy's and the oracle's windows, when a was measured


@dataclass
class RunStats:
    """Counters of one `Engine.generate` call. Times in seconds; the measurement pass of the oracle is untimed."""

    wall_s: float = 0.0
    target_s: float = 0.0  # target forward passes (prefill + decode/verify)
    draft_s: float = 0.0  # draft forward passes (prefill + proposals) and draft sampling
    select_s: float = 0.0  # the selection policy
    measure_s: float = 0.0  # untimed oracle measurement passes (excluded from wall_s)
    target_calls: int = 0
    target_tokens: int = 0  # every position the target ran on, prompts included
    draft_tokens: int = 0  # tokens the draft proposed
    emitted_tokens: int = 0  # tokens appended to outputs (after prefill and each step)
    steps: int = 0  # decode / speculative steps (not prefill)
    request_steps: int = 0  # sum over steps of the active batch size
    verified: int = 0  # drafts sent to verification, sum of l
    accepted: int = 0  # drafts accepted
    step_emitted: int = 0  # tokens emitted by decode/speculative steps (accepted + 1 per request-step)
    position_reached: list[int] = field(default_factory=list)  # per draft position: verified with all before accepted
    position_accepted: list[int] = field(default_factory=list)
    policy_expected: float = 0.0  # sum over steps of E[A](l_policy), true a (when measured)
    oracle_expected: float = 0.0  # sum over steps of E[A](l_oracle)
    window_history: list[list[int]] = field(default_factory=list)  # l per step (the "Tetris shape")

    def count_target(self, seconds: float, tokens: int) -> None:
        """One target forward over `tokens` positions."""
        self.target_s += seconds
        self.target_calls += 1
        self.target_tokens += tokens

    def record_step(self, batch_size: int, outcome: StepOutcome, keep_windows: bool = True) -> None:
        """Count one step over `batch_size` requests (`keep_windows`: also keep its windows in `window_history`)."""
        self.steps += 1
        self.request_steps += batch_size
        self.step_emitted += outcome.emitted
        if outcome.windows is None:
            return
        self.verified += sum(outcome.windows)
        self.accepted += sum(outcome.accepted)
        self.record_positions(outcome.windows, outcome.accepted)
        if keep_windows:
            self.window_history.append(outcome.windows)
        if outcome.expected is not None:
            self.policy_expected += outcome.expected[0]
            self.oracle_expected += outcome.expected[1]

    def record_positions(self, windows: list[int], accepted: list[int]) -> None:
        """Per-position acceptance: position j (1-based) is reached if j <= l and the j-1 drafts before it passed."""
        longest = max(windows, default=0)
        while len(self.position_reached) < longest:
            self.position_reached.append(0)
            self.position_accepted.append(0)
        for window, n in zip(windows, accepted):
            for j in range(min(window, n + 1)):
                self.position_reached[j] += 1
            for j in range(n):
                self.position_accepted[j] += 1


def summarize(stats: RunStats, latencies: list[float], ttfts: list[float]) -> dict:
    """The DESIGN.md section 6 fields (plus the time split) for one run."""
    tokens = stats.emitted_tokens
    positions = stats.verified + stats.request_steps
    out = {
        "tokens_per_s": tokens / stats.wall_s if stats.wall_s else 0.0,
        "ter_tokens_per_s": tokens / stats.target_s if stats.target_s else 0.0,
        "vsr": stats.accepted / stats.verified if stats.verified else None,
        "mean_accept_len": stats.step_emitted / stats.request_steps if stats.request_steps else None,
        "system_efficiency": stats.step_emitted / positions if positions else None,
        "target_calls": stats.target_calls,
        "target_tokens": stats.target_tokens,
        "draft_tokens": stats.draft_tokens,
        "emitted_tokens": tokens,
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "latency_p50_s": _quantile(latencies, 0.50),
        "latency_p99_s": _quantile(latencies, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "select_us_per_step": 1e6 * stats.select_s / stats.steps if stats.steps else 0.0,
        "oracle_fraction": stats.policy_expected / stats.oracle_expected if stats.oracle_expected else None,
        "per_position_accept": [a / r if r else None for a, r in zip(stats.position_accepted, stats.position_reached)],
        "steps": stats.steps,
        "wall_s": stats.wall_s,
        "target_s": stats.target_s,
        "draft_s": stats.draft_s,
        "select_s": stats.select_s,
        "other_s": max(0.0, stats.wall_s - stats.target_s - stats.draft_s - stats.select_s),
    }
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)  # linear interpolation between closest ranks
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
