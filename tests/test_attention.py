"""Attention over widely ragged batches: a request catching up a prompt beside requests appending one token attends
in a group of its own (`attention_groups`), with the same results as the batch padded as one."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from batchspec.runtime.attention import GROUP_MAX_SHARE, GROUP_MIN_APPEND, attention_groups


def padded_cost(rows: torch.Tensor, num_new: torch.Tensor, ends: torch.Tensor) -> int:
    return int(rows.numel()) * int(num_new[rows].max()) * int(ends[rows].max())


@given(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 300)), min_size=1, max_size=24))
def test_groups_partition_the_batch_and_never_cost_more(appends):
    num_new = torch.tensor([n for n, _ in appends])
    ends = torch.tensor([n + start for n, start in appends])
    groups = attention_groups(num_new, ends)
    rows = torch.cat(groups)
    assert sorted(rows.tolist()) == list(range(len(appends)))  # every request once
    assert all(bool((g[1:] > g[:-1]).all()) for g in groups)  # each group in batch order
    whole = padded_cost(torch.arange(len(appends)), num_new, ends)
    if len(groups) > 1:
        assert sum(padded_cost(g, num_new, ends) for g in groups) <= GROUP_MAX_SHARE * whole
    if int(num_new.max()) < GROUP_MIN_APPEND:
        assert len(groups) == 1  # verification windows: one padded batch, as always


def test_a_catch_up_attends_apart_from_single_tokens():
    num_new = torch.tensor([1, 150, 1, 1, 1, 1, 1, 1])
    groups = attention_groups(num_new, torch.full((8,), 256) + num_new)
    assert [g.tolist() for g in groups] == [[0, 2, 3, 4, 5, 6, 7], [1]]


def test_grouped_forward_matches_one_request_at_a_time(tiny_model_factory):
    """Requests appending 1, 40, 1 and 20 tokens in one forward (attended in groups) give the logits and cache
    entries of each request appended alone."""
    from batchspec.weights.loading import load_model

    model = load_model(tiny_model_factory(name="groups", seed=5)).transformer
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in (7, 3, 12, 5)]
    appends = [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in (1, 40, 1, 20)]
    slots = torch.arange(4)

    def prefilled():
        cache = model.new_cache(num_slots=4, max_len=64)
        for slot, prompt in zip(slots, prompts):
            model.forward(cache, slot[None], torch.tensor([len(prompt)]), prompt, all_logits=False)
        return cache

    together = prefilled()
    num_new = torch.tensor([len(a) for a in appends])
    logits = model.forward(together, slots, num_new, torch.cat(appends)).logits.split(num_new.tolist())
    alone = prefilled()
    for slot, tokens, got in zip(slots, appends, logits):
        want = model.forward(alone, slot[None], torch.tensor([len(tokens)]), tokens).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.k[0], alone.k[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(together.lengths, alone.lengths)
