"""Step-time profiling for dsd: time real target and draft forwards on this machine and fit T(B, k)."""

from __future__ import annotations

import statistics
import time

import torch

from batchspec.model import Transformer
from batchspec.selection import StepTimeModel


def _time_forward(model: Transformer, batch: int, tokens_each: int, repeats: int = 2) -> float:
    """Median seconds of one forward of `batch` requests appending `tokens_each` tokens after a 64-token context."""
    cache = model.new_cache(batch, 64 + tokens_each + 1)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    context = torch.full((batch,), 64, dtype=torch.int64)
    model.forward(cache, slots, context, torch.randint(0, model.config.vocab_size, (64 * batch,)), all_logits=False)
    times = []
    for _ in range(repeats + 1):  # the first call warms up and is dropped
        cache.lengths[slots] = 64
        num_new = torch.full((batch,), tokens_each, dtype=torch.int64)
        tokens = torch.randint(0, model.config.vocab_size, (batch * tokens_each,))
        started = time.perf_counter()
        model.forward(cache, slots, num_new, tokens)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def profile_step_time(target: Transformer, draft: Transformer, max_batch: int, k_max: int) -> StepTimeModel:
    """Samples T(B, k) = k draft steps of B tokens + one target pass over B*(k+1) tokens, on a small grid; fit."""
    batches = sorted({1, max(1, max_batch // 2), max_batch})
    windows = sorted({0, 1, max(1, k_max // 2), k_max})
    draft_time = {b: _time_forward(draft, b, 1) for b in batches}
    samples = []
    for b in batches:
        for k in windows:
            samples.append((b, k, k * draft_time[b] + _time_forward(target, b, k + 1)))
    return StepTimeModel.fit(samples)
