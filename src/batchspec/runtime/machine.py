"""The machine a measurement ran on, and what the process used of it."""

from __future__ import annotations

import platform

import torch

from batchspec.runtime.precision import cpuinfo_field


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
