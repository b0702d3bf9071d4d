"""The draft's float type: `auto` picks bfloat16 only where the CPU computes it natively."""

from __future__ import annotations

import pytest
import torch

from batchspec.errors import BatchspecError
from batchspec.runtime import precision
from batchspec.spec.step_time import _profile_key
from batchspec.weights.loading import load_model


def test_draft_dtype_auto_follows_native_bfloat16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert precision.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert precision.resolve_dtype("auto") == torch.float32
    # On a CUDA GPU auto is bfloat16 whatever the host CPU computes (a pure rule: no GPU needed to test it).
    assert precision.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert precision.resolve_precision("auto", "cuda:1") == "bfloat16"
    assert precision.resolve_precision("auto") == "float32" and precision.resolve_precision("int4", "cuda") == "int4"
    assert precision.resolve_dtype("bfloat16") == torch.bfloat16
    assert precision.dtype_name(precision.resolve_dtype("float32")) == "float32"
    with pytest.raises(BatchspecError, match="unknown draft dtype 'fp8'"):
        precision.resolve_dtype("fp8")


def test_step_time_profile_key_names_the_draft_dtype(tiny_model_factory):
    # dsd's cached T(B, k) must not be reused across draft dtypes: their step times differ.
    target = load_model(tiny_model_factory(name="target", seed=0)).transformer
    path = tiny_model_factory(name="draft", seed=1, hidden_size=32, intermediate_size=64)
    fp32, bf16 = (load_model(path, dtype=d).transformer for d in (torch.float32, torch.bfloat16))
    assert _profile_key(target, fp32, 4, 4) != _profile_key(target, bf16, 4, 4)
    restricted = load_model(path).transformer
    restricted.restrict_head(torch.arange(0, restricted.config.vocab_size, 2))
    assert _profile_key(target, fp32, 4, 4) != _profile_key(target, restricted, 4, 4)  # a head vocabulary: cheaper
