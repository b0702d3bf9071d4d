"""The runtime's linear layers on CPU: which library multiplies (MKL or oneDNN) and in which operand order.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.runtime.precision import cpu_flags, cpuinfo_field

BACKENDS: tuple[str, ...] = ("mkl", "onednn")  # CPU backends; a model on a CUDA GPU runs on cuBLAS ("cuda")
ENV_VAR = "BATCHSPEC_LINEAR_BACKEND"
ONEDNN_BF16_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))


def onednn_available() -> bool:
    """Whether this PyTorch build can run a float32 linear layer through oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16_available() -> bool:
    """Whether oneDNN can lay out bfloat16 weights on this CPU (its reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT;
    on an AVX2-only CPU it raises)."""
    flags = cpu_flags()
    return onednn_available() and any(needed <= flags for needed in ONEDNN_BF16_FLAGS)


ONEDNN_INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # int8 dot products in hardware


def onednn_int8_available() -> bool:
    """Whether oneDNN can multiply int8 matrices here at speed (`Int8Dynamic`): its int8 linear op exists in this
    build and the CPU has VNNI or AMX int8 dot products."""
    return onednn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise") \
        and bool(ONEDNN_INT8_FLAGS & cpu_flags())


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


# Matrices are quantized this many rows at a time (rows are independent in both layouts), so quantizing the 1.5B
# target's 151936-row LM head does not make several float32 temporaries of all of it (~2 GiB at once). A multiple
# of 64: torch's CPU int4 layout interleaves rows in blocks of 64 on AVX-512 (measured: chunks of 16, 32 or 48 rows
# pack differently from the whole matrix, chunks of 64 or 128 bit for bit the same).
QUANTIZE_ROWS = 8192


@dataclass(frozen=True)
class Int8Weight:
    """A matrix in weight-only int8: symmetric per-output-channel scales, activations stay bfloat16.

    There is no activation quantization, so a row's result never depends on the other rows of its batch (a
    per-tensor activation scale would make a request's output depend on its neighbours and break greedy equality
    with `ar`). Multiplied by `torch._weight_int8pack_mm`: measured here (AVX512 Zen 5, 2 threads, one 8960 x 1536
    matrix) 0.85 ms at one row vs 1.79 for packed bfloat16, 1.45 vs 1.72 at four, 6.2 vs 1.9 at sixteen — a gain
    only for a handful of rows.
    """

    values: torch.Tensor  # (out, in) int8
    scales: torch.Tensor  # (out,) bfloat16: weight ~ values * scales[:, None]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        parts = [cls._quantize_rows(rows) for rows in weight.split(QUANTIZE_ROWS)]
        return cls(torch.cat([values for values, _ in parts]), torch.cat([scales for _, scales in parts]))

    @staticmethod
    def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.float()
        # The scales are rounded to bfloat16 (what the kernel reads) before the values are: each value is then the
        # nearest multiple of the scale actually used, within half a step.
        scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)  # (out,)
        values = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return values.contiguous(), scales

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.float()[:, None]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def numel(self) -> int:
        return self.values.numel()


@dataclass(frozen=True)
class Int8Dynamic:
    """A matrix in int8 (symmetric, one scale per output channel) multiplied by oneDNN's int8 kernel, the
    activations quantized to int8 on every call with one scale for the whole call: an int4 draft's copy for calls of
    many rows (`Int4Weight.wide`).

    The activation scale depends on every row of the call, so a row's result depends on its neighbours: fit for a
    draft only, which proposes and whose rounding never reaches an output (a target must stay batch-invariant,
    `Int8Weight`). Measured here (Xeon with AMX-INT8, 2 threads; the 0.5B draft's 24 layers of matrices, ms per pass):
    32 at 6 or 8 rows, 34 at 16, 52 at 64 and 123 at 256, against 42 / 43 / 50 / 62 / 107 for the bfloat16 copy it
    replaced, with half its bytes. Quantized from the draft's own weights (that copy held their int4 rounding), its
    proposals were accepted more often on the Qwen pair (`sd`, batch 8, HumanEval: VSR 0.982 against 0.968).
    """

    packed: torch.Tensor  # oneDNN's int8 layout of the (out, in) values
    scales: torch.Tensor  # (out,) float32: weight ~ values * scales[:, None]
    zeros: torch.Tensor  # (out,) int64 zeros: the kernel's weight zero points (symmetric)
    shape: torch.Size  # (out, in)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Dynamic:
        parts = [Int8Weight._quantize_rows(rows) for rows in weight.split(QUANTIZE_ROWS)]
        values = torch.cat([values for values, _ in parts])
        scales = torch.cat([scales for _, scales in parts]).float()
        packed = torch.ops.onednn.qlinear_prepack(values, None)
        return cls(packed, scales, torch.zeros(weight.shape[0], dtype=torch.int64), torch.Size(weight.shape))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) bfloat16 -> (N, out) bfloat16.

        The quantization is five small ops in place on one float32 copy (no clamp: |x| * 127 / amax rounds to at most
        127): at 8 rows of a draft it costs ~20 us of a call's ~45-300 us, where a clamped version of the same
        arithmetic took ~40 (3 ms of an 8-row pass of the 0.5B draft)."""
        values = x.float()
        scale = max(float(values.abs().max()), 1e-12) / 127
        quantized = values.mul_(1 / scale).round_().to(torch.int8)
        return torch.ops.onednn.qlinear_pointwise(quantized, scale, 0, self.packed, self.scales, self.zeros,
                                                  None, 1.0, 0, torch.bfloat16, "none", [], "")


def onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) float32 or bfloat16 matrix in oneDNN's blocked layout for linear layers (`PackedWeights.ROWS_HINT`
    rows chosen for)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PackedWeights.ROWS_HINT)


@dataclass(frozen=True)
class Float32Wide:
    """An int4 draft's float32 copy of a matrix for calls of many rows, on oneDNN's packed layout: where the CPU has
    no int8 dot products for `Int8Dynamic` (AVX2). Measured on an AMD EPYC (AVX2, 2 threads; the 0.5B draft's whole
    forward): the int4 kernel 118 ms at 8 rows, 172 at 16 and 1,648 at a 150-token prefill, float32 133 / 135 / 792.
    Four times int4's bytes (the 0.5B draft: ~2 GiB), for a prefill twice as fast."""

    packed: torch.Tensor  # oneDNN's float32 layout of the (out, in) values
    shape: torch.Size

    ROWS = 12  # from this many rows on (between the two measured crossovers above)

    @classmethod
    def of(cls, weight: torch.Tensor) -> Float32Wide:
        return cls(onednn_layout(weight.float()), torch.Size(weight.shape))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) bfloat16 -> (N, out) bfloat16."""
        return _onednn(x.float(), self.packed, None).to(x.dtype)


@dataclass(frozen=True)
class Int4Weight:
    """A matrix in weight-only int4 with bfloat16 activations: asymmetric, one (scale, zero) per group of `GROUP`
    input columns, multiplied by `torch._weight_int4pack_mm_for_cpu`. A draft's option (`--draft-dtype int4`): the
    draft only proposes, so its rounding never reaches an output, and at one row it streams a quarter of
    bfloat16's bytes. Measured here (Xeon, AMX, 2 threads; the 0.5B draft's 24 layers of matrices): 12.2 ms per
    pass at one row vs 35 ms for bfloat16's gemv, 20.8 vs 34.7 at four rows, 71 vs 34 at sixteen, so it pays for a
    few rows only; a draft loaded in int4 keeps an int8 copy for calls of more rows (`wide`, `Int8Dynamic`). The
    Qwen drafts ship as Q4_K (4-bit values with a scale and offset per 32 columns), which this layout holds nearly
    exactly.

    w ~ (q - 8) * scale + zero for q in [0, 15], per group (torch's int4 convention).
    """

    # The int4 kernel's cost grows with every row; the int8 copy's stays near one pass over its weights up to ~64
    # rows. The 0.5B draft's whole forward (decoding, 256 tokens of context, ms, one run): the int4 kernel 34 / 38 /
    # 40 / 46 / 70 at 1 / 2 / 3 / 4 / 5 rows (the bfloat16 copy it had from 6 rows: 72-80 up to 16); int8 for every
    # matrix at every row count 43 / 51 / 55 / 53 / 56, 57-67 from 6 to 16. With this threshold (and the head's):
    # 25 / 29 / 33 / 36 / 44 at 1-5 rows, 44.5 at 8, 54 at 16 (another run). From this many rows on a call goes to
    # the int8 copy.
    WIDE_ROWS = 5
    # An LM head's products change over sooner: the draft's 151936 x 896 head (ms, int4 / int8) 4.6 / 4.6 at one
    # row, 5.6 / 6.8 at two, 7.0 / 5.4 at three, 7.6 / 5.2 at four, 16.1 / 5.3 at five.
    HEAD_WIDE_ROWS = 3

    packed: torch.Tensor  # (out, in / 2) uint8, two 4-bit values per byte, as torch's CPU kernel wants them
    scales_zeros: torch.Tensor  # (in / GROUP, out, 2) bfloat16
    shape: torch.Size  # (out, in)
    wide: Int8Dynamic | Float32Wide | None = None  # a copy for oneDNN: calls of `wide_rows` rows or more
    wide_rows: int = WIDE_ROWS  # or HEAD_WIDE_ROWS for an LM head; Float32Wide.ROWS for a float32 copy

    GROUP = 32

    @classmethod
    def quantize(cls, weight: torch.Tensor, wide: str | None = None, wide_rows: int = WIDE_ROWS) -> Int4Weight:
        """wide: also keep the matrix in `int8` (`Int8Dynamic`, half of bfloat16's bytes) for calls of `wide_rows`
        or more rows, or in `float32` (`Float32Wide`, from its own row count) where int8 is slow, so one model runs
        fast at every row count."""
        in_features = weight.shape[1]
        if in_features % cls.GROUP:
            raise BatchspecError(f"int4 weights need input sizes divisible by {cls.GROUP}, got {in_features}")
        parts = [cls._quantize_rows(rows) for rows in weight.split(QUANTIZE_ROWS)]
        packed = torch.cat([packed for packed, _ in parts])
        scales_zeros = torch.cat([scales_zeros for _, scales_zeros in parts], dim=1)
        if wide not in (None, "int8", "float32"):
            raise BatchspecError(f"unknown copy {wide!r} for an int4 matrix's wide calls; use int8 or float32")
        copy = None if wide is None else Int8Dynamic.quantize(weight) if wide == "int8" else Float32Wide.of(weight)
        return cls(packed, scales_zeros, torch.Size(weight.shape), copy,
                   Float32Wide.ROWS if wide == "float32" else wide_rows)

    @classmethod
    def _quantize_rows(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Some rows -> their packed values (rows, in / 2) and scales and zeros (in / GROUP, rows, 2). Rows are
        independent here and in the packed layout."""
        out_features, in_features = weight.shape
        groups = weight.float().reshape(out_features, in_features // cls.GROUP, cls.GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16).float()  # rounded as the kernel reads it
        values = torch.round((groups - low) / scale).clamp(0, 15)
        zero = (low + 8 * scale).to(torch.bfloat16)  # q = 8 maps to `zero`
        packed = torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32).reshape(weight.shape), 2)
        scales_zeros = torch.stack([scale.to(torch.bfloat16)[..., 0].t(), zero[..., 0].t()], dim=-1)
        return packed, scales_zeros

    def dequantize(self) -> torch.Tensor:
        identity = torch.eye(self.shape[1], dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(identity, self.packed, self.GROUP, self.scales_zeros).t().float()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


QuantizedWeight = Int8Weight | Int4Weight


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
ONEDNN_CHUNK_ROWS = 32  # oneDNN's packed bfloat16 kernel: most rows per call whose results are each row's own


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


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def _in_row_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """x (N, in) bfloat16 @ a oneDNN-packed weight^T in calls of 2..`chunk` rows: a single row goes in padded to two
    (oneDNN multiplies one row with another kernel, gemv, whose sums round differently)."""
    rows = x.shape[0]
    if rows == 1:
        return _onednn(torch.cat([x, x.new_zeros(1, x.shape[1])]), weight, bias)[:1]
    if rows <= chunk:
        return _onednn(x, weight, bias)
    bounds = list(range(0, rows, chunk)) + [rows]
    if rows - bounds[-2] == 1:
        bounds[-2] -= 1  # the last call takes two rows, not one
    return torch.cat([_onednn(x[a:b], weight, bias) for a, b in zip(bounds, bounds[1:])])


_probed_chunks: dict[tuple[int, int, bool], int] = {}


def invariant_chunk_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The most rows (`ONEDNN_CHUNK_ROWS`, else 0: use padded fixed blocks) that oneDNN's packed bfloat16 kernel
    may take per call with every row's result equal, bit for bit, to that row's result alone.

    Why not fixed 16-row blocks here: on an AMX Xeon (2 threads) a 16-row bfloat16 product is compute-bound at a
    third of the kernel's speed at 64 rows (17920 x 1536: 1.35 ms per 16-row block, 2.02 ms for 64 rows in one
    call), so a 17..32-row verification paid two full blocks (the 1.5B target: 16 rows 173 ms, 17 rows 349 ms per
    forward). Measured with oneDNN on packed weights, every one of the Qwen pair's matrix shapes gives each row
    exactly its result in any other call of 2..32 rows (not beyond: from 33 rows on the kernel splits the reduction
    another way; and a single row runs as a gemv, so it goes in padded to two). That is a property of the kernels
    oneDNN dispatches for a shape on this CPU, so it is checked once per shape on random rows (calls of 1, 2, 3,
    15, 16, 17 and 31 rows at several offsets against one of 32) before it is relied on; a shape that fails keeps
    the padded 16-row blocks.
    """
    key = (weight.shape[0], weight.shape[1], bias is not None)
    if key not in _probed_chunks:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(ONEDNN_CHUNK_ROWS, weight.shape[1], generator=generator).to(torch.bfloat16)
        full = _onednn(x, weight, bias)
        same = all(torch.equal(_in_row_chunks(x[start:start + rows], weight, bias, ONEDNN_CHUNK_ROWS),
                               full[start:start + rows])
                   for rows in (1, 2, 3, 15, 16, 17, 31)
                   for start in {0, ONEDNN_CHUNK_ROWS - rows, (ONEDNN_CHUNK_ROWS - rows) // 2})
        _probed_chunks[key] = ONEDNN_CHUNK_ROWS if same else 0
    return _probed_chunks[key]


class PackedWeights:
    """oneDNN's blocked copies of weight matrices (float32 or bfloat16), each made on its first use and kept.

    Keyed by the weight tensor itself (identity): a matrix replaced by a new tensor gets a new copy; one changed
    in place does not (the runtime never does that; call `clear`).
    """

    ROWS_HINT = 16  # the row count oneDNN chooses the layout for; every row count runs on it
    # float32 one-row products run 7-17 % slower on oneDNN's packed weights than as MKL's gemv on the plain ones
    # (`linear`'s docstring); a model whose float32 matrices fit in this many bytes keeps them plain too, for one-row
    # calls (the default SmolLM2 target: 0.42 GiB; a 1.5B float32 target, 5.2 GiB, does not).
    GEMV_COPY_BYTES = 1 << 30

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plain: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(packed) -> (packed, its plain values)

    def keep_plain(self, packed: torch.Tensor, plain: torch.Tensor) -> None:
        """Remember `plain`, the values of the packed matrix `packed`, for one-row float32 calls (`plain_of`)."""
        self._plain[id(packed)] = (packed, plain)

    def plain_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The plain values kept for a packed matrix (`keep_plain`), else None."""
        entry = self._plain.get(id(weight))
        return entry[1] if entry is not None and entry[0] is weight else None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._by_id.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = (weight, onednn_layout(weight))
            self._by_id[id(weight)] = entry
        return entry[1]

    def discard(self, weight: torch.Tensor) -> None:
        """Forget `weight`'s copy (a matrix the model no longer uses)."""
        entry = self._by_id.get(id(weight))
        if entry is not None and entry[0] is weight:
            del self._by_id[id(weight)]

    def clear(self) -> None:
        self._by_id.clear()
        self._plain.clear()

    def __len__(self) -> int:
        return len(self._by_id)


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
            return _onednn(x, w, bias)
        chunk = invariant_chunk_rows(w, bias)
        if chunk:
            return _in_row_chunks(x, w, bias, chunk)
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
