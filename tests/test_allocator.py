"""The C allocator keeps a forward's freed buffers: the next call reuses them without faulting pages in again."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from batchspec.runtime.allocator import keep_freed_memory


def _page_faults_of(work) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _forward_like() -> None:
    """Buffers of a few MiB allocated and freed in turn, as a forward's activations and logits are."""
    for _ in range(20):
        x = torch.ones(1 << 20)  # 4 MiB
        y = x * 2
        z = y + x
        del x, y, z


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")
def test_freed_buffers_are_reused_without_page_faults():
    # glibc's defaults here: ~10,000 minor faults for this loop (each 4 MiB buffer mapped afresh, 1,024 pages).
    # Kept, the loop reuses its buffers: 0 faults in a fresh process; after the rest of the suite, a heap left
    # fragmented may have to grow once more (1,024 faults, one buffer), but never per round.
    assert keep_freed_memory()
    _forward_like()  # the first round maps the memory
    assert _page_faults_of(_forward_like) <= 2 * 1024
