"""The native runtime reproduces transformers' logits (fp32 rounding: max |diff| <= 1e-4, or 1e-5 of the largest
logit), also on ragged batches, with either library under its float32 linear layers (`batchspec.runtime.linear`)."""

from __future__ import annotations

import pytest
import torch

from batchspec.runtime.linear import BACKENDS
from batchspec.runtime.onednn import onednn_available
from batchspec.weights.loading import load_transformer

pytestmark = pytest.mark.slow  # real models end to end: left out of `pytest -m "not slow"`

LINEAR_BACKENDS = [b for b in BACKENDS if b != "onednn" or onednn_available()]


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 rounding only (logits or final hidden states): max |actual - expected| <= max(1e-4, 1e-5 max|expected|).

    The two implementations sum in different orders (the runtime computes linears as (W @ x^T)^T), and rounding
    scales with the activations, not with each logit, so the bound is relative to the largest one. How far the
    30-layer target's logits (up to ~31) drift depends on the CPU's kernels: under 1e-4 on the AVX2 EPYC, 1.1e-4
    on the AVX-512 Xeon this project has run on (~60 ulps of the largest logit after 30 layers). A real conversion
    error (a wrong scale, an un-permuted q/k) moves logits by 1e-2 or more.
    """
    bound = max(1e-4, 1e-5 * float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= bound


def hf_logits(model_dir, ids: list[int], **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def check_ragged(model, ids_a: list[int], ids_b: list[int], ref_a: torch.Tensor, ref_b: torch.Tensor) -> None:
    """Prefill two requests, roll both back, then append different numbers of tokens in one ragged forward."""
    cache = model.new_cache(num_slots=3, max_len=128)
    slot_pad, slot_a, slot_b = cache.allocate(), cache.allocate(), cache.allocate()
    # slot_pad makes the batch's slots non-contiguous (a, b = 1, 2 after releasing 0), exercising the gather path.
    out = model.forward(cache, torch.tensor([slot_a, slot_b]), torch.tensor([len(ids_a), len(ids_b)]),
                        torch.tensor(ids_a + ids_b))
    assert_fp32_close(out.logits[:len(ids_a)], ref_a)
    assert_fp32_close(out.logits[len(ids_a):], ref_b)
    cache.release(slot_pad)
    keep_a, keep_b = len(ids_a) - 5, len(ids_b) - 2
    cache.truncate(slot_a, keep_a)
    cache.truncate(slot_b, keep_b)
    # b appends nothing in one step (it sits out), then a ragged step of 5 and 2 tokens, and a batch order swap.
    out = model.forward(cache, torch.tensor([slot_b, slot_a]), torch.tensor([0, 2]), torch.tensor(ids_a[keep_a:keep_a + 2]))
    assert_fp32_close(out.logits, ref_a[keep_a:keep_a + 2])
    out = model.forward(cache, torch.tensor([slot_b, slot_a]), torch.tensor([2, 3]),
                        torch.tensor(ids_b[keep_b:] + ids_a[keep_a + 2:]))
    assert_fp32_close(out.logits[:2], ref_b[keep_b:])
    assert_fp32_close(out.logits[2:], ref_a[keep_a + 2:])
    assert cache.lengths[slot_a] == len(ids_a) and cache.lengths[slot_b] == len(ids_b)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_default_model_matches_transformers(default_model, default_model_dir, backend):
    tok = default_model.tokenizer
    ids_a = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    ids_b = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    ref_a, ref_b = hf_logits(default_model_dir, ids_a), hf_logits(default_model_dir, ids_b)
    model = default_model.transformer
    chosen, model.linear_backend = model.linear_backend, backend
    try:
        check_ragged(model, ids_a, ids_b, ref_a, ref_b)
    finally:
        model.linear_backend = chosen


def test_gguf_dequantisation_matches_transformers_gguf_loader(default_model, default_model_dir):
    """transformers dequantises the GGUF file by itself: this checks our conversion (incl. the q/k un-permute)."""
    from batchspec.weights.known_models import default_target_path

    gguf_path = default_target_path()
    ids = default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    ref = hf_logits(gguf_path.parent, ids, gguf_file=gguf_path.name)
    cache = default_model.transformer.new_cache(1, 64)
    slot = cache.allocate()
    out = default_model.transformer.forward(cache, torch.tensor([slot]), torch.tensor([len(ids)]), torch.tensor(ids))
    assert_fp32_close(out.logits, ref)


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen2", {}),  # q/k/v bias, untied LM head
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
               "rope_theta": 500000.0}),
    ("llama", {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
])
@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_tiny_random_models_match_transformers(tiny_model_factory, model_type, overrides, backend):
    model_dir = tiny_model_factory(model_type, **overrides)
    model = load_transformer(model_dir)
    model.linear_backend = backend
    gen = torch.Generator().manual_seed(1)
    ids_a = torch.randint(0, 49152, (23,), generator=gen).tolist()
    ids_b = torch.randint(0, 49152, (17,), generator=gen).tolist()
    check_ragged(model, ids_a, ids_b, hf_logits(model_dir, ids_a), hf_logits(model_dir, ids_b))


def test_hidden_states_are_the_final_normed_states(tiny_model_factory):
    """The SPRINTER verifier reads `hidden`; it must be what the LM head sees (transformers' last hidden state)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen2")
    ids = list(range(100, 120))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    model = load_transformer(model_dir)
    cache = model.new_cache(1, 64)
    out = model.forward(cache, torch.tensor([cache.allocate()]), torch.tensor([len(ids)]), torch.tensor(ids),
                        all_logits=False)
    assert out.logits is None
    assert_fp32_close(out.hidden, ref)
