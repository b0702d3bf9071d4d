"""Attention over a ragged batch: the per-forward metadata (`AttentionMetadata`) and one layer's attention.

Linear layers run on the packed tokens `(T, hidden)`; only attention pads, to `(B, n_max)` queries against each
request's cached keys, masked by position. Everything that depends on the batch's shape and not on the layer
(positions, RoPE rows, the mask, which cache path to read) is computed once per forward by `attention_metadata`
and handed to every layer's `attention`. A batch whose appends differ widely (a request catching up a whole prompt in
a draft pass beside requests appending one token) attends in groups of similar appends (`attention_groups`) rather
than padding every request to the longest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig
from batchspec.runtime.kv_cache import KVCache
from batchspec.runtime.rope import rotate_half

if TYPE_CHECKING:
    from batchspec.runtime.layer_weights import LayerWeights


@dataclass(frozen=True)
class AttentionMetadata:
    """One forward's batch as attention sees it. `ends` is on the host, every other tensor on the model's device.

    B requests append n_b >= 1 tokens each, T = sum n_b packed in request order; kv_len = L is the longest
    sequence after the append. Keys are read either in place over the span [lo, hi) of cache slots or gathered
    from the batch's slots (`in_place`); `spread` when the span's rows are not exactly the batch in order.
    """

    batch: int  # B
    total: int  # T
    n_max: int  # most tokens any request appends
    kv_len: int  # L
    ends: torch.Tensor  # (B,) each slot's length after the append
    positions_d: torch.Tensor  # (T,) absolute position of each packed token
    slot_of_d: torch.Tensor  # (T,) cache slot of each packed token
    row_d: torch.Tensor | None  # (T,) request of each packed token; None when decoding
    offset_d: torch.Tensor | None  # (T,) index of each packed token within its request's append; None when decoding
    cos: torch.Tensor  # (T, 1, D) RoPE rows of the tokens' positions
    sin: torch.Tensor  # (T, 1, D)
    mask: torch.Tensor  # (B, 1, G*n_max, L), or (hi - lo, ...) when spread: additive 0 / -inf in attn_dtype
    attn_dtype: torch.dtype  # what queries, keys and values are cast to for SDPA
    in_place: bool
    spread: bool
    lo: int
    hi: int
    span_rows_d: torch.Tensor  # (B,) row of each request's slot within the span, slots - lo
    slots_d: torch.Tensor | None  # (B,) the slots, for gathering their keys; None when read in place
    # The batch attended in groups (`attention_groups`): each group's own metadata and its tokens' (T_g,) indices
    # among the T packed tokens; empty when the batch attends as one.
    groups: tuple[tuple[AttentionMetadata, torch.Tensor], ...] = ()

    @property
    def decode(self) -> bool:
        """One new token per request: no padding or scatter needed."""
        return self.n_max == 1


def packed_offsets(num_new: torch.Tensor, total: int) -> torch.Tensor:
    """Index of each packed token within its request's append: [0..n0-1, 0..n1-1, ...] (T,)."""
    first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each request's first token
    return torch.arange(total) - torch.repeat_interleave(first, num_new)


# A batch is split for attention only when some request appends at least this many tokens (a prompt, not a
# verification window: a step's windows stay one padded batch, so verification runs exactly as before) ...
GROUP_MIN_APPEND = 16
# ... and when the groups' padded query-key products come to at most this share of the whole batch's.
GROUP_MAX_SHARE = 0.75


def attention_groups(num_new: torch.Tensor, ends: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a ragged batch in groups that attend separately: a partition of range(B) into (B_g,) index tensors,
    each ascending. One group (the whole batch) unless splitting pays.

    Padded attention costs each group B_g * n_max_g * L_g query-key products (its requests, its longest append,
    its longest sequence). Rows sorted by append are split in two where that cost is least, if the two groups cost
    at most `GROUP_MAX_SHARE` of the one, and each group is split again by the same rule. Measured on the Qwen2.5
    0.5B int4 draft, 256 tokens of context: one request appending 150 tokens beside seven appending 1 took 2,328 ms
    as one batch, against 1,363 + 133 ms for the two apart.
    """
    groups: list[torch.Tensor] = []
    pending = [torch.argsort(num_new, stable=True)]
    while pending:
        rows = pending.pop()
        n, length = num_new[rows], ends[rows]  # n ascending
        count = int(rows.numel())
        if count == 1 or int(n[-1]) < GROUP_MIN_APPEND:
            groups.append(torch.sort(rows).values)
            continue
        # Split after the first s rows, s = 1 .. count-1: short rows [0, s), long rows [s, count).
        s = torch.arange(1, count)
        short = s * n[:-1] * torch.cummax(length, 0).values[:-1]
        long_len = torch.flip(torch.cummax(torch.flip(length, (0,)), 0).values, (0,))[1:]  # max length[s:]
        cost = short + (count - s) * n[-1] * long_len
        best = int(torch.argmin(cost))
        if float(cost[best]) > GROUP_MAX_SHARE * count * int(n[-1]) * int(length.max()):
            groups.append(torch.sort(rows).values)
            continue
        pending += [rows[:best + 1], rows[best + 1:]]
    return sorted(groups, key=lambda g: int(g[0]))


def attention_metadata(cache: KVCache, slots: torch.Tensor, num_new: torch.Tensor, rope_cos: torch.Tensor,
                       rope_sin: torch.Tensor, num_groups: int, attn_dtype: torch.dtype,
                       device: torch.device, grouped: bool = True) -> AttentionMetadata:
    """The metadata of appending `num_new[b] >= 1` tokens to cache slot `slots[b]` (both (B,) int64, on the host).

    rope_cos, rope_sin: (P, D) tables on `device`. Raises if an append would run past the cache's context.
    grouped: whether a widely ragged batch may attend in groups (`attention_groups`).
    """
    batch = int(slots.numel())
    starts = cache.lengths[slots]  # (B,)
    ends = starts + num_new
    if int(ends.max()) > cache.max_len:
        raise BatchspecError(f"sequence of {int(ends.max())} tokens exceeds the context of {cache.max_len}")

    n_max = int(num_new.max())
    row = torch.repeat_interleave(torch.arange(batch), num_new)  # (T,) request of each token
    total = int(row.numel())
    offset = packed_offsets(num_new, total)  # (T,) index of each token within its request's append
    positions = starts[row] + offset  # (T,)
    slot_of = slots[row]  # (T,)
    kv_len = int(ends.max())
    # Attention reads the slots' keys in place over the span [lo, hi) of cache slots when holes in it (slots of
    # other requests, or free) cost less to read than copying the batch's keys would (a gather reads and
    # writes them, then SDPA reads the copy); rows of the span outside the batch get zero queries and are
    # dropped. Each row's attention is computed alone, so the result does not depend on the path.
    lo, hi = int(slots.min()), int(slots.max()) + 1
    in_place = hi - lo <= 2 * batch
    rows_in_span = slots - lo  # (B,)
    spread = in_place and not (hi - lo == batch and bool((rows_in_span == torch.arange(batch)).all()))

    positions_d, slot_of_d = positions.to(device), slot_of.to(device)
    mask = _additive_mask(starts, n_max, kv_len, num_groups, attn_dtype)
    if spread:
        span_mask = torch.zeros(hi - lo, *mask.shape[1:], dtype=attn_dtype)  # holes: any finite row
        span_mask[rows_in_span] = mask
        mask = span_mask
    decode = n_max == 1
    groups: tuple[tuple[AttentionMetadata, torch.Tensor], ...] = ()
    if grouped and n_max >= GROUP_MIN_APPEND:
        parts = attention_groups(num_new, ends)
        if len(parts) > 1:
            first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each request's first token
            groups = tuple(
                (attention_metadata(cache, slots[rows], num_new[rows], rope_cos, rope_sin, num_groups, attn_dtype,
                                    device, grouped=False),
                 (torch.repeat_interleave(first[rows], num_new[rows])
                  + packed_offsets(num_new[rows], int(num_new[rows].sum()))).to(device))
                for rows in parts)
    return AttentionMetadata(
        batch=batch, total=total, n_max=n_max, kv_len=kv_len, ends=ends,
        positions_d=positions_d, slot_of_d=slot_of_d,
        row_d=None if decode else row.to(device), offset_d=None if decode else offset.to(device),
        cos=rope_cos[positions_d][:, None, :], sin=rope_sin[positions_d][:, None, :],
        mask=mask.to(device), attn_dtype=attn_dtype, in_place=in_place, spread=spread, lo=lo, hi=hi,
        span_rows_d=rows_in_span.to(device), slots_d=None if in_place else slots.to(device), groups=groups,
    )


def _additive_mask(starts: torch.Tensor, n_max: int, kv_len: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, G*n_max, L) causal mask over each request's own keys, 0 where a query may look and -inf elsewhere."""
    batch = int(starts.numel())
    # Query (b, i) at absolute position starts[b] + i sees keys 0..starts[b] + i of its own slot.
    query_pos = starts[:, None] + torch.arange(n_max)[None, :]  # (B, n_max)
    mask = torch.arange(kv_len)[None, None, :] <= query_pos[:, :, None]  # (B, n_max, kv_len)
    # GQA without repeating K/V: the G query heads sharing a KV head become G*n_max query rows of that head.
    mask = mask[:, None, None].expand(batch, 1, groups, n_max, kv_len).reshape(batch, 1, groups * n_max, kv_len)
    # Additive (0 / -inf) once per forward: SDPA would convert a boolean mask in every layer (same result,
    # bit for bit; ~10 % of the attention time at batch 16).
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, -math.inf)


def attention(h: torch.Tensor, layer: LayerWeights, cache_k: torch.Tensor, cache_v: torch.Tensor,
              meta: AttentionMetadata, config: ModelConfig, lin: Callable[..., torch.Tensor],
              dtype: torch.dtype) -> torch.Tensor:
    """One layer's self-attention on the normed packed tokens h (T, hidden), output projection included: (T, hidden).

    Writes the tokens' keys and values into this layer's cache_k, cache_v (S, KV, max_len, D) at their positions.
    lin: `linear.linear` bound to the model's backend; dtype: the residual stream's type, which the attended values
    return to before the output projection.
    """
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = lin(h, layer.wqkv, layer.bqkv).contiguous()  # (T, (H + 2KV) * D)
    # RoPE on the queries' and keys' heads together (elementwise: the same values as one by one, in half the ops).
    qk = qkv[:, :q_size + kv_size].view(meta.total, c.num_heads + c.num_kv_heads, c.head_dim)
    qk = qk * meta.cos + rotate_half(qk) * meta.sin
    q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]  # (T, H, D), (T, KV, D)
    v = qkv[:, q_size + kv_size:].view(meta.total, c.num_kv_heads, c.head_dim)
    cache_k[meta.slot_of_d, :, meta.positions_d] = k  # advanced indices around a slice: (T, KV, D) ← k
    cache_v[meta.slot_of_d, :, meta.positions_d] = v
    if not meta.groups:
        return lin(_attend_packed(q, cache_k, cache_v, meta, c, dtype), layer.wo)
    attn = q.new_empty(meta.total, q_size, dtype=dtype)
    for group, tokens in meta.groups:
        attn[tokens] = _attend_packed(q[tokens], cache_k, cache_v, group, c, dtype)
    return lin(attn, layer.wo)


def _attend_packed(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, meta: AttentionMetadata,
                   config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The attended values of the packed queries q (T, H, D) of one batch (or group) of `meta`: (T, H*D) in dtype."""
    c, q_size = config, config.num_heads * config.head_dim
    if meta.in_place:
        keys = cache_k[meta.lo:meta.hi, :, :meta.kv_len]  # (span, KV, L, D), a view
        values = cache_v[meta.lo:meta.hi, :, :meta.kv_len]
    else:
        keys, values = cache_k[meta.slots_d, :, :meta.kv_len], cache_v[meta.slots_d, :, :meta.kv_len]
    attn = _attend(q, keys, values, meta, c)  # (B, KV, G*n, D) in attn_dtype
    attn = (attn.to(dtype).view(meta.batch, c.num_kv_heads, c.num_groups, meta.n_max, c.head_dim)
            .permute(0, 3, 1, 2, 4).reshape(meta.batch, meta.n_max, q_size))  # (B, n, H*D)
    return attn.view(meta.batch, q_size) if meta.decode else attn[meta.row_d, meta.offset_d]  # (T, H*D)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata,
            config: ModelConfig) -> torch.Tensor:
    """SDPA of the packed queries q (T, H, D) against keys, values ((B or span), KV, L, D): (B, KV, G*n_max, D)."""
    c, batch, n_max, groups = config, meta.batch, meta.n_max, config.num_groups
    if meta.decode:
        q_pad = q.view(batch, 1, c.num_heads, c.head_dim)
    else:
        q_pad = q.new_zeros(batch, n_max, c.num_heads, c.head_dim)
        q_pad[meta.row_d, meta.offset_d] = q
    # (B, n, KV*G, D) -> (B, KV, G*n, D): head h = kv*G + g, as transformers' repeat_kv orders them.
    q_grouped = (q_pad.view(batch, n_max, c.num_kv_heads, groups, c.head_dim)
                 .permute(0, 2, 3, 1, 4).reshape(batch, c.num_kv_heads, groups * n_max, c.head_dim))
    dtype = meta.attn_dtype
    if meta.spread:  # the batch's queries at their slots' rows of the span
        q_span = q_grouped.new_zeros(meta.hi - meta.lo, *q_grouped.shape[1:])
        q_span[meta.span_rows_d] = q_grouped
        return F.scaled_dot_product_attention(q_span.to(dtype), keys.to(dtype), values.to(dtype),
                                              attn_mask=meta.mask)[meta.span_rows_d]
    return F.scaled_dot_product_attention(q_grouped.to(dtype), keys.to(dtype), values.to(dtype),
                                          attn_mask=meta.mask)  # (B, KV, G*n, D)
