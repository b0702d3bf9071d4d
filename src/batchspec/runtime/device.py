"""Where a model runs: the CPU (every figure in README) or a CUDA GPU (`--device cuda`).

The engine's bookkeeping (KV cache lengths, windows, acceptance, sampling draws) stays on the host; a model's
forward runs on its device and hands back logits and hidden states there. The spec code takes what it needs from
them (argmax tokens, log-probabilities, the sampled rows) and brings only that to the host.

On CUDA the target stays batch-invariant the same way as on the CPU: every matrix product runs in fixed blocks of
rows (`linear.CUDA_BLOCK_ROWS`; cuBLAS picks its kernel, and with it the order of each row's sums, by shape, and
one shape per block makes a row's result its own) and attention in float64. Weight-only int8 and int4 are CPU
kernels (`torch._weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`): on CUDA models run in float32 or bfloat16.
"""

from __future__ import annotations

import torch

from batchspec.errors import BatchspecError

DEVICES: tuple[str, ...] = ("cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` as a torch device; a clear error where this PyTorch build or machine lacks it."""
    text = str(name).strip().lower()
    kind, colon, index = text.partition(":")
    if kind not in DEVICES or (colon and (kind != "cuda" or not index.isdigit())):
        raise BatchspecError(f"unknown device {str(name)!r}; use cpu, cuda or cuda:N")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BatchspecError(f"--device {text}: this PyTorch build ({torch.__version__}) sees no CUDA GPU")
    if index and int(index) >= torch.cuda.device_count():
        raise BatchspecError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(text)


def check_precision_on(device: torch.device, precision: str) -> None:
    """Refuse weight-only int8/int4 off the CPU (their kernels are CPU kernels)."""
    if device.type != "cpu" and precision in ("int8", "int4"):
        raise BatchspecError(f"{precision} weights run on the CPU only (torch's weight-only kernels); use float32 "
                             f"or bfloat16 with --device {device}")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: timings read after this are the work's own)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_description(device: torch.device) -> str:
    """The accelerator a measurement ran on ('' on the CPU), e.g. 'NVIDIA H200'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""
