"""The linear-layer backend: the choice per CPU and per override, and every path computing F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
import batchspec.runtime.onednn as onednn_module
import batchspec.runtime.quantized as quantized_module
from batchspec.runtime.linear import BACKENDS, ENV_VAR, choose_backend, default_backend, linear
from batchspec.runtime.onednn import (ONEDNN_CHUNK_ROWS, PackedWeights, invariant_chunk_rows, onednn_available,
                                      onednn_bf16_available, onednn_int8_available)


def test_auto_takes_onednn_on_amd_and_intel_where_the_build_has_it():
    assert choose_backend("auto", "AuthenticAMD", onednn=True) == "onednn"
    assert choose_backend("auto", "AuthenticAMD", onednn=False) == "mkl"
    assert choose_backend("auto", "GenuineIntel", onednn=True) == "onednn"
    assert choose_backend("auto", "GenuineIntel", onednn=False) == "mkl"
    assert choose_backend("auto", "GenuineIntel", onednn=True, bfloat16=True) == "onednn"
    assert choose_backend("auto", "GenuineIntel", onednn=False, bfloat16=True) == "mkl"
    assert choose_backend("auto", "", onednn=True) == "mkl"  # no /proc/cpuinfo: PyTorch's default
    # An AVX2-only CPU: oneDNN cannot lay bfloat16 weights out there (its reorder raises).
    assert choose_backend("auto", "AuthenticAMD", onednn=True, bfloat16=True, bf16_layout=False) == "mkl"
    assert choose_backend("auto", "AuthenticAMD", onednn=True, bf16_layout=False) == "onednn"
    assert choose_backend("mkl", "AuthenticAMD", onednn=True) == "mkl"
    assert choose_backend("onednn", "GenuineIntel", onednn=True) == "onednn"


def test_bad_choices_are_named():
    with pytest.raises(BatchspecError, match="unknown linear backend 'blas'"):
        choose_backend("blas", "AuthenticAMD", onednn=True)
    with pytest.raises(BatchspecError, match="no oneDNN"):
        choose_backend("onednn", "AuthenticAMD", onednn=False)


def test_environment_overrides_the_choice(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "MKL")
    assert default_backend() == "mkl"
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(BatchspecError, match=ENV_VAR):
        default_backend()
    monkeypatch.delenv(ENV_VAR)
    assert default_backend() in BACKENDS


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "onednn" or onednn_available()])
@pytest.mark.parametrize("rows", [1, 2, 16, 80])
def test_every_path_computes_f_linear(backend, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    expected = F.linear(x.double(), weight.double(), bias.double())
    packed = PackedWeights() if backend == "onednn" else None
    for b in (None, bias):
        for reference_order in (False, True):
            for pack in (None, packed):
                out = linear(x, weight, b, backend=backend, reference_order=reference_order, packed=pack)
                assert out.shape == (rows, 96) and out.dtype == torch.float32
                want = expected if b is not None else expected - bias.double()
                assert float((out.double() - want).abs().max()) < 1e-4
    # a non-contiguous input (a column slice) and bfloat16 (always PyTorch's own matmul)
    wide = torch.randn(rows, 128, generator=gen)
    torch.testing.assert_close(linear(wide[:, ::2], weight, backend=backend), F.linear(wide[:, ::2], weight),
                               atol=1e-4, rtol=1e-5)
    if backend == "onednn" and not onednn_bf16_available():
        return  # an AVX2-only CPU: oneDNN cannot lay bfloat16 weights out, `default_backend` never picks it
    for pack in (None, packed):  # bfloat16 (a draft): packed under oneDNN too, PyTorch's matmul under MKL
        out = linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), backend=backend, packed=pack)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(x, weight, bias), atol=0.5, rtol=0.05)


def test_packed_weights_are_made_once_per_matrix():  # the pinned x86 PyTorch wheel has oneDNN
    packed = PackedWeights()
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    first = packed.get(a)
    assert packed.get(a) is first and packed.get(b) is not first and len(packed) == 2
    packed.discard(a)
    assert len(packed) == 1 and packed.get(a) is not first
    packed.clear()
    assert len(packed) == 0


def test_a_model_packs_every_matrix_up_front_and_keeps_one_copy(tiny_model_factory):
    from batchspec.runtime.linear import dense
    from batchspec.weights.loading import load_transformer

    model = load_transformer(tiny_model_factory())
    originals = [dense(getattr(layer, name)).clone() for layer in model.layers for name in layer.MATRICES]
    cache = model.new_cache(1, 16)
    tokens = torch.tensor([5, 6, 7])
    model.linear_backend = "mkl"
    model.pack_weights()
    assert len(model.packed_weights) == 0 and not model.layers[0].wqkv.is_mkldnn  # nothing to pack for MKL
    before = model.forward(cache, torch.tensor([cache.allocate()]), torch.tensor([3]), tokens).logits
    model.linear_backend = "onednn"
    model.pack_weights()
    # The layer matrices are replaced by their packed form (one copy of the weights, not two); the head, which
    # is the tied embedding here, gets a packed copy.
    assert all(getattr(layer, name).is_mkldnn for layer in model.layers for name in layer.MATRICES)
    assert len(model.packed_weights) == 1
    assert all(torch.equal(dense(getattr(layer, name)), original) for (layer, name), original in
               zip(((layer, name) for layer in model.layers for name in layer.MATRICES), originals))
    cache = model.new_cache(1, 16)
    after = model.forward(cache, torch.tensor([cache.allocate()]), torch.tensor([3]), tokens).logits
    assert len(model.packed_weights) == 1  # the forward made no new copies
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    model.linear_backend = "mkl"  # a packed model still runs under MKL (on dense copies made per call)
    cache = model.new_cache(1, 16)
    torch.testing.assert_close(model.forward(cache, torch.tensor([cache.allocate()]), torch.tensor([3]),
                                             tokens).logits, before, atol=1e-4, rtol=1e-4)


def test_packing_frees_each_layers_unpacked_matrices_before_the_next(tiny_model_factory, monkeypatch):
    """While packing, no more than one layer's unpacked matrices are alive beside the packed ones (a list of them
    kept until the end had the 1.5B target's float32 load peak at 12.8 GiB instead of 7.9)."""
    import gc
    import weakref

    from batchspec.runtime.layer_weights import LayerWeights
    from batchspec.weights.loading import load_transformer

    model = load_transformer(tiny_model_factory())
    model.linear_backend = "onednn"
    monkeypatch.setattr(PackedWeights, "GEMV_COPY_BYTES", 0)  # as for a large model: no plain copies kept
    originals = [[weakref.ref(getattr(layer, name)) for name in layer.MATRICES] for layer in model.layers]
    alive_before = []
    map_matrices = LayerWeights.map_matrices

    def counting(self, fn):
        gc.collect()
        alive_before.append(sum(ref() is not None for refs in originals for ref in refs))
        return map_matrices(self, fn)

    monkeypatch.setattr(LayerWeights, "map_matrices", counting)
    model.pack_weights()
    per_layer = len(LayerWeights.MATRICES)
    # Packing layer i: its own matrices and those of the layers after it, and none of the earlier layers'.
    assert alive_before == [per_layer * (len(originals) - i) for i in range(len(originals))]


def test_an_untied_head_is_packed_in_place_and_can_still_be_restricted(tiny_model_factory):
    from batchspec.runtime.linear import dense
    from batchspec.weights.loading import load_transformer

    model = load_transformer(tiny_model_factory("qwen2"))  # Qwen2's tiny model has its own LM head
    assert model.full_head is not model.embed
    head = model.full_head.clone()
    tokens = torch.tensor([5, 6, 7])

    def logits():
        cache = model.new_cache(1, 16)
        return model.forward(cache, torch.tensor([cache.allocate()]), torch.tensor([3]), tokens).logits

    model.linear_backend = "onednn"
    before = logits()
    model.pack_weights()
    # No copy: the head itself is packed, as the layer matrices are (and the copies the forward above made on
    # first use are dropped with the originals).
    assert model.lm_head is model.full_head and model.full_head.is_mkldnn and len(model.packed_weights) == 0
    assert torch.equal(dense(model.full_head), head)
    torch.testing.assert_close(logits(), before, atol=1e-4, rtol=1e-4)
    model.restrict_head(torch.tensor([3, 9, 40]))  # rows of the packed head
    assert torch.equal(model.lm_head, head[[3, 9, 40]])
    model.restrict_head(None)
    assert model.lm_head is model.full_head


def test_loaded_tensors_own_their_memory(tiny_model_factory):
    """Not views of the memory-mapped file: one such view would keep every page of the file that was ever read
    resident beside the model's weights."""
    from batchspec.weights.loading import read_tensors

    model_dir = tiny_model_factory("qwen2")
    tensors = dict(read_tensors(model_dir / "model.safetensors", torch.float32, torch.device("cpu")))
    assert "lm_head.weight" in tensors
    for tensor in tensors.values():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantizing_in_row_chunks_gives_the_same_weights(monkeypatch, precision):
    """Matrices are quantized QUANTIZE_ROWS rows at a time (bounded temporaries): the result must be that of the
    whole matrix at once, bit for bit."""
    from batchspec.runtime.quantized import Int4Weight, Int8Weight

    kind = {"int8": Int8Weight, "int4": Int4Weight}[precision]
    weight = 0.05 * torch.randn(176, 64, generator=torch.Generator().manual_seed(0))
    whole = kind.quantize(weight)
    monkeypatch.setattr(quantized_module, "QUANTIZE_ROWS", 64)  # 3 chunks, the last one short (int4: blocks of 64 rows)
    chunked = kind.quantize(weight)
    assert chunked.shape == whole.shape
    assert torch.equal(chunked.dequantize(), whole.dequantize())
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x, chunked), linear(x, whole))
    if precision == "int4" and onednn_int8_available():  # the int8 copy for calls of many rows, too
        monkeypatch.setattr(quantized_module, "QUANTIZE_ROWS", 8192)
        whole = kind.quantize(weight, wide="int8")
        monkeypatch.setattr(quantized_module, "QUANTIZE_ROWS", 32)
        chunked = kind.quantize(weight, wide="int8")
        assert torch.equal(chunked.wide.scales, whole.wide.scales)
        many = torch.randn(Int4Weight.WIDE_ROWS + 3, 64).bfloat16()
        assert torch.equal(linear(many, chunked), linear(many, whole))


def test_int8_weights_multiply_as_their_dequantised_values_and_rows_stay_independent():
    from batchspec.runtime.linear import dense
    from batchspec.runtime.quantized import Int8Weight

    gen = torch.Generator().manual_seed(0)
    weight, bias = 0.05 * torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen).bfloat16()
    quantized = Int8Weight.quantize(weight)
    assert quantized.values.dtype == torch.int8 and quantized.shape == weight.shape
    # Symmetric per-row rounding: every value within half a step of its row's scale.
    step = quantized.scales.float()[:, None]
    assert bool(((dense(quantized) - weight).abs() <= 0.5 * step * (1 + 1e-5)).all())
    x = torch.randn(16, 64, generator=gen).bfloat16()
    out = linear(x, quantized, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), dense(quantized), bias.float()), atol=0.05, rtol=0.02)
    # Batch invariance, bit for bit: no activation quantization, so a row's result ignores its neighbours.
    for rows in (1, 3, 5):
        assert torch.equal(linear(x[:rows], quantized, bias), out[:rows])


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN linear layer")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_available(),
                                       reason="oneDNN's bfloat16 layout needs AVX512BW/VL/DQ or AVX-NE-CONVERT")


def _rows_alone_and_together(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, packed) -> None:
    """Every row of `x` multiplied in calls of every size 1..len(x) equals that row multiplied alone, bit for bit."""
    alone = torch.cat([linear(x[i:i + 1], weight, bias, backend="onednn", packed=packed) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        for start in (0, len(x) - rows):
            together = linear(x[start:start + rows], weight, bias, backend="onednn", packed=packed)
            assert torch.equal(together, alone[start:start + rows]), (rows, start)


@needs_onednn_bf16
@pytest.mark.parametrize("shape,bias", [((96, 64), True), ((64, 256), False)])
def test_batch_invariant_bfloat16_rows_do_not_depend_on_their_neighbours(shape, bias):
    """What greedy equality with `ar` rests on: a target row's product is the same whatever else shares the call,
    on oneDNN's chunked path (calls of 2..32 rows, a single row padded to two) as on the padded-block fallback."""
    gen = torch.Generator().manual_seed(shape[1])
    weight = torch.randn(*shape, generator=gen).bfloat16()
    b = torch.randn(shape[0], generator=gen).bfloat16() if bias else None
    x = torch.randn(2 * ONEDNN_CHUNK_ROWS + 3, shape[1], generator=gen).bfloat16()
    packed = PackedWeights()
    assert invariant_chunk_rows(packed.get(weight), b) == ONEDNN_CHUNK_ROWS  # this CPU's kernels pass the check
    _rows_alone_and_together(weight, b, x, packed)
    key = (shape[0], shape[1], bias)
    try:  # a shape that failed the check keeps the padded 16-row blocks, invariant too
        onednn_module._probed_chunks[key] = 0
        _rows_alone_and_together(weight, b, x, packed)
    finally:
        del onednn_module._probed_chunks[key]


@needs_onednn_bf16
def test_chunked_calls_never_take_one_row_or_more_than_the_chunk(monkeypatch):
    calls = []
    real = onednn_module.onednn_linear
    monkeypatch.setattr(onednn_module, "onednn_linear", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    weight = torch.randn(48, 64).bfloat16()
    packed = PackedWeights()
    invariant_chunk_rows(packed.get(weight), None)
    for rows, want in ((1, [2]), (2, [2]), (32, [32]), (33, [31, 2]), (65, [32, 31, 2]), (70, [32, 32, 6])):
        calls.clear()
        out = linear(torch.randn(rows, 64).bfloat16(), weight, backend="onednn", packed=packed)
        assert out.shape == (rows, 48) and calls == want, (rows, calls)


def test_a_one_row_float32_call_runs_on_the_plain_copy_of_a_packed_matrix():
    """A packed float32 matrix with its plain values kept (`PackedWeights.keep_plain`) takes one-row calls as a gemv
    on them; more rows, and a packed matrix without a plain copy, run on oneDNN; all give F.linear's values."""
    if not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN linear layer")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PackedWeights.ROWS_HINT)
    weights = PackedWeights()
    assert weights.plain_of(packed) is None
    weights.keep_plain(packed, weight)
    assert weights.plain_of(packed) is weight
    one, many = torch.randn(1, 32, generator=generator), torch.randn(5, 32, generator=generator)
    assert torch.equal(linear(one, packed, backend="onednn", packed=weights), torch.mv(weight, one[0])[None])
    torch.testing.assert_close(linear(many, packed, backend="onednn", packed=weights), F.linear(many, weight))
    torch.testing.assert_close(linear(one, packed, backend="onednn"), F.linear(one, weight))
    weights.clear()
    assert weights.plain_of(packed) is None
