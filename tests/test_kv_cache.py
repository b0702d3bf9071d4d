"""KV cache bookkeeping: slots join and leave, rollback is setting the length back, memory is bounded."""

from __future__ import annotations

import pytest
import torch

from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig
from batchspec.runtime.kv_cache import KVCache

CONFIG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=64)


def test_slots_allocate_release_and_truncate():
    cache = KVCache(CONFIG, num_slots=3, max_len=100)
    assert cache.max_len == 64  # never beyond the model's context
    assert cache.nbytes == 2 * 2 * 3 * 2 * 64 * 4 * 4  # k and v, layers, slots, kv heads, positions, dim, fp32
    slots = [cache.allocate() for _ in range(3)]
    assert slots == [0, 1, 2] and cache.num_free == 0
    with pytest.raises(BatchspecError, match="full"):
        cache.allocate()
    cache.lengths[1] = 10
    cache.truncate(1, 4)
    assert int(cache.lengths[1]) == 4
    with pytest.raises(ValueError):
        cache.truncate(1, 5)  # rollback only shortens
    cache.lengths[torch.tensor([0, 2])] = torch.tensor([7, 9])
    cache.truncate_many(torch.tensor([0, 2]), torch.tensor([3, 9]))
    assert cache.lengths.tolist() == [3, 4, 9]
    cache.release(1)
    assert cache.allocate() == 1 and int(cache.lengths[1]) == 0  # a new request starts empty


def test_attention_paths_agree_bit_for_bit(tiny_model_factory):
    """The same two requests decoded from adjacent slots (keys read in place), slots with a hole between them
    (in place over the span), far apart (gathered) and in swapped order give identical logits."""
    from batchspec.weights.loading import load_model

    model = load_model(tiny_model_factory(name="paths", seed=3)).transformer
    cache = model.new_cache(num_slots=6, max_len=32)
    prompt_a, prompt_b = torch.tensor([5, 17, 230, 9]), torch.tensor([44, 3, 8, 120, 61, 7])
    for slot, prompt in [(0, prompt_a), (1, prompt_b), (2, prompt_b), (5, prompt_b)]:
        model.forward(cache, torch.tensor([slot]), torch.tensor([len(prompt)]), prompt, all_logits=False)
    lengths = cache.lengths.clone()
    results = {}
    for slots in ([0, 1], [0, 2], [0, 5], [1, 0]):
        logits = model.forward(cache, torch.tensor(slots), torch.tensor([2, 2]), torch.tensor([11, 12, 13, 14])
                               if slots[0] == 0 else torch.tensor([13, 14, 11, 12])).logits
        cache.lengths.copy_(lengths)
        results[tuple(slots)] = logits if slots[0] == 0 else torch.cat([logits[2:], logits[:2]])
    reference = results[(0, 1)]
    for slots, logits in results.items():
        assert torch.equal(logits, reference), slots
