"""How many CPU threads torch uses."""

from __future__ import annotations

import os

import torch


def configure_threads(threads: int | None = None) -> int:
    """Use every core this process may run on (torch's default can differ inside containers)."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()
