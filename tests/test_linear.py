"""The linear-layer backend: the choice per CPU and per override, and every path computing F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.linear import BACKENDS, ENV_VAR, PackedWeights, choose_backend, default_backend, linear, onednn_available


def test_auto_takes_onednn_on_amd_only_where_the_build_has_it():
    assert choose_backend("auto", "AuthenticAMD", onednn=True) == "onednn"
    assert choose_backend("auto", "AuthenticAMD", onednn=False) == "mkl"
    assert choose_backend("auto", "GenuineIntel", onednn=True) == "mkl"
    assert choose_backend("auto", "", onednn=True) == "mkl"  # no /proc/cpuinfo: PyTorch's default
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


def test_a_model_packs_every_matrix_up_front(tiny_model_factory):
    from batchspec.loading import load_transformer

    model = load_transformer(tiny_model_factory())
    model.linear_backend = "mkl"
    model.pack_weights()
    assert len(model.packed_weights) == 0  # nothing to pack for MKL
    model.linear_backend = "onednn"
    model.pack_weights()
    assert len(model.packed_weights) == 4 * model.config.num_layers + 1  # qkv, o, gate/up, down; the head
    cache = model.new_cache(1, 16)
    model.forward(cache, torch.tensor([cache.allocate()]), torch.tensor([3]), torch.tensor([5, 6, 7]))
    assert len(model.packed_weights) == 4 * model.config.num_layers + 1  # the forward made no new copies
