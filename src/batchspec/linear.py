"""The runtime's linear layers on CPU: which library multiplies (MKL or oneDNN) and in which operand order.

PyTorch hands a float32 `F.linear` to MKL's sgemm. On AMD CPUs MKL runs a generic code path; oneDNN picks its
kernels from the instruction sets the CPU reports, whoever made it. Measured on an AMD EPYC (Zen 5, AVX-512,
2 threads; 30 layers' 3072 x 576 gate/up matrices, ms per pass over all 30):

    rows          1      16      80       LM head 49152 x 576 at 80 rows
    MKL        14.5    22.7    68.5       43.3
    oneDNN      7.1    14.4    41.6       15.8     (weights as stored)

oneDNN runs faster still on weights reordered once into its own blocked layout (`PackedWeights`) instead of on
every call: 1.2-1.7x again in interleaved runs (16 rows 16.3 vs 25.4 ms, 80 rows 34.3 vs 44.3 on a busy host),
whatever the row count the layout was made for. The packed copies cost memory (as much as the matrices; the
originals stay for everything else that reads weights). A bfloat16 model (a draft) runs on packed weights too:
PyTorch already sends bfloat16 matmuls to oneDNN but reorders the weights on every call; packed, the shipped
draft's six layers and head ran 2-3x faster (16 rows 5.9 -> 3.0 ms, one row 5.7 -> 2.0 ms).

On Intel CPUs MKL is at least as fast (measured on a Xeon with AVX-512, through PyTorch's mkldnn tensors: oneDNN
no faster at 16 rows, 1.7x slower at 80), so `auto` keeps MKL there, and PyTorch's own bfloat16 matmul. The choice
changes rounding only (sums run in another order): the default target's logits stay within 1.2e-4 of
transformers' either way (`tests/test_model_vs_hf.py` checks both).

`BATCHSPEC_LINEAR_BACKEND=auto|mkl|onednn` overrides the choice for a process; `Transformer.linear_backend` for one
model.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.precision import cpuinfo_field

BACKENDS: tuple[str, ...] = ("mkl", "onednn")
ENV_VAR = "BATCHSPEC_LINEAR_BACKEND"


def onednn_available() -> bool:
    """Whether this PyTorch build can run a float32 linear layer through oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def choose_backend(choice: str, vendor: str, onednn: bool) -> str:
    """`auto` -> oneDNN on non-Intel x86 CPUs where the build has it, else MKL; a named backend as named.

    vendor: /proc/cpuinfo's vendor_id ('AuthenticAMD', 'GenuineIntel', '' where unknown).
    """
    if choice == "auto":
        return "onednn" if onednn and vendor == "AuthenticAMD" else "mkl"
    if choice not in BACKENDS:
        raise BatchspecError(f"unknown linear backend {choice!r} ({ENV_VAR}); use auto, {', '.join(BACKENDS)}")
    if choice == "onednn" and not onednn:
        raise BatchspecError(f"{ENV_VAR}=onednn, but this PyTorch build has no oneDNN (mkldnn) linear layer")
    return choice


def default_backend() -> str:
    """The backend for this process: `BATCHSPEC_LINEAR_BACKEND` (default auto), resolved for this CPU."""
    return choose_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto",
                          cpuinfo_field("vendor_id"), onednn_available())


class PackedWeights:
    """oneDNN's blocked copies of weight matrices (float32 or bfloat16), each made on its first use and kept.

    Keyed by the weight tensor itself (identity): a matrix replaced by a new tensor gets a new copy; one changed
    in place does not (the runtime never does that; call `clear`).
    """

    ROWS_HINT = 16  # the row count oneDNN chooses the layout for; every row count runs on it

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._by_id.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.ROWS_HINT))
            self._by_id[id(weight)] = entry
        return entry[1]

    def discard(self, weight: torch.Tensor) -> None:
        """Forget `weight`'s copy (a matrix the model no longer uses)."""
        entry = self._by_id.get(id(weight))
        if entry is not None and entry[0] is weight:
            del self._by_id[id(weight)]

    def clear(self) -> None:
        self._by_id.clear()

    def __len__(self) -> int:
        return len(self._by_id)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "mkl",
           reference_order: bool = False, packed: PackedWeights | None = None) -> torch.Tensor:
    """x (N, in) @ weight (out, in)^T (+ bias) -> (N, out).

    float32 or bfloat16 with `backend="onednn"`: oneDNN's inner-product kernel, on `packed`'s copy of the weight
    when given. Otherwise PyTorch's matmul with the operand order chosen for CPU speed: for 2..~100 rows MKL's sgemm
    runs (weight @ x^T)^T 1.5-2x faster than F.linear's x @ weight^T (measured on an AVX2 EPYC: 16 rows 150 vs
    270 ms per forward of the default target; the transposed result is a free view); one row goes through gemv.
    `reference_order` keeps F.linear's order (transformers' rounding) for float32 under MKL.
    """
    if backend == "onednn" and x.dtype in (torch.float32, torch.bfloat16):
        w = weight if packed is None else packed.get(weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")
    if x.shape[0] == 1:
        if x.dtype == torch.bfloat16:  # bfloat16's F.linear on one row is ~1.5x slower than its gemv (measured)
            out = torch.mv(weight, x[0])[None]
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)
    if reference_order and x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    out = (weight @ x.T).T
    return out if bias is None else out + bias
