"""Weight-only quantized matrices, and the copies an int4 draft keeps beside them for calls of many rows.

- `Int8Weight`: int8 values, one bfloat16 scale per output channel, bfloat16 activations — batch-invariant, so a
  target may run on it (`--target-dtype int8`);
- `Int4Weight`: int4 values in groups of 32 columns (a draft's `--draft-dtype int4`), with `Int8Dynamic` (int8
  activations, oneDNN, where the CPU has VNNI or AMX) or `Float32Wide` (oneDNN float32, AVX2) for wide calls.

`linear.linear` multiplies by any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchspec.errors import BatchspecError
from batchspec.runtime.onednn import onednn_layout, onednn_linear

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


@dataclass(frozen=True)
class Float32Wide:
    """An int4 draft's float32 copy of a matrix for calls of many rows, on oneDNN's packed layout: where the CPU has
    no int8 dot products for `Int8Dynamic` (AVX2). Measured on an AMD EPYC (AVX2, 2 threads; the 0.5B draft's whole
    forward): the int4 kernel 118 ms at 8 rows, 172 at 16 and 1,648 at a 150-token prefill, float32 133 / 135 / 792.
    Four times int4's bytes (the 0.5B draft: ~2 GiB), for a prefill twice as fast.

    The int4 kernel works in blocks of 4 rows, so its cost steps at 5 and 9 rows. Decode forwards of that draft by
    rows (ms, two rounds, the copy from 12 rows / from 5): 5-6 rows 118-124 / 113-128, 7-8 rows 120-127 / 136-142,
    9-11 rows 180-192 / 142-175, 12 rows 172-180 both. So the copy takes the calls of 9 rows and more."""

    packed: torch.Tensor  # oneDNN's float32 layout of the (out, in) values
    shape: torch.Size

    ROWS = 9  # from this many rows on: where the int4 kernel starts its third block of 4 rows

    @classmethod
    def of(cls, weight: torch.Tensor) -> Float32Wide:
        return cls(onednn_layout(weight.float()), torch.Size(weight.shape))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) bfloat16 -> (N, out) bfloat16."""
        return onednn_linear(x.float(), self.packed, None).to(x.dtype)


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
