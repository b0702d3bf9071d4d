"""The floating-point type the draft runs in (`--draft-dtype auto|float32|bfloat16`).

The draft only proposes: verification makes the output exactly the target's whatever the draft computes, so the
draft may run in bfloat16 without touching losslessness. Where the CPU has native bfloat16 arithmetic (AVX512-BF16
or AMX) that halves the bytes each draft step streams — weights and KV cache — and with them most of its time
(measured on an AMX Xeon, batch 16, context 300: 14.9 -> 10.2 ms per step). Without it bfloat16 is emulated and
slower than float32, so `auto` picks float32 there. The target always runs in float32: its outputs are the reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from batchspec.errors import BatchspecError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPES)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names of native bfloat16 arithmetic


@functools.cache
def cpuinfo_field(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ('model name', 'flags'); '' where absent or unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where /proc/cpuinfo is absent or unreadable)."""
    return frozenset(cpuinfo_field("flags").split())


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (else torch emulates it, slower than float32)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def resolve_dtype(choice: str) -> torch.dtype:
    """`auto` -> bfloat16 on CPUs with native bfloat16, else float32; `float32` / `bfloat16` as named."""
    if choice == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    try:
        return DTYPES[choice]
    except KeyError:
        raise BatchspecError(f"unknown draft dtype {choice!r}; use one of {', '.join(DTYPE_CHOICES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`, as results.json and tables write it."""
    return str(dtype).removeprefix("torch.")
