"""Sampling: temperature/top-k/top-p filtering against a plain reference, and inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch

from batchspec.errors import BatchspecError
from batchspec.runtime.sampling import (SamplingParams, greedy_tokens, params_tensors, sample_with_uniforms,
                                        token_probs)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, the textbook way: temperature, then top-k, then top-p on the renormalised survivors."""
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    scaled = logits / p.temperature
    order = scaled.argsort(descending=True)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if p.top_k:
        keep[order[p.top_k:]] = False
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
    if p.top_p < 1.0:
        sorted_probs = probs[order]
        before = sorted_probs.cumsum(0) - sorted_probs
        drop = before >= p.top_p
        drop[0] = False
        keep[order[drop]] = False
    return scaled.masked_fill(~keep, float("-inf")).softmax(-1)


@pytest.mark.parametrize("peak", [0.5, 4.0])  # flat (full-sort fallback) and peaked (candidate fast path) logits
def test_filtering_matches_reference(peak):
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=40),
              SamplingParams(temperature=1.0, top_k=200, top_p=0.5), SamplingParams(),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.2, top_p=0.99)]
    logits = torch.randn(len(params), vocab, generator=gen) * peak
    probs = token_probs(logits, *params_tensors(params))
    for row, p in enumerate(params):
        torch.testing.assert_close(probs[row], reference_probs(logits[row], p), atol=1e-6, rtol=1e-5)


def test_inverse_cdf_sampling_follows_the_distribution():
    gen = torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(200_000, 1)
    tokens = sample_with_uniforms(probs, torch.rand(200_000, generator=gen))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert freq[1] == 0  # zero-probability tokens are never drawn
    assert (freq - probs[0]).abs().max() < 0.005


def test_params_validation():
    for bad in [dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(stop=("",))]:
        with pytest.raises(BatchspecError):
            SamplingParams(**bad)
    assert SamplingParams(stop="###").stop == ("###",)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_take_the_first_maximum_like_argmax(dtype):
    """Ties everywhere (small integer logits), rows of every width up to a vocabulary, strided rows too."""
    generator = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 2), (3, 17), (8, 1000), (32, 151936), (5, 49152)]:
        logits = torch.randint(-4, 4, (rows, vocab), generator=generator).to(dtype)
        first = (logits == logits.amax(-1, keepdim=True)).int().argmax(-1)  # a bool argmax: the first True
        assert torch.equal(greedy_tokens(logits), first)
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
        assert torch.equal(greedy_tokens(logits[:, ::3]), logits[:, ::3].argmax(-1))
