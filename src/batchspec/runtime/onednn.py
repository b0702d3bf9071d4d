"""oneDNN's linear kernel on CPUs: where it runs at speed (by the instruction sets the CPU reports), its packed
weight layout, and the row counts per call for which its bfloat16 results are each row's own (batch invariance).

`linear.py` chooses between it and MKL; `quantized.py`'s int4 drafts keep oneDNN copies for calls of many rows.
"""

from __future__ import annotations

import torch

from batchspec.runtime.precision import cpu_flags

ONEDNN_BF16_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))
ONEDNN_CHUNK_ROWS = 32  # oneDNN's packed bfloat16 kernel: most rows per call whose results are each row's own


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


def onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) float32 or bfloat16 matrix in oneDNN's blocked layout for linear layers (`PackedWeights.ROWS_HINT`
    rows chosen for)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PackedWeights.ROWS_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (N, in) @ weight^T (+ bias): float32 or bfloat16, the weight plain or in `onednn_layout`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def in_row_chunks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """x (N, in) bfloat16 @ a oneDNN-packed weight^T in calls of 2..`chunk` rows: a single row goes in padded to two
    (oneDNN multiplies one row with another kernel, gemv, whose sums round differently)."""
    rows = x.shape[0]
    if rows == 1:
        return onednn_linear(torch.cat([x, x.new_zeros(1, x.shape[1])]), weight, bias)[:1]
    if rows <= chunk:
        return onednn_linear(x, weight, bias)
    bounds = list(range(0, rows, chunk)) + [rows]
    if rows - bounds[-2] == 1:
        bounds[-2] -= 1  # the last call takes two rows, not one
    return torch.cat([onednn_linear(x[a:b], weight, bias) for a, b in zip(bounds, bounds[1:])])


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
        full = onednn_linear(x, weight, bias)
        same = all(torch.equal(in_row_chunks(x[start:start + rows], weight, bias, ONEDNN_CHUNK_ROWS),
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
