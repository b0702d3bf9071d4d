"""Cost of the selection policies per step, beside the target's verification step time.

    python benchmarks/selection_overhead.py [--batch-size 64] [--k 4] [--extra 4] [--repeats 2000]

Selection runs on draft log-probs of shape (B, K'); the goals are Tetris <= 50 us and goodput Tetris (select +
observe) <= 100 us per step at B=64, K'=8 (median). auto-prune: its pruned drafting's checks between the draft passes.
The target step time is one ragged forward of the default target over B*(k+1) positions after a 128-token context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchspec import configure_threads
from batchspec.runtime.machine import machine_description
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies import make_policy
from batchspec.spec.policies.base import sd_windows
from batchspec.spec.policies.tetris import oracle_windows, tetris_windows
from batchspec.spec.proposal import Proposal
from batchspec.spec.step_time import RowTimeTable, StepCost, StepTimeModel


def median_us(fn, repeats: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def target_step_ms(batch: int, k: int, target: str) -> float:
    from batchspec import load_model

    model = load_model(target).transformer
    cache = model.new_cache(batch, 128 + k + 2)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    context = torch.full((batch,), 128, dtype=torch.int64)
    model.forward(cache, slots, context, torch.randint(0, 40000, (128 * batch,)), all_logits=False)
    times = []
    for _ in range(4):
        cache.lengths[slots] = 128
        num_new = torch.full((batch,), k + 1, dtype=torch.int64)
        started = time.perf_counter()
        model.forward(cache, slots, num_new, torch.randint(0, 40000, (batch * (k + 1),)))
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--extra", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--target", default="default")
    parser.add_argument("--skip-target", action="store_true", help="only time the selection policies")
    args = parser.parse_args()
    threads = configure_threads()
    batch, k_prime = args.batch_size, args.k + args.extra
    capacity = args.k * batch
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.rand(batch, k_prime, generator=gen).log()  # (B, K') draft log-probs
    accept = torch.rand(batch, k_prime, generator=gen)  # (B, K') true acceptance (oracle)
    # Goodput Tetris (--capacity auto): calibrated survival, the capacity with the most expected tokens per second
    # under a step-cost model, the windows, and learning from the step's outcome (select + observe, per step).
    # Its cap K' (`max_draft`) is the drafted width here: the goal's K' = 8.
    auto = make_policy(SpecConfig(policy="tetris", k=args.k, extra=args.extra, capacity="auto", max_draft=k_prime),
                       batch_size=batch)
    cost = StepCost(StepTimeModel(0.0, 0.002, 0.0001, 0.0), RowTimeTable((1, 64, 65, 1024), (0.05, 0.06, 0.08, 0.4)),
                    RowTimeTable((1, 64), (0.01, 0.02)))
    plan = auto.plan(batch, cost)
    proposal = Proposal(torch.zeros(batch, k_prime, dtype=torch.int64), None, logprobs)
    # The step's outcome as a verification would give it: its windows, drafts accepted with probability q in cascade.
    windows = auto.select(plan, proposal)
    passes = torch.rand(batch, k_prime, generator=gen) < logprobs.exp()
    accepted = torch.minimum(torch.cumprod(passes.long(), dim=1).sum(dim=1), windows)
    outcome = windows.tolist(), accepted.tolist()

    def auto_step() -> None:
        auto.select(plan, proposal)
        auto.observe(proposal, *outcome)

    # Pruned drafting's checks between draft passes (K' - 1 of them per step; part of drafting, not of selection).
    rule = auto.drafting_rule(plan, batch)
    drafting = torch.ones(batch, dtype=torch.bool)

    def auto_prune() -> None:
        for step in range(1, k_prime):
            rule(logprobs[:, :step], drafting)

    rows = {
        "sd": median_us(lambda: sd_windows(batch, args.k, k_prime), args.repeats),
        "tetris": median_us(lambda: tetris_windows(logprobs, capacity), args.repeats),
        "tetris-auto": median_us(auto_step, args.repeats),
        "auto-prune": median_us(auto_prune, args.repeats // 4),
        "oracle": median_us(lambda: oracle_windows(accept, capacity), args.repeats),
    }
    print(f"B={batch} K'={k_prime} C={capacity} threads={threads} torch={torch.__version__}")
    print(f"machine: {machine_description()}")
    print(f"{'policy':>11} {'median us/step':>15}")
    for name, us in rows.items():
        print(f"{name:>11} {us:>15.1f}")
    if not args.skip_target:
        ms = target_step_ms(batch, args.k, args.target)
        print(f"target verification step (B={batch}, {args.k + 1} positions each): {ms:.1f} ms "
              f"-> Tetris selection is {rows['tetris'] / (10 * ms):.3f} % of it")


if __name__ == "__main__":
    main()
