"""The type each model runs in: `--target-dtype float32|bfloat16|int8|auto`, `--draft-dtype` those or `int4`.

A decode step streams every weight once, so bytes per weight set the step time at small batch. Where the CPU has
native bfloat16 arithmetic (AVX512-BF16 or AMX) bfloat16 halves those bytes and runs its matrix products about twice
as fast (measured on a Zen 5 EPYC, 12 of Qwen2.5-1.5B's 1536 x 8960 MLP matrices: float32 16.8 / 25.0 / 76.7 ms at
1 / 16 / 80 rows, bfloat16 8.5 / 12.8 / 42.1). Without it bfloat16 is emulated and much slower (an AVX2-only EPYC,
2 threads, one 8960 x 1536 matrix at one row: 145 ms in bfloat16, 7.5 ms in float32), so `auto` (either model's)
picks float32 there. `int8` is weight-only int8 (`quantized.Int8Weight`) with bfloat16 everything else: faster still at
one to four rows, slower from about sixteen. `int4` (the draft only: `quantized.Int4Weight`) streams a quarter of
bfloat16's bytes, about 3x faster at one row; from five rows its calls go to an int8 copy with int8 activations
(`quantized.Int8Dynamic`), whose batch-wide activation scale only a draft may have.

The draft only proposes, so its type never touches losslessness. The target's type changes its outputs (each type
is its own model): lossless means every lossless policy reproduces `ar` run at the *same* target dtype, token for
token. The target defaults to float32, the reference the tests compare with transformers.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from batchspec.errors import BatchspecError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPES)  # float types (the draft's features, distillation's autocast)
PRECISIONS: tuple[str, ...] = (*DTYPES, "int8")  # how a model's weights may run
TARGET_PRECISION_CHOICES: tuple[str, ...] = (*PRECISIONS, "auto")  # `--target-dtype`: auto as the draft's
DRAFT_PRECISION_CHOICES: tuple[str, ...] = ("auto", *PRECISIONS, "int4")  # int4: a draft's option only
DEFAULT_TARGET_DTYPE = "float32"
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


def resolve_dtype(choice: str, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto` -> bfloat16 on a CUDA GPU (every one this runs on computes it natively) and on CPUs with native
    bfloat16, else float32; `float32` / `bfloat16` as named."""
    if choice == "auto":
        on_gpu = str(device).strip().lower().partition(":")[0] == "cuda"  # not validated here: `device.py` does
        return torch.bfloat16 if on_gpu or native_bf16() else torch.float32
    try:
        return DTYPES[choice]
    except KeyError:
        raise BatchspecError(f"unknown draft dtype {choice!r}; use one of {', '.join(DTYPE_CHOICES)}") from None


def resolve_precision(choice: str, device: torch.device | str = "cpu") -> str:
    """`auto` -> bfloat16 or float32 as `resolve_dtype` chooses for `device`; float32 / bfloat16 / int8 / int4 as
    named."""
    if choice in ("int8", "int4"):
        return choice
    if choice == "auto" or choice in DTYPES:
        return dtype_name(resolve_dtype(choice, device))
    raise BatchspecError(f"unknown dtype {choice!r}; use one of {', '.join(DRAFT_PRECISION_CHOICES)}")


def compute_dtype(precision: str) -> torch.dtype:
    """The float type of activations and KV cache for a precision (int8/int4 weights compute in bfloat16)."""
    return torch.bfloat16 if precision in ("int8", "int4") else DTYPES[precision]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`, as results.json and tables write it."""
    return str(dtype).removeprefix("torch.")
