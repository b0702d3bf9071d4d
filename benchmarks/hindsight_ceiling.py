"""What the best per-step choices could reach on a recorded greedy run, with every draft's outcome known in hindsight.

Input: a trace recorded at temperature 0 with deep drafts, e.g. `batchspec bench ... --policies sd -k 6 --extra 0
--record-trace run.safetensors` (the true acceptance of all K' drafts of every step). At each recorded step every
request's accepted run r_i is known; a plan gives request i a window w_i <= r_i (w_i + 1 tokens) and costs the draft
passes (pass j over the requests with w_i >= j), the target over B + sum(w) rows and its padded attention rows, all
from this machine's profiled tables (`spec.step_time.step_cost`, the ones goodput Tetris reads). Printed:

- one k for the whole run (sd at its best k), and the best single k of each step (a DSD that knew the outcomes);
- the best windows of each step, per request (a Tetris that knew the outcomes), exhaustive over w_i <= r_i;
- both again when a step maximises tokens - lambda * seconds with lambda the run's own rate (Dinkelbach's iteration)
  instead of its own tokens per second: over many steps, throughput is a ratio of sums, and a step's own rate is the
  wrong price of its time (an easy step should spend more, a hard one less).

The steps are the recorded run's, so each figure is an estimate for plans that would have led through other steps;
ratios between them are what the script is for.

    python benchmarks/hindsight_ceiling.py run.safetensors
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from batchspec.engine.trace import load_trace
from batchspec.spec.policies.goodput import pass_times
from batchspec.spec.step_time import step_cost
from batchspec.weights.loading import load_model


def accepted_runs(accept: np.ndarray) -> np.ndarray:
    """(B, K') 0/1 outcomes -> (B,) accepted prefix lengths."""
    accepted = accept > 0.5
    return np.where(accepted.all(axis=1), accepted.shape[1], accepted.argmin(axis=1))


def plan_seconds(windows: np.ndarray, passes: np.ndarray, target: np.ndarray, pad_s: float) -> np.ndarray:
    """(N, B) window plans -> (N,) seconds: the draft passes, the target over B + C rows, its padded query rows
    (`goodput.drafting_time` and `goodput.padded_rows` for many plans at once: a step has thousands)."""
    batch, depth = windows.shape[1], int(windows.max(initial=0))
    rows_per_pass = np.stack([(windows >= j).sum(axis=1) for j in range(1, depth + 1)], axis=1) if depth else \
        np.zeros((len(windows), 0), dtype=np.int64)
    verified = windows.sum(axis=1)
    padded = batch * (windows.max(axis=1) + 1) - (batch + verified)
    return passes[rows_per_pass].sum(axis=1) + target[verified] + pad_s * padded


def per_request_plans(runs: np.ndarray) -> np.ndarray:
    """Every plan w_i <= r_i up to the order of requests with equal runs (which price alike): (N, B)."""
    groups = [list(itertools.combinations_with_replacement(range(int(r) + 1), int((runs == r).sum())))
              for r in np.unique(runs)]
    order = np.concatenate([np.where(runs == r)[0] for r in np.unique(runs)])
    plans = np.array([sum(parts, ()) for parts in itertools.product(*groups)], dtype=np.int64)
    out = np.empty_like(plans)
    out[:, order] = plans
    return out


def pooled(options: list[tuple[np.ndarray, np.ndarray]], price: float | None) -> float:
    """Tokens per second over the steps when each takes its best option: the most tokens per second of its own
    (price None) or the most tokens - price * seconds."""
    tokens = seconds = 0.0
    for tok, sec in options:
        best = int(np.argmax(tok / sec if price is None else tok - price * sec))
        tokens, seconds = tokens + tok[best], seconds + sec[best]
    return tokens / seconds


def dinkelbach(options: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """The best tokens per second over the steps (a ratio of sums): iterate price <- pooled(price) to its fixed point."""
    price = pooled(options, None)
    for _ in range(100):
        new = pooled(options, price)
        if new <= price * (1 + 1e-12):
            return max(new, price)
        price = new
    return price


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    if not trace.greedy:
        raise SystemExit("hindsight_ceiling: a greedy trace is needed (temperature 0: every outcome is 0 or 1)")
    meta, width = trace.meta, trace.max_width
    batch = int(meta["batch_size"])
    target = load_model(meta["target"], dtype=meta["target_dtype"]).transformer
    draft = load_model(meta["draft"], dtype=meta["draft_dtype"]).transformer
    draft.batch_invariant = False  # as the engine runs a draft
    cost = step_cost(target, draft, batch, width, max_draft=width)
    passes = pass_times(cost, batch)
    uniform, per_request, fixed = [], [], {k: [0.0, 0.0] for k in range(width + 1)}
    for step in np.unique(trace.step):
        rows = np.where(trace.step == step)[0]
        runs = accepted_runs(trace.accept[rows])
        size = len(rows)
        target_s = np.asarray(cost.target_s(np.arange(size, size * (width + 1) + 1)), dtype=np.float64)
        ks = np.repeat(np.arange(width + 1)[:, None], size, axis=1)  # (K' + 1, B): one k for all
        tokens = (np.minimum(ks, runs) + 1).sum(axis=1).astype(np.float64)
        seconds = plan_seconds(ks, passes[:size + 1], target_s, cost.pad_s)
        uniform.append((tokens, seconds))
        for k in fixed:
            fixed[k][0] += tokens[k]
            fixed[k][1] += seconds[k]
        plans = per_request_plans(runs)
        per_request.append(((plans + 1).sum(axis=1).astype(np.float64),
                            plan_seconds(plans, passes[:size + 1], target_s, cost.pad_s)))
    fixed_rates = {k: t / s for k, (t, s) in fixed.items()}
    best_k = max(fixed_rates, key=fixed_rates.get)
    print(f"{args.trace}: {len(uniform)} steps, batch {batch}, K' {width}")
    print("one k for the run (tokens/s): " + ", ".join(f"k={k} {r:.2f}" for k, r in fixed_rates.items()))
    base = fixed_rates[best_k]
    for name, options in (("one k per step", uniform), ("windows per request", per_request)):
        own, priced = pooled(options, None), dinkelbach(options)
        print(f"{name:>20}: each step's own best rate {own:.2f} tokens/s ({own / base:.3f} of k={best_k}), "
              f"priced at the run's rate {priced:.2f} ({priced / base:.3f})")


if __name__ == "__main__":
    main()
