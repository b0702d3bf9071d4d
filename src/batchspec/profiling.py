"""Step-time profiling for dsd: time real target and draft forwards on this machine and fit T(B, k).

Profiles are cached as JSON under `<cache>/profiles/`, keyed by both models' configurations and a fingerprint of
their weights, the grid, the torch version, thread count and CPU: a second run on the same machine reuses the fit
instead of spending ~10-30 s re-timing forwards. Delete the directory (or set BATCHSPEC_CACHE) to re-profile.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from dataclasses import asdict

import torch

from batchspec.model import Transformer
from batchspec.precision import cpuinfo_field
from batchspec.dsd import StepTimeModel


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


def machine_description() -> str:
    """The CPU a measurement ran on, e.g. 'Intel(R) Xeon(R) Processor (AVX512), 2 threads'.

    Sessions, CI and users land on different CPUs (an AVX2 EPYC and an AVX-512/AMX Xeon gave this project's
    measurements so far), and tokens/s and the dsd step-time fit depend on it, so results and profiles name it.
    `platform.processor()` is empty on Linux; /proc/cpuinfo's model name is not.
    """
    name = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads"


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _profile_key(target: Transformer, draft: Transformer, max_batch: int, k_max: int) -> str:
    def model_id(model: Transformer) -> dict:
        weights = model.embed.float()
        return {"config": model.config.as_dict(), "embed": [float(weights[:64].sum()), float(weights[-64:].sum())],
                "dtype": model.precision, "linear": model.linear_backend}

    key = {"target": model_id(target), "draft": model_id(draft), "max_batch": max_batch, "k_max": k_max,
           "torch": torch.__version__, "cpu": machine_description(),
           "machine": platform.machine(), "node": platform.node()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_step_time(target: Transformer, draft: Transformer, max_batch: int, k_max: int) -> StepTimeModel:
    """`profile_step_time`, remembered on disk for this machine and model pair."""
    from batchspec.known_models import cache_root

    path = cache_root() / "profiles" / f"step-time-{_profile_key(target, draft, max_batch, k_max)}.json"
    try:
        return StepTimeModel(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # absent or unreadable: profile again
    model = profile_step_time(target, draft, max_batch, k_max)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(asdict(model)))
        path.with_suffix(".tmp").rename(path)
    except OSError:
        pass  # a read-only cache only costs the re-profiling
    return model


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
