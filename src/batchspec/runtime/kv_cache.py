"""Preallocated KV cache with one slot per request and per-slot lengths.

Layout per layer: `(slots, kv_heads, max_len, head_dim)` — a slot's keys are a contiguous `(kv_heads, len, head_dim)`
block, which is the layout SDPA takes, so a run of slots (or a span with a few holes) is attended to in place.

Speculative decoding writes drafts it may reject: rollback is `truncate(slot, n)`, i.e. setting the length back
(O(1)); stale entries past the length are never attended to because attention masks by length. Requests join
(`allocate`) and leave (`release`) between steps without moving other requests' data.
"""

from __future__ import annotations

import torch

from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if num_slots < 1 or max_len < 1:
            raise BatchspecError(f"KV cache needs at least one slot and one position (got {num_slots}, {max_len})")
        if max_len > config.max_position_embeddings:
            max_len = config.max_position_embeddings
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        # zeros, not empty: masked-out entries still enter q·k, and uninitialised memory may hold NaN,
        # which a -inf mask does not cancel (NaN + -inf = NaN). calloc'd pages are committed lazily.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.int64)  # host-side bookkeeping, (slots,)
        self._free = list(range(num_slots - 1, -1, -1))  # stack; lowest slot handed out first
        # Kept by a model with a context head (`Transformer.context_head_ids`): per slot, the tokens its sequence holds
        # that the model's head vocabulary lacks (a superset after a rollback). Made on first use.
        self.context_tokens: list[set[int]] | None = None

    @property
    def nbytes(self) -> int:
        """Memory held by keys and values (the bound: it never grows)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise BatchspecError(f"KV cache is full ({self.num_slots} slots in use)")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def truncate(self, slot: int, length: int) -> None:
        """Roll a slot back to `length` tokens (discarding rejected speculative entries)."""
        if not 0 <= length <= int(self.lengths[slot]):
            raise ValueError(f"cannot truncate slot {slot} of length {int(self.lengths[slot])} to {length}")
        self.lengths[slot] = length

    def truncate_many(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Vectorised `truncate`: slots (B,), lengths (B,), each length <= the slot's current one."""
        if bool((lengths > self.lengths[slots]).any()) or bool((lengths < 0).any()):
            raise ValueError("truncate_many can only shorten slots")
        self.lengths[slots] = lengths
