"""How well does goodput Tetris predict the survival of drafts it has not made yet?

Goodput Tetris re-plans a step after each draft pass (`Goodput.draft_on`): a request's survival is known from its
drafts so far and continued past them (`Goodput._continued`). This records real steps and scores that continuation:

1. `sd` with a long window (k = 7, every draft verified) runs the prompts greedily through `Engine`; every step's
   draft log q, windows and accepted counts are kept.
2. Replayed step by step, each request's survival at positions d+1..k is predicted from its first d drafts, then
   the step is learned from as goodput Tetris learns (`Goodput.survival`, `Goodput.observe`): predictions use
   earlier steps' outcomes only. Two continuations: goodput Tetris's (along the calibration's bins, from the last
   draft's bin) and the mean rate of the drafts recently seen at each position (its form before commit 5fad239).
3. Printed per d: predicted over observed survival, summed over the later positions (1.00: unbiased), and the mean
   squared error against whether each position survived.

    python benchmarks/continuation_bias.py [--pair small|qwen] [--dataset humaneval] [--num-prompts 32]
                                            [--batch-size 16]
"""

from __future__ import annotations

import argparse

import numpy as np

from batchspec.bench.run import load_dataset
from batchspec.engine.engine import Engine
from batchspec.runtime.machine import machine_description
from batchspec.runtime.sampling import SamplingParams
from batchspec.runtime.threads import configure_threads
from batchspec.spec.calibration import EDGES, bin_of
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies.goodput import Goodput
from batchspec.weights.known_models import default_draft_dir
from batchspec.weights.loading import load_model


def record_steps(engine: Engine, prompts: list[str],
                 max_tokens: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(log q (B, k), windows (B,), accepted (B,)) of every speculative step of one greedy run."""
    steps = []
    observe = engine.policy.observe

    def recording(proposal, windows, accepted):
        steps.append((proposal.logprobs.numpy().copy(), np.asarray(windows), np.asarray(accepted)))
        return observe(proposal, windows, accepted)

    engine.policy.observe = recording
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens), chat=True)
    return steps


def by_position(depth_counts: np.ndarray, rates: np.ndarray, survival: np.ndarray, drafted: int) -> np.ndarray:
    """Survival (B, d) continued to (B, k) at each later position's mean calibrated rate (counts (k, bins))."""
    position_rates = depth_counts @ rates / np.maximum(depth_counts.sum(axis=1), 1e-12)
    growth = np.cumprod(position_rates[drafted:])
    return survival[:, -1:] * growth[None, :]


def score(steps, depths: list[int], warmup: int = 5) -> dict[int, dict[str, tuple[float, float]]]:
    width = steps[0][0].shape[1]
    goodput = Goodput(max_draft=width)
    depth_counts = np.zeros((width, len(EDGES)))  # the by-position baseline's counts, decayed as it did
    sums = {(d, kind): [0.0, 0.0, 0.0, 0] for d in depths for kind in ("bins", "position")}
    for index, (logprobs, windows, accepted) in enumerate(steps):
        bins = bin_of(logprobs)
        if index >= warmup and goodput._transitions is not None:
            for d in depths:
                survival = goodput._survival(bins[:, :d])
                observed = (accepted[:, None] > np.arange(d, width)[None, :]).astype(float)
                predicted = {"bins": goodput._continued(survival, bins[:, :d])[:, d:width],
                             "position": by_position(depth_counts, goodput.calibration.rates, survival, d)}
                for kind, values in predicted.items():
                    total = sums[d, kind]
                    total[0] += values.sum()
                    total[1] += observed.sum()
                    total[2] += ((values - observed) ** 2).sum()
                    total[3] += observed.size
        goodput.survival(logprobs)
        goodput.observe(logprobs, windows, accepted)
        depth_counts *= goodput.decay
        depth_counts += (bins[:, :, None] == np.arange(len(EDGES))).sum(axis=0)
        depth_counts[:, 0] = 0.0
    return {d: {kind: (total[0] / max(total[1], 1e-12), total[2] / max(total[3], 1)) for (dd, kind), total
                in sums.items() if dd == d} for d in depths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=("small", "qwen"), default="small")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    configure_threads()
    if args.pair == "qwen":
        target = load_model("qwen2.5-coder-1.5b-instruct", dtype="auto")
        draft = load_model("qwen2.5-coder-0.5b-instruct", dtype="int4")
    else:
        target, draft = load_model("default"), load_model(default_draft_dir())
    engine = Engine(target, draft, SpecConfig(policy="sd", k=args.k, extra=0), max_batch_size=args.batch_size,
                    seed=0)
    steps = record_steps(engine, load_dataset(args.dataset, args.num_prompts), args.max_tokens)
    print(f"{args.pair} pair, {args.dataset}, {args.num_prompts} prompts, batch {args.batch_size}, sd k={args.k}: "
          f"{len(steps)} steps; {machine_description()}")
    print(f"{'from d drafts':>13} {'bins: pred/obs':>15} {'mse':>7} {'by position: pred/obs':>22} {'mse':>7}")
    for d, kinds in score(steps, [1, 2, 3]).items():
        print(f"{d:>13} {kinds['bins'][0]:>15.3f} {kinds['bins'][1]:>7.4f} {kinds['position'][0]:>22.3f} "
              f"{kinds['position'][1]:>7.4f}")


if __name__ == "__main__":
    main()
