"""Trace-driven simulator: replay recorded draft statistics under any policy, batch size, cost model and pipeline.

The batch loop mirrors `Engine.generate`: requests wait, are admitted into free slots (a prefill iteration), and every
other iteration is one speculative step over the active ones: propose K' drafts, select windows with the engine's own
policy objects (`spec/policies/`: the same `plan`, `select` and `observe`), verify (acceptance drawn from the recorded
a[i,j]), commit (`RunStats.record_step`, as the engine), retire finished requests.
Time comes from a cost model instead of a clock. Sequential pipeline: a step costs K' draft forwards + the target
forward + selection; parallel pipeline (the next step's drafting overlaps this step's verification):
max(drafting, target) + selection.

What a simulated step sees: each request replays one recorded request (the trace's own requests with `replay`, else
drawn with replacement), and at output position `pos` it sees the drafts a step starting there saw in the recorded
run (`trace.build_timelines`: exact at temperature 0, so a replay of the recorded run takes its steps token for token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from batchspec.engine.trace import Timelines, build_timelines
from batchspec.errors import BatchspecError
from batchspec.sim.cost_models import DraftRatioCostModel, draft_target_ratio
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies import REGISTRY, Policy, make_policy
from batchspec.spec.policies.tetris import expected_accepted, oracle_windows
from batchspec.spec.proposal import Proposal, replay_drafting, undrafted
from batchspec.spec.stats import RunStats, summarize
from batchspec.spec.stats import StepOutcome

# Policies a trace can replay: the lossless speculative ones (its drafts carry q and the true a, nothing else).
SIM_POLICIES = tuple(name for name, cls in REGISTRY.items() if cls.speculative and cls.lossless)
PIPELINES = ("sequential", "parallel")


@dataclass(frozen=True)
class SimConfig:
    policy: str = "tetris"
    batch_size: int = 16
    k: int = 4
    extra: int = 2
    capacity: int | str | None = None  # None: C = k x active batch, as in the engine; "auto": tetris chooses
    pipeline: str = "sequential"
    num_requests: int | None = None  # None: 16 x batch_size, drawn with replacement (the drain tail stays small)
    replay: bool = False  # the trace's own requests, in order, once (the validation setting)
    seed: int = 0
    k_max: int = 8  # dsd's largest window (clamped to the trace's K')
    max_draft: int | None = None  # goodput Tetris's K' cap (None: twice k_max, as the engine's; clamped to the trace)
    turn_on_batch_size: int = 1

    def validate(self, width: int) -> None:
        if self.policy not in SIM_POLICIES:
            raise BatchspecError(f"unknown sim policy {self.policy!r}; valid: {', '.join(SIM_POLICIES)}")
        if self.pipeline not in PIPELINES:
            raise BatchspecError(f"unknown pipeline {self.pipeline!r}; valid: {', '.join(PIPELINES)}")
        if self.k < 1 or self.extra < 0 or self.batch_size < 1:
            raise BatchspecError("need k >= 1, extra >= 0 and batch sizes >= 1")
        if isinstance(self.capacity, int) and self.capacity < 0:
            raise BatchspecError(f"capacity must be >= 0 (got {self.capacity})")
        policy = self.make_policy(width)
        wanted = policy.draft_length(self.k, self.batch_size)
        if not policy.needs_step_time and wanted > width:  # dsd chooses its k within the trace's width
            raise BatchspecError(f"the trace has {width} drafts per step; {self.policy} needs {wanted} "
                                 f"(record with a larger k + extra)")

    def make_policy(self, width: int) -> Policy:
        """The engine's policy object for these settings (dsd's and goodput Tetris's caps clamped to the trace's
        K')."""
        spec = SpecConfig(policy=self.policy, k=self.k, extra=self.extra, capacity=self.capacity,
                          turn_on_batch_size=self.turn_on_batch_size, k_max=self.k_max, max_draft=self.max_draft)
        spec = replace(spec, k_max=min(spec.k_max, width), max_draft=min(spec.draft_cap, width))
        return make_policy(spec, batch_size=self.batch_size)


def simulate(timelines: Timelines, cost, config: SimConfig) -> dict:
    """One simulated run: the DESIGN.md section 6 metrics with simulated time (plus the time split)."""
    config.validate(timelines.width)
    batch_cap = config.batch_size
    rng = np.random.default_rng([config.seed, batch_cap, 1])  # acceptance draws; same stream for every policy
    pick = np.random.default_rng([config.seed, batch_cap, 2])
    num = len(timelines.output_len) if config.replay else (config.num_requests or 16 * batch_cap)
    chosen = np.arange(num) if config.replay else pick.integers(0, len(timelines.output_len), num)
    waiting = deque(int(r) for r in chosen)
    stats, clock, prefill_s = RunStats(), 0.0, 0.0
    policy = config.make_policy(timelines.width)  # one per run: dsd's acceptance estimate starts afresh
    pos = {}  # sim request id -> output position; ids index `chosen`
    first, finish = np.zeros(num), np.zeros(num)
    active: list[int] = []
    next_id = 0
    while waiting or active:
        if waiting and len(active) < batch_cap:  # prefill iteration: admit, emit each request's first token
            admitted = [waiting.popleft() for _ in range(min(batch_cap - len(active), len(waiting)))]
            ids = list(range(next_id, next_id + len(admitted)))
            next_id += len(admitted)
            tokens = int(timelines.prompt_len[admitted].sum())
            target_s, draft_s = cost.prefill_s(tokens, len(admitted))
            clock, prefill_s = clock + target_s + draft_s, prefill_s + target_s + draft_s
            stats.count_target(target_s, tokens)
            stats.draft_s += draft_s
            stats.emitted_tokens += len(admitted)
            for i in ids:
                pos[i], first[i] = 1, clock
            active += ids
        else:
            clock += _step(timelines, cost, config, policy, active, pos, chosen, stats, rng)
        for i in [i for i in active if pos[i] >= timelines.output_len[chosen[i]]]:
            finish[i] = clock
            active.remove(i)
    stats.wall_s = clock
    out = summarize(stats, list(finish), list(first))
    decode_s = clock - prefill_s  # speculative steps only: throughput without prompt processing
    out.update(policy=config.policy, batch_size=batch_cap, pipeline=config.pipeline, num_requests=num,
               cost_model=cost.name, match_ar=None, prefill_s=prefill_s,
               decode_tokens_per_s=stats.step_emitted / decode_s if decode_s > 0 else 0.0)
    return out


def _step(timelines: Timelines, cost, config: SimConfig, policy: Policy, active: list[int], pos: dict,
          chosen: np.ndarray, stats: RunStats, rng: np.random.Generator) -> float:
    """One speculative step over `active`: advances positions and counters; returns its simulated seconds."""
    batch, width = len(active), timelines.width
    requests = chosen[active]  # (B,) trace request of each active sim request
    positions = np.array([pos[i] for i in active])  # (B,)
    context = int((timelines.prompt_len[requests] + positions).sum())
    # dsd's goodput under the simulated hardware's step time, as if profiled there.
    plan = policy.plan(batch, _SimStepCost(cost, config.pipeline, policy, batch, context), active)
    k_prime = plan.k_prime
    rows = timelines.offset[requests] + positions  # (B,)
    logprobs = torch.from_numpy(timelines.logprobs[rows, :k_prime])  # (B, K')
    accept = torch.from_numpy(timelines.accept[rows, :k_prime])  # (B, K')
    windows = np.zeros(batch, dtype=np.int64)  # (B,) K' = 0 (dsd chose plain decoding): one token per request
    passes = [batch] * k_prime  # rows of each draft pass
    if k_prime:
        rule = policy.drafting_rule(plan, batch)  # pruned drafting, replayed on the recorded drafts
        drafted = replay_drafting(rule, logprobs) if rule is not None else torch.full((batch,), k_prime)
        if plan.lengths is not None:  # as `propose(first=...)`: a request planned no drafts does not draft
            drafted[torch.from_numpy(plan.lengths == 0)] = 0
        passes = [int((drafted > j).sum()) for j in range(k_prime)]
        proposal = Proposal(tokens=torch.zeros(batch, k_prime, dtype=torch.int64), probs=None,
                            logprobs=undrafted(logprobs, drafted), drafted=drafted)
        windows = policy.select(plan, proposal, accept).numpy()
    # Verification: draft j survives with probability a[i,j], in cascade; the uniforms are drawn for the widest
    # window so that every policy sees the same random stream (common random numbers).
    passed = rng.random((batch, width))[:, :k_prime] < accept.numpy()  # (B, K')
    survived = np.cumprod(passed, axis=1)  # (B, K')
    accepted = (survived * (np.arange(k_prime)[None, :] < windows[:, None])).sum(axis=1)  # (B,)
    emitted = np.minimum(accepted + 1, timelines.output_len[requests] - positions)  # (B,) stops at the request's end
    for i, n in zip(active, emitted.tolist()):
        pos[i] += n

    verified = int(windows.sum())
    draft_s = sum(cost.draft_s(rows, context) for rows in passes if rows)
    stats.draft_s += draft_s
    stats.draft_tokens += sum(passes)
    stats.count_target(cost.target_s(batch, verified + batch, context), verified + batch)
    stats.select_s += cost.select_s(policy.sorts)
    stats.emitted_tokens += int(emitted.sum())
    expected = None
    if k_prime:
        windows_t = torch.from_numpy(np.asarray(windows, dtype=np.int64))
        oracle = oracle_windows(accept, int(windows.sum()))  # at the same number of verified drafts
        expected = (expected_accepted(accept, windows_t), expected_accepted(accept, oracle))
    outcome = StepOutcome(int(emitted.sum()), windows.tolist(), accepted.tolist(), expected)
    stats.record_step(batch, outcome, keep_windows=False)
    if k_prime:
        policy.observe(proposal, outcome.windows, outcome.accepted)
    return _step_time(cost, config.pipeline, policy, batch, draft_s, verified + batch, context)


@dataclass(frozen=True)
class _SimStepCost:
    """The simulated hardware's step time, in the parts a policy asks for (as `spec.step_time.StepCost`)."""

    cost: object
    pipeline: str
    policy: Policy
    batch: int
    context: int
    pad_s: float = 0.0  # the cost models price rows, not attention padding

    def __call__(self, batch: int, k: int) -> float:  # dsd's T(B, k)
        return _step_time(self.cost, self.pipeline, self.policy, batch, self.draft_s(batch, k), batch * (k + 1),
                          self.context)

    def draft_s(self, batch: int, k: int) -> float:
        return k * self.cost.draft_s(batch, self.context) if k else 0.0

    def target_s(self, rows):
        return np.vectorize(lambda r: self.cost.target_s(self.batch, int(r), self.context))(rows)


def _step_time(cost, pipeline: str, policy: Policy, batch: int, draft: float, target_tokens: int,
               context: int) -> float:
    """Seconds of one step: `draft` seconds of drafting, one target forward over `target_tokens` positions,
    selection."""
    target = cost.target_s(batch, target_tokens, context)
    overlap = max(draft, target) if pipeline == "parallel" else draft + target
    return overlap + cost.select_s(policy.sorts) + cost.step_overhead_s


# ---------------------------------------------------------------------------------------------------------------
# Grids, the draft-cost sweep, and the `batchspec sim` command
# ---------------------------------------------------------------------------------------------------------------

RATIOS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # draft forward / target decode forward, for the gain plot


def run_sim(trace, cost, policies: Sequence[str], batch_sizes: Sequence[int], pipelines: Sequence[str],
            base: SimConfig, sweep: bool = False) -> dict:
    """Every (pipeline, batch size, policy) run, plus optionally Tetris-vs-SD over draft/target cost ratios."""
    timelines = build_timelines(trace)
    runs = [simulate(timelines, cost, replace(base, policy=p, batch_size=b, pipeline=pl))
            for pl in pipelines for b in batch_sizes for p in policies]
    config = {"trace_meta": {k: v for k, v in trace.meta.items() if k != "run"}, "trace_batch_size":
              trace.meta.get("batch_size"), "cost_model": cost.name, "policies": list(policies),
              "batch_sizes": list(batch_sizes), "pipelines": list(pipelines), **asdict(base)}
    if hasattr(cost, "to_dict"):
        config["cost_model_params"] = cost.to_dict()
    if base.replay and trace.meta.get("bench_runs"):
        config["measured_tokens_per_s"] = {p: r["tokens_per_s"] for p, r in trace.meta["bench_runs"].items()}
    results = {"config": config, "runs": runs}
    if sweep:
        results["ratio_sweep"] = ratio_sweep(timelines, cost, max(batch_sizes), base, pipelines)
    return results


def ratio_sweep(timelines: Timelines, cost, batch_size: int, base: SimConfig, pipelines: Sequence[str],
                ratios: Sequence[float] = RATIOS) -> dict:
    """tokens_per_s of tetris over sd when one draft forward costs `ratio` x one target decode forward."""
    context = int(batch_size * (timelines.prompt_len.mean() + timelines.output_len.mean() / 2))  # a typical step
    points = []
    for pipeline in pipelines:
        for ratio in ratios:
            model = DraftRatioCostModel(cost, ratio)
            tps = {p: simulate(timelines, model, replace(base, policy=p, batch_size=batch_size, pipeline=pipeline))
                   ["tokens_per_s"] for p in ("sd", "tetris")}
            points.append({"pipeline": pipeline, "ratio": ratio, "sd_tokens_per_s": tps["sd"],
                           "tetris_tokens_per_s": tps["tetris"], "gain": tps["tetris"] / tps["sd"]})
    return {"batch_size": batch_size, "k": base.k, "extra": base.extra, "points": points,
            "native_ratio": draft_target_ratio(cost, batch_size, context)}

