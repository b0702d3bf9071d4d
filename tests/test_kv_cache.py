"""KV cache bookkeeping: slots join and leave, rollback is setting the length back, memory is bounded."""

from __future__ import annotations

import pytest
import torch

from batchspec.config import ModelConfig
from batchspec.errors import BatchspecError
from batchspec.kv_cache import KVCache

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
