"""A draft's restricted head vocabulary: choice, storage (HF directory and GGUF), exact logits, lossless decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec import Engine, SamplingParams
from batchspec.distill.gguf_export import write_draft_gguf
from batchspec.errors import BatchspecError
from batchspec.runtime.model import Transformer
from batchspec.spec.config import SpecConfig
from batchspec.weights.head_vocab import (HEAD_VOCAB_FILE, choose_head_vocab, count_target_tokens, read_head_vocab,
                                          write_head_vocab)
from batchspec.weights.known_models import KNOWN_MODELS, default_target_path, shipped_head_vocab_dir
from batchspec.weights.loading import LoadedModel, load_model

pytestmark = pytest.mark.slow  # real models end to end: left out of `pytest -m "not slow"`

PROMPTS = ["Write a Python function that reverses a string.", "What is a binary search? Answer briefly.",
           "Write a Python function that returns the n-th Fibonacci number."]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.data())
def test_choose_head_vocab_takes_the_most_frequent(counts, data):
    counts = torch.tensor(counts)
    vocab = counts.numel()
    size = data.draw(st.integers(1, vocab))
    always = data.draw(st.lists(st.integers(0, vocab - 1), max_size=size, unique=True))
    ids = choose_head_vocab(counts, size, always)
    assert ids.numel() == size and bool((ids[1:] > ids[:-1]).all())  # sorted, no repeats
    assert set(always) <= set(ids.tolist())
    chosen = torch.zeros(vocab, dtype=torch.bool)
    chosen[ids] = True
    free = [t for t in range(vocab) if t not in always]
    # Every left-out token ranks below every chosen one that was not forced in: (count desc, id asc).
    rank = {t: (-int(counts[t]), t) for t in free}
    picked, left = [rank[t] for t in free if chosen[t]], [rank[t] for t in free if not chosen[t]]
    assert not picked or not left or max(picked) < min(left)


def test_choose_head_vocab_refuses_bad_sizes():
    with pytest.raises(BatchspecError, match="size must be in"):
        choose_head_vocab(torch.ones(10), 0)
    with pytest.raises(BatchspecError, match="cannot force 3 token ids"):
        choose_head_vocab(torch.ones(10), 2, [1, 2, 3])


def test_count_target_tokens():
    sample = {"top_ids": torch.tensor([[3, 1], [3, 2]]), "response": torch.tensor([4, 3])}
    assert count_target_tokens([sample], 6).tolist() == [0, 0, 0, 3, 1, 0]


def test_restricted_head_logits_are_exact_on_the_head_and_minus_inf_elsewhere(default_model):
    model = Transformer(default_model.config, default_model.transformer.embed, default_model.transformer.layers,
                        default_model.transformer.final_norm, default_model.transformer.lm_head)
    ids = default_model.tokenizer.encode("def add(a, b):\n    return a + b")
    outputs = []
    head = torch.arange(0, 49152, 7)
    for restrict in (None, head):
        model.restrict_head(restrict)
        cache = model.new_cache(1, len(ids) + 1)
        outputs.append(model.forward(cache, torch.tensor([0]), torch.tensor([len(ids)]), torch.tensor(ids)))
    full, restricted = outputs
    assert restricted.head_logits.shape == (len(ids), head.numel())
    assert torch.equal(restricted.logits[:, head], full.logits[:, head])
    outside = torch.ones(49152, dtype=torch.bool)
    outside[head] = False
    assert bool(torch.isneginf(restricted.logits[:, outside]).all())
    assert torch.equal(head[restricted.head_logits.argmax(-1)], restricted.logits.argmax(-1))
    assert model.num_parameters() == default_model.transformer.num_parameters()  # a view of the same weights
    for bad, needle in ((torch.tensor([5, 3]), "strictly increasing"), (torch.tensor([49152]), r"in \[0, 49152\)"),
                        (torch.tensor([], dtype=torch.int64), "1..49152 token ids")):
        with pytest.raises(BatchspecError, match=needle):
            model.restrict_head(bad)


@pytest.fixture(scope="module")
def restricted_draft(default_model) -> LoadedModel:
    """A perturbed copy of the target that can propose only every third token (plus the specials)."""
    base = default_model.transformer
    noise = 0.05 * torch.randn(base.lm_head.shape, generator=torch.Generator().manual_seed(1))
    model = Transformer(base.config, base.embed, base.layers, base.final_norm, base.lm_head + noise)
    counts = torch.zeros(base.config.vocab_size)
    counts[::3] = 1
    model.restrict_head(choose_head_vocab(counts, base.config.vocab_size // 3 + 17,
                                          default_model.tokenizer.special_token_ids()))
    return LoadedModel("restricted", default_model.model_dir, model, default_model.tokenizer)


@pytest.fixture(scope="module")
def ar_outputs(default_model) -> list[list[int]]:
    engine = Engine(default_model, max_batch_size=3)
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=12), chat=True)]


@pytest.mark.parametrize("policy", ["sd", "tetris"])
def test_restricted_draft_is_lossless_greedy(default_model, restricted_draft, ar_outputs, policy):
    params, expected = SamplingParams(max_tokens=12), ar_outputs
    engine = Engine(default_model, restricted_draft, SpecConfig(policy=policy, k=3, extra=2), max_batch_size=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, params, chat=True)] == expected
    assert 0.0 < engine.metrics()["vsr"] < 1.0
    head = set(restricted_draft.transformer.head_ids.tolist())
    assert any(t not in head for ids in expected for t in ids)  # the target did emit tokens the draft cannot


def test_restricted_draft_sampling_runs_and_is_seeded(default_model, restricted_draft):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=3)
    spec = SpecConfig(policy="tetris", k=3, extra=2)
    runs = [Engine(default_model, restricted_draft, spec, max_batch_size=2).generate(PROMPTS[:2], params, chat=True)
            for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) > 0 for o in runs[0])


def test_head_vocabulary_travels_with_hf_directory_and_gguf(tmp_path, default_model_dir, default_model):
    from conftest import make_layer_skip_draft

    hf_dir = make_layer_skip_draft(default_model_dir, tmp_path / "skip2", layers=2)
    head = torch.tensor(sorted(set(range(0, 49152, 5)) | {2}))
    write_head_vocab(hf_dir, head, source="test")
    for path in (hf_dir, write_draft_gguf(hf_dir, default_target_path(), tmp_path / "draft.gguf")):
        draft = load_model(path)
        assert torch.equal(draft.transformer.head_ids, head)
        assert load_model(path, full_head=True).transformer.head_ids is None
    (hf_dir / HEAD_VOCAB_FILE).write_text('{"token_ids": [1, "two"]}')
    with pytest.raises(BatchspecError, match="malformed head vocabulary"):
        load_model(hf_dir)
    (hf_dir / HEAD_VOCAB_FILE).write_text('{"token_ids": [9, 3]}')
    with pytest.raises(BatchspecError, match="strictly increasing"):
        load_model(hf_dir)


def _context_model(default_model, head: torch.Tensor) -> Transformer:
    base = default_model.transformer
    model = Transformer(base.config, base.embed, base.layers, base.final_norm, base.lm_head)
    model.restrict_head(head)
    model.enable_context_head()
    return model


def test_context_head_adds_the_tokens_of_the_batch_sequences(default_model):
    head = torch.arange(0, 49152, 7)
    model = _context_model(default_model, head)
    full = default_model.transformer
    prompts = [default_model.tokenizer.encode_text(t) for t in ("def fibonacci(n):", "planets = ['Mercury']")]
    cache, reference = model.new_cache(2, 64), full.new_cache(2, 64)
    num_new = torch.tensor([len(p) for p in prompts])
    tokens = torch.tensor(prompts[0] + prompts[1])
    last = torch.cumsum(num_new, 0) - 1
    out = model.forward(cache, torch.tensor([0, 1]), num_new, tokens, logit_rows=last)
    expected = full.forward(reference, torch.tensor([0, 1]), num_new, tokens, logit_rows=last)
    union = torch.tensor(sorted(set(head.tolist()) | set(prompts[0]) | set(prompts[1])))
    assert torch.equal(out.head_ids, union)  # sorted: the head's order, ties and searchsorted hold
    torch.testing.assert_close(out.logits[:, union], expected.logits[:, union], rtol=0, atol=1e-4)
    outside = torch.ones(49152, dtype=torch.bool)
    outside[union] = False
    assert bool(torch.isneginf(out.logits[:, outside]).all())
    # One slot alone scores its own tokens only; a slot used again from position 0 forgets its old sequence.
    alone = model.forward(cache, torch.tensor([1]), torch.tensor([1]), torch.tensor([prompts[1][-1]]),
                          logit_rows=torch.tensor([0]))
    assert set(alone.head_ids.tolist()) == set(head.tolist()) | set(prompts[1])
    cache.release(0)
    slot = cache.allocate()
    again = model.forward(cache, torch.tensor([slot]), torch.tensor([1]), torch.tensor([0]),
                          logit_rows=torch.tensor([0]))
    assert set(again.head_ids.tolist()) == set(head.tolist()) | {0}


def test_context_head_needs_a_restricted_plain_head(default_model):
    base = default_model.transformer
    model = Transformer(base.config, base.embed, base.layers, base.final_norm, base.lm_head)
    with pytest.raises(BatchspecError, match="restrict the head first"):
        model.enable_context_head()


@pytest.mark.parametrize("policy", ["sd", "tetris"])
def test_context_head_draft_is_lossless_greedy(default_model, ar_outputs, policy):
    counts = torch.zeros(default_model.config.vocab_size)
    counts[::3] = 1
    head = choose_head_vocab(counts, default_model.config.vocab_size // 3 + 17,
                             default_model.tokenizer.special_token_ids())
    base = default_model.transformer
    noise = 0.05 * torch.randn(base.lm_head.shape, generator=torch.Generator().manual_seed(1))
    model = Transformer(base.config, base.embed, base.layers, base.final_norm, base.lm_head + noise)
    model.restrict_head(head)
    model.enable_context_head()
    draft = LoadedModel("context", default_model.model_dir, model, default_model.tokenizer)
    engine = Engine(default_model, draft, SpecConfig(policy=policy, k=3, extra=2), max_batch_size=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=12), chat=True)] == ar_outputs
    assert 0.0 < engine.metrics()["vsr"] <= 1.0


def test_shipped_head_vocabularies_are_well_formed():
    shipped = [name for name, model in KNOWN_MODELS.items() if model.head_vocab]
    assert shipped  # the Qwen draft's
    for name in shipped:
        ids = read_head_vocab(shipped_head_vocab_dir(name))
        vocab = 151936 if name.startswith("qwen") else 49152
        assert ids is not None and ids.numel() % 16 == 0  # int4 packs the rows of a matrix in 16s
        assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < vocab
    assert shipped_head_vocab_dir("default") is None
