"""The runtime's linear layers on CPU: which library multiplies (MKL or oneDNN) and in which operand order.
(oneDNN's own pieces are in `onednn.py`, the quantized weight formats in `quantized.py`.)

PyTorch hands a float32 `F.linear` to MKL's sgemm. On AMD CPUs MKL runs a generic code path; oneDNN picks its
kernels from the instruction sets the CPU reports, whoever made it. Measured on an AMD EPYC (Zen 5, AVX-512,
2 threads; 30 layers' 3072 x 576 gate/up matrices, ms per pass over all 30):

    rows          1      16      80       LM head 49152 x 576 at 80 rows
    MKL        14.5    22.7    68.5       43.3
    oneDNN      7.1    14.4    41.6       15.8     (weights as stored)

oneDNN runs faster still on weights reordered once into its own blocked layout (`PackedWeights`) instead of on
every call: 1.2-1.7x again in interleaved runs (16 rows 16.3 vs 25.4 ms, 80 rows 34.3 vs 44.3 on a busy host),
whatever the row count the layout was made for. A model's layer matrices (and an untied LM head) are replaced by
their packed form (`Transformer.pack_weights`), so they are held once; a tied head gets a packed copy beside the
embedding, which token lookups read. A bfloat16 model (a draft) runs on packed weights too:
PyTorch already sends bfloat16 matmuls to oneDNN but reorders the weights on every call; packed, the shipped
draft's six layers and head ran 2-3x faster (16 rows 5.9 -> 3.0 ms, one row 5.7 -> 2.0 ms).

On Intel CPUs too, float32 runs faster on oneDNN's packed weights from two rows up (an earlier measurement on a
Xeon through PyTorch's mkldnn tensors, not packed weights, had found it no faster at 16 rows and 1.7x slower at 80).
Measured on a Xeon with AVX-512 and AMX (2 threads), the default SmolLM2-135M target's whole forward, 256 tokens of
context, MKL -> oneDNN packed, ms:

    rows (requests x tokens)   1x1    1x2    1x5    8x1    8x5   16x1   16x5
    MKL                       31.7   68.8   69.5   75.7  107.3   84.8  148.5
    oneDNN, packed            34.0   36.2   39.3   47.5   86.8   64.7  142.1

MKL's small-row products on that CPU cost twice its one-row gemv, so a speculative verification of five rows cost
2.2 decode steps; on oneDNN it costs 1.16, for a single decoding row 7 % more. So `auto` sends float32 to oneDNN on
both vendors (MKL where the CPU is unknown: PyTorch's default), and a small float32 model keeps its matrices plain
too for one-row calls, which run as MKL's gemv (`PackedWeights.GEMV_COPY_BYTES`). bfloat16 models go to oneDNN on
packed weights everywhere: on a Xeon with AMX (2 threads) its packed kernel multiplies
16 rows by the 1.5B target's 17920 x 1536 gate/up matrix in 1.35 ms where PyTorch's bfloat16 matmul (which
reorders the weight on every call) takes 2.34, and a batch-invariant target can give it up to 32 rows per call
(`invariant_chunk_rows`): 64 rows in 2 calls instead of 4 padded 16-row blocks. The choice
changes rounding only (sums run in another order): the default target's logits stay within 1.2e-4 of
transformers' either way (`tests/test_model_vs_hf.py` checks both).

`BATCHSPEC_LINEAR_BACKEND=auto|mkl|onednn` overrides the choice for a process; `Transformer.linear_backend` for one
model.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.runtime.onednn import (PackedWeights, in_row_chunks, invariant_chunk_rows, onednn_available,
                                      onednn_bf16_available, onednn_linear)
from batchspec.runtime.precision import cpuinfo_field
from batchspec.runtime.quantized import Int4Weight, Int8Weight, QuantizedWeight

BACKENDS: tuple[str, ...] = ("mkl", "onednn")  # CPU backends; a model on a CUDA GPU runs on cuBLAS ("cuda")
ENV_VAR = "BATCHSPEC_LINEAR_BACKEND"


def choose_backend(choice: str, vendor: str, onednn: bool, bfloat16: bool = False, bf16_layout: bool = True) -> str:
    """`auto` -> oneDNN where the build has it for bfloat16 models (where the CPU can lay their weights out:
    `bf16_layout`) and for float32 on AMD and Intel CPUs, else MKL; a named backend as named.

    vendor: /proc/cpuinfo's vendor_id ('AuthenticAMD', 'GenuineIntel', '' where unknown).
    """
    if choice == "auto":
        if bfloat16:
            return "onednn" if onednn and bf16_layout else "mkl"
        return "onednn" if onednn and vendor in ("AuthenticAMD", "GenuineIntel") else "mkl"
    if choice not in BACKENDS:
        raise BatchspecError(f"unknown linear backend {choice!r} ({ENV_VAR}); use auto, {', '.join(BACKENDS)}")
    if choice == "onednn" and not onednn:
        raise BatchspecError(f"{ENV_VAR}=onednn, but this PyTorch build has no oneDNN (mkldnn) linear layer")
    if choice == "onednn" and bfloat16 and not bf16_layout:
        raise BatchspecError(f"{ENV_VAR}=onednn: oneDNN's bfloat16 layout needs AVX512BW/VL/DQ or AVX-NE-CONVERT, "
                             "which this CPU lacks; use mkl or auto")
    return choice


def default_backend(dtype: torch.dtype = torch.float32) -> str:
    """The backend for a model of `dtype` in this process: `BATCHSPEC_LINEAR_BACKEND` (default auto), resolved for
    this CPU."""
    return choose_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto",
                          cpuinfo_field("vendor_id"), onednn_available(), bfloat16=dtype == torch.bfloat16,
                          bf16_layout=onednn_bf16_available())


def dense(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """A weight as an ordinary strided tensor (oneDNN's packed layout and int8/int4 undone) for code that reads
    values."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize()
    return weight.to_dense() if weight.is_mkldnn else weight


BF16_ROWS = 16  # bfloat16 products off oneDNN's packed path run in blocks of exactly this many rows
# A batch-invariant product on CUDA runs in blocks of exactly this many rows (padded): cuBLAS chooses its kernel, and
# with it how each row's sums are split, by the call's shape. Memory-bound below ~128 bfloat16 rows on a GPU, so a
# decode step of up to 128 requests costs one block; float32 (no tensor cores without TF32) takes smaller blocks.
CUDA_BLOCK_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 128, torch.float32: 32}


def _in_fixed_row_blocks(x: torch.Tensor, block: int,
                         multiply: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`multiply` (a product x (N, in) -> (N, out)) run on blocks of exactly `block` rows, the last one padded with
    zero rows.

    Batch invariance: MKL's and oneDNN's bfloat16 kernels split the reduction differently for different row counts
    (measured here: a 576 x 1536 product's rows differ by a bfloat16 ulp between 3 and 300 rows; oneDNN's beyond 32
    rows), and cuBLAS picks its kernel by shape, so a request's logits would depend on how many rows its batch had,
    and speculative verification (B*(k+1) rows) would drift from `ar` (B rows). One call shape for every product
    makes each row's result a function of that row alone. In the memory-bound regime of decoding a 16-row block
    costs what one row does on the CPU (a 8960 x 1536 bfloat16 matrix: 1.49 ms for 16 rows, 1.51 for a gemv); a
    prefill of many rows pays one weight pass per block.
    """
    rows = x.shape[0]
    padded = x.new_zeros(rows + (-rows) % block, x.shape[1])
    padded[:rows] = x
    blocks = [multiply(padded[i:i + block]) for i in range(0, padded.shape[0], block)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:rows]


def _cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch_invariant: bool) -> torch.Tensor:
    """x (N, in) @ weight^T on a CUDA GPU: one call, or blocks of `CUDA_BLOCK_ROWS` rows when every row's result must
    be the same whatever rows share the call."""
    if not batch_invariant:
        return F.linear(x, weight, bias)
    return _in_fixed_row_blocks(x, CUDA_BLOCK_ROWS.get(x.dtype, 32), lambda part: F.linear(part, weight, bias))


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
           backend: str = "mkl", reference_order: bool = False, packed: PackedWeights | None = None,
           batch_invariant: bool = True) -> torch.Tensor:
    """x (N, in) @ weight (out, in)^T (+ bias) -> (N, out).

    On a CUDA GPU: cuBLAS, in fixed blocks of rows when `batch_invariant` (`_cuda`).
    An `Int8Weight` / `Int4Weight`: the weight-only int8 / int4 kernel (x in bfloat16). A weight already in
    oneDNN's layout (`is_mkldnn`, see `Transformer.pack_weights`): oneDNN. float32 or bfloat16 with
    `backend="onednn"`: oneDNN's inner-product kernel, on `packed`'s copy of the weight when given. bfloat16 with
    `batch_invariant` (a target): in blocks of `BF16_ROWS` rows, so that a row's result never depends on how many
    rows share the call. Otherwise PyTorch's matmul with the operand order chosen for CPU speed: for 2..~100 rows
    MKL's sgemm runs (weight @ x^T)^T 1.5-2x faster than F.linear's x @ weight^T (measured on an AVX2 EPYC: 16 rows
    150 vs 270 ms per forward of the default target; the transposed result is a free view); one row goes through
    gemv.
    `reference_order` keeps F.linear's order (transformers' rounding) for float32 under MKL.
    """
    if isinstance(weight, Int8Weight):
        out = torch._weight_int8pack_mm(x.contiguous(), weight.values, weight.scales)
        return out if bias is None else out + bias
    if isinstance(weight, Int4Weight):
        if weight.wide is not None and x.shape[0] >= weight.wide_rows:
            out = weight.wide(x)
        else:
            out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), weight.packed, Int4Weight.GROUP,
                                                    weight.scales_zeros)
        return out if bias is None else out + bias
    if x.is_cuda:
        return _cuda(x, weight, bias, batch_invariant)
    if weight.is_mkldnn and backend != "onednn":  # a model packed for oneDNN asked to run under MKL (tests do)
        weight = weight.to_dense()
    if backend == "onednn" and x.dtype == torch.float32 and x.shape[0] == 1:  # MKL's gemv where there is a plain copy
        plain = weight if not weight.is_mkldnn else packed.plain_of(weight) if packed is not None else None
        if plain is not None:
            out = torch.mv(plain, x[0])[None]
            return out if bias is None else out + bias
    if backend == "onednn" and x.dtype in (torch.float32, torch.bfloat16):
        w = weight if packed is None or weight.is_mkldnn else packed.get(weight)
        if not (batch_invariant and x.dtype == torch.bfloat16):
            return onednn_linear(x, w, bias)
        chunk = invariant_chunk_rows(w, bias)
        if chunk:
            return in_row_chunks(x, w, bias, chunk)
    if batch_invariant and x.dtype == torch.bfloat16:
        return _in_fixed_row_blocks(x, BF16_ROWS, lambda part: linear(part, weight, bias, backend, packed=packed,
                                                                      batch_invariant=False))
    if x.shape[0] == 1:
        if x.dtype == torch.bfloat16:  # bfloat16's F.linear on one row is ~1.5x slower than its gemv (measured)
            out = torch.mv(weight, x[0])[None]
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)
    if reference_order and x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    out = (weight @ x.T).T
    return out if bias is None else out + bias
