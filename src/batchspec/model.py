"""Native PyTorch runtime for Llama- and Qwen2-family causal LMs, with batched forward over ragged appends.

One forward call serves a batch of requests, each appending its own number of new tokens (0..n) at its own position
in the KV cache. Linear layers run on the packed tokens `(T, hidden)` with no padding; only attention pads, to
`(B, n_max)` queries against each request's cached keys, masked by position. Projections are fused on load
(`wqkv`, `w_gate_up`) and logits are computed only for the rows the caller asks for (the LM head is ~20 % of a
small model's weights).

A draft may also restrict its LM head to a *head vocabulary* (`restrict_head`): the tokens it can ever propose, as
in FR-Spec / EAGLE-3's draft vocabularies. For a small draft the head is much of the work (a 49152 x 576 head is
two thirds of a four-layer SmolLM2 slice's FLOPs); 8192 frequent tokens cut such drafts' step time by 40-50 %.
The draft's q is then the softmax over those tokens and exactly zero elsewhere, which rejection sampling handles
like any other q, so speculative decoding stays lossless.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from batchspec.config import ModelConfig, rope_type
from batchspec.errors import BatchspecError
from batchspec.kv_cache import KVCache
from batchspec.linear import Int4Weight, Int8Weight, PackedWeights, QuantizedWeight, default_backend, linear


@dataclass
class LayerWeights:
    """One block's weights. The four matrices may be in oneDNN's packed layout (`Transformer.pack_weights`) or
    weight-only int8 or int4 (`Transformer.quantize_weights`); `linear.dense` gives their values either way."""

    attn_norm: torch.Tensor  # (hidden,)
    wqkv: torch.Tensor | QuantizedWeight  # ((H + 2*KV) * D, hidden)
    bqkv: torch.Tensor | None  # ((H + 2*KV) * D,) — Qwen2 only
    wo: torch.Tensor | QuantizedWeight  # (hidden, H * D)
    mlp_norm: torch.Tensor  # (hidden,)
    w_gate_up: torch.Tensor | QuantizedWeight  # (2 * intermediate, hidden)
    w_down: torch.Tensor | QuantizedWeight  # (hidden, intermediate)

    MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")

    def map_matrices(self, fn) -> LayerWeights:
        """A copy with `fn` applied to each of the four matrices (the norms and bias shared)."""
        return replace(self, **{name: fn(getattr(self, name)) for name in self.MATRICES})


@dataclass
class ForwardOutput:
    head_logits: torch.Tensor | None  # (R, N) float32 over `head_ids` for the requested rows (N = vocab if None)
    hidden: torch.Tensor  # (T, hidden): last-layer hidden state after the final norm (what the LM head reads)
    head_ids: torch.Tensor | None = None  # (N,) sorted token ids of a restricted head; None: the whole vocabulary
    vocab_size: int = 0

    @functools.cached_property
    def logits(self) -> torch.Tensor | None:
        """(R, vocab) float32 logits; -inf for tokens outside a restricted head (their probability is 0)."""
        if self.head_logits is None or self.head_ids is None:
            return self.head_logits
        full = self.head_logits.new_full((self.head_logits.shape[0], self.vocab_size), -math.inf)
        return full.index_copy_(1, self.head_ids.to(full.device), self.head_logits)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), computed exactly as transformers does so that logits agree to float precision."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_type(config.rope_scaling)
    scaling = config.rope_scaling or {}
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Transformer:
    """Weights plus a ragged batched forward. Stateless apart from weights: the KV cache is passed in."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.config = config
        self.embed = embed  # (vocab, hidden)
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # (vocab, hidden); the same tensor as `embed` when tied; (N, hidden) if restricted
        self.head_ids: torch.Tensor | None = None  # (N,) sorted token ids of a restricted head (`restrict_head`)
        self.full_head = lm_head  # (vocab, hidden) whatever the head vocabulary
        self.rope_cos, self.rope_sin = self._rope_tables(config.max_position_embeddings)
        self.linear_backend = default_backend()  # "mkl" or "onednn" (`batchspec.linear`)
        self.packed_weights = PackedWeights()  # oneDNN's layout of the matrices, made on first use under "onednn"
        # A request's logits do not depend on its batch neighbours, bit for bit, also in bfloat16 (fixed-shape
        # products, float64 attention); what verification against `ar` needs. A draft may drop it (it only proposes).
        self.batch_invariant = True

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The type of activations, norms, the embedding and the KV cache (bfloat16 under int8/int4 weights)."""
        return self.embed.dtype

    @property
    def precision(self) -> str:
        """What results.json calls the model's dtype: float32, bfloat16, int8 or int4 (weight-only, bfloat16 rest)."""
        if isinstance(self.lm_head, Int8Weight):
            return "int8"
        if isinstance(self.lm_head, Int4Weight):
            return "int4"
        return str(self.dtype).removeprefix("torch.")

    def num_parameters(self) -> int:
        tensors = {id(t): t for t in [self.embed, self.final_norm, self.full_head]}
        for layer in self.layers:
            for t in vars(layer).values():
                if t is not None:
                    tensors[id(t)] = t
        return sum(t.numel() for t in tensors.values())

    def pack_weights(self) -> None:
        """Under oneDNN, reorder the matrices into its blocked layout now instead of on first use (which would land
        on the first request's latency). A no-op under MKL and for int8 weights.

        The layer matrices are replaced by their packed form (this model's own `layers` list; the values are kept
        exactly, `linear.dense` recovers them), so the model holds its weights once, not twice. The LM head gets a
        packed copy instead: it may be the embedding, which token lookups read.
        """
        if self.linear_backend != "onednn" or isinstance(self.lm_head, QuantizedWeight):
            return

        def pack(weight: torch.Tensor) -> torch.Tensor:
            if weight.is_mkldnn:
                return weight
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PackedWeights.ROWS_HINT)

        self.layers = [layer.map_matrices(pack) for layer in self.layers]
        self.packed_weights.get(self.lm_head)

    def quantize_weights(self, precision: str) -> None:
        """Weight-only `int8` (`linear.Int8Weight`) or `int4` (`linear.Int4Weight`) for every layer matrix and the
        LM head. The model must be in bfloat16, which its activations, norms, embedding and KV cache stay in;
        restrict the head first."""
        kinds = {"int8": Int8Weight, "int4": Int4Weight}
        if precision not in kinds:
            raise BatchspecError(f"unknown weight-only precision {precision!r}; use int8 or int4")
        if self.dtype != torch.bfloat16 or self.precision != "bfloat16":
            raise BatchspecError(f"{precision} weights need a bfloat16 model, this one is {self.precision}")
        quantize = kinds[precision].quantize
        self.layers = [layer.map_matrices(quantize) for layer in self.layers]
        self.packed_weights.clear()
        self.lm_head = quantize(self.lm_head)
        if self.head_ids is None and self.full_head is not self.embed:  # an untied head: keep one copy
            self.full_head = self.lm_head

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Compute logits only for `token_ids` (every other token gets probability 0); None restores the full head."""
        if isinstance(self.lm_head, QuantizedWeight):
            raise BatchspecError(f"restrict the head vocabulary before quantizing the model to {self.precision}")
        if self.lm_head is not self.full_head:
            self.packed_weights.discard(self.lm_head)  # a restricted head about to be replaced
        if token_ids is None:
            self.lm_head, self.head_ids = self.full_head, None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
        vocab = self.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise BatchspecError(f"a head vocabulary needs 1..{vocab} token ids in [0, {vocab}), got {ids.numel()} "
                                 f"ids" + (f" in [{int(ids.min())}, {int(ids.max())}]" if ids.numel() else ""))
        if bool((ids[1:] <= ids[:-1]).any()):
            raise BatchspecError("a head vocabulary's token ids must be strictly increasing (sorted, no repeats)")
        self.lm_head = self.full_head[ids.to(self.device)].contiguous()
        self.head_ids = ids.to(self.device)

    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.config)
        freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D), the rotate-half layout
        return emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)

    @classmethod
    def from_hf_state_dict(cls, config: ModelConfig, weights: dict[str, torch.Tensor],
                           consume: bool = False) -> Transformer:
        """Build from Hugging Face tensor names (`model.layers.N.self_attn.q_proj.weight`, ...), fusing on the way.

        consume: pop each tensor from `weights` as it is used, so a fused matrix's parts are freed while the next
        layer is built (a loader that owns the dict keeps one copy of the weights, not two).
        """

        def take(name: str) -> torch.Tensor:
            try:
                return weights.pop(name) if consume else weights[name]
            except KeyError:
                raise BatchspecError(f"model weights lack tensor {name!r}") from None

        def check(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            if tuple(tensor.shape) != shape:
                raise BatchspecError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {shape}")
            return tensor

        c = config
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            q = check(p + "q", take(p + "self_attn.q_proj.weight"), (q_out, c.hidden_size))
            k = check(p + "k", take(p + "self_attn.k_proj.weight"), (kv_out, c.hidden_size))
            v = check(p + "v", take(p + "self_attn.v_proj.weight"), (kv_out, c.hidden_size))
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            gate = check(p + "gate", take(p + "mlp.gate_proj.weight"), (c.intermediate_size, c.hidden_size))
            up = check(p + "up", take(p + "mlp.up_proj.weight"), (c.intermediate_size, c.hidden_size))
            layers.append(LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"),
                wqkv=torch.cat([q, k, v]).contiguous(),
                bqkv=bias,
                wo=check(p + "o", take(p + "self_attn.o_proj.weight"), (c.hidden_size, q_out)),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                w_gate_up=torch.cat([gate, up]).contiguous(),
                w_down=check(p + "down", take(p + "mlp.down_proj.weight"), (c.hidden_size, c.intermediate_size)),
            ))
        embed = check("embed", take("model.embed_tokens.weight"), (c.vocab_size, c.hidden_size))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            lm_head = embed
        else:
            lm_head = check("lm_head", weights["lm_head.weight"], (c.vocab_size, c.hidden_size))
        return cls(c, embed, layers, take("model.norm.weight"), lm_head)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.config, num_slots, max_len, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, cache: KVCache, slots: torch.Tensor, num_new: torch.Tensor, tokens: torch.Tensor,
                logit_rows: torch.Tensor | None = None, all_logits: bool = True) -> ForwardOutput:
        """Append `num_new[b]` tokens to the cache slot `slots[b]` for every request b and run the model on them.

        slots, num_new: (B,) int64; tokens: (T,) int64 packed in request order, T = num_new.sum().
        logit_rows: indices into the T packed tokens whose logits are wanted (None with all_logits: every row).
        Advances the cache lengths by num_new. Returns logits for the chosen rows and hidden states for all T.
        """
        c = self.config
        num_new = num_new.to(torch.int64)
        keep = num_new > 0  # a request with nothing to append sits this step out
        if not bool(keep.all()):
            slots, num_new = slots[keep], num_new[keep]
        batch, total = int(slots.numel()), int(tokens.numel())
        if int(num_new.sum()) != total:
            raise ValueError(f"num_new sums to {int(num_new.sum())} but {total} tokens were given")
        if total == 0:
            return ForwardOutput(None, torch.empty(0, c.hidden_size, dtype=self.dtype), self.head_ids, c.vocab_size)
        starts = cache.lengths[slots]  # (B,)
        ends = starts + num_new
        if int(ends.max()) > cache.max_len:
            raise BatchspecError(f"sequence of {int(ends.max())} tokens exceeds the context of {cache.max_len}")

        n_max = int(num_new.max())
        decode = n_max == 1  # one new token per request: no padding or scatter needed
        row = torch.repeat_interleave(torch.arange(batch), num_new)  # (T,) request of each token
        offset = self._offsets(num_new, total)  # (T,) index of each token within its request's append
        positions = starts[row] + offset  # (T,)
        slot_of = slots[row]  # (T,)
        kv_len = int(ends.max())
        # Query (b, i) at absolute position starts[b] + i sees keys 0..starts[b] + i of its own slot.
        query_pos = starts[:, None] + torch.arange(n_max)[None, :]  # (B, n_max)
        mask = torch.arange(kv_len)[None, None, :] <= query_pos[:, :, None]  # (B, n_max, kv_len)
        # Attention reads the slots' keys in place over the span [lo, hi) of cache slots when holes in it (slots of
        # other requests, or free) cost less to read than copying the batch's keys would (a gather reads and
        # writes them, then SDPA reads the copy); rows of the span outside the batch get zero queries and are
        # dropped. Each row's attention is computed alone, so the result does not depend on the path.
        lo, hi = int(slots.min()), int(slots.max()) + 1
        in_place = hi - lo <= 2 * batch
        rows_in_span = slots - lo  # (B,)
        spread = in_place and not (hi - lo == batch and bool((rows_in_span == torch.arange(batch)).all()))

        dev = self.device
        positions_d, slot_of_d = positions.to(dev), slot_of.to(dev)
        cos = self.rope_cos[positions_d][:, None, :]  # (T, 1, D)
        sin = self.rope_sin[positions_d][:, None, :]
        # GQA without repeating K/V: the G query heads sharing a KV head become G*n_max query rows of that head.
        groups = c.num_groups
        mask = mask[:, None, None].expand(batch, 1, groups, n_max, kv_len).reshape(batch, 1, groups * n_max, kv_len)
        # Additive (0 / -inf) once per forward: SDPA would convert a boolean mask in every layer (same result,
        # bit for bit; ~10 % of the attention time at batch 16).
        # A batch-invariant bfloat16 model attends in float64. SDPA's result for a row changes with the padding around it (the
        # batch's other requests set kv_len and n_max): measured, one bfloat16 ulp between kv lengths 40 and 80 in
        # bfloat16, 1.8e-7 in float32 — and rounded back to bfloat16 even 1e-7 flips some values, which the layers
        # above amplify, so a request's tokens would depend on its batch neighbours and verification would drift
        # from `ar`. In float64 the differences (~1e-16) are far below bfloat16's resolution. A float32 model keeps
        # float32 attention (its rounding differences stay ~1e-7 without a cast). Attention is a few % of a step.
        attn_dtype = torch.float64 if self.batch_invariant and self.dtype == torch.bfloat16 else self.dtype
        mask = torch.zeros(mask.shape, dtype=attn_dtype).masked_fill_(~mask, -math.inf)
        if spread:
            span_mask = torch.zeros(hi - lo, 1, groups * n_max, kv_len, dtype=attn_dtype)  # holes: any finite row
            span_mask[rows_in_span] = mask
            mask = span_mask
        mask = mask.to(dev)
        span_rows_d = rows_in_span.to(dev)
        if not decode:
            row_d, offset_d = row.to(dev), offset.to(dev)

        lin = functools.partial(linear, backend=self.linear_backend, packed=self.packed_weights,
                                batch_invariant=self.batch_invariant)
        x = self.embed[tokens.to(dev)]  # (T, hidden)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (c.hidden_size,), layer.attn_norm, c.rms_norm_eps)
            qkv = lin(h, layer.wqkv, layer.bqkv).contiguous()  # (T, (H + 2KV) * D)
            q = qkv[:, :q_size].view(total, c.num_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(total, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(total, c.num_kv_heads, c.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache_k, cache_v = cache.k[index], cache.v[index]  # (S, KV, max_len, D)
            cache_k[slot_of_d, :, positions_d] = k  # advanced indices around a slice: (T, KV, D) ← k
            cache_v[slot_of_d, :, positions_d] = v
            if in_place:
                keys = cache_k[lo:hi, :, :kv_len]  # (span, KV, L, D), a view
                values = cache_v[lo:hi, :, :kv_len]
            else:
                slots_d = slots.to(dev)
                keys, values = cache_k[slots_d, :, :kv_len], cache_v[slots_d, :, :kv_len]
            if decode:
                q_pad = q.view(batch, 1, c.num_heads, c.head_dim)
            else:
                q_pad = q.new_zeros(batch, n_max, c.num_heads, c.head_dim)
                q_pad[row_d, offset_d] = q
            # (B, n, KV*G, D) -> (B, KV, G*n, D): head h = kv*G + g, as transformers' repeat_kv orders them.
            q_grouped = (q_pad.view(batch, n_max, c.num_kv_heads, groups, c.head_dim)
                         .permute(0, 2, 3, 1, 4).reshape(batch, c.num_kv_heads, groups * n_max, c.head_dim))
            if spread:  # the batch's queries at their slots' rows of the span
                q_span = q_grouped.new_zeros(hi - lo, *q_grouped.shape[1:])
                q_span[span_rows_d] = q_grouped
                attn = F.scaled_dot_product_attention(q_span.to(attn_dtype), keys.to(attn_dtype),
                                                      values.to(attn_dtype), attn_mask=mask)[span_rows_d]
            else:
                attn = F.scaled_dot_product_attention(q_grouped.to(attn_dtype), keys.to(attn_dtype),
                                                      values.to(attn_dtype), attn_mask=mask)  # (B, KV, G*n, D)
            attn = (attn.to(x.dtype).view(batch, c.num_kv_heads, groups, n_max, c.head_dim)
                    .permute(0, 3, 1, 2, 4).reshape(batch, n_max, q_size))  # (B, n, H*D)
            attn = attn.view(batch, q_size) if decode else attn[row_d, offset_d]  # (T, H*D)
            x = x + lin(attn, layer.wo)
            h = F.rms_norm(x, (c.hidden_size,), layer.mlp_norm, c.rms_norm_eps)
            gate, up = lin(h, layer.w_gate_up).chunk(2, dim=-1)
            # Under MKL the float32 down projection keeps F.linear's operand order: its 1536-long reductions over the
            # large MLP activations of models like SmolLM2 are where the two orders' rounding differs most (measured:
            # max logit difference to transformers 1.1e-4 with the fast order here, 6e-5 without), for ~5 % speed.
            act = F.silu(gate) * up
            x = x + lin(act, layer.w_down, reference_order=True)

        cache.lengths[slots] = ends
        hidden = F.rms_norm(x, (c.hidden_size,), self.final_norm, c.rms_norm_eps)  # (T, hidden)
        if logit_rows is not None:
            logits = lin(hidden[logit_rows.to(dev)], self.lm_head)
        elif all_logits:
            logits = lin(hidden, self.lm_head)
        else:
            logits = None
        return ForwardOutput(None if logits is None else logits.float(), hidden, self.head_ids, c.vocab_size)

    @staticmethod
    def _offsets(num_new: torch.Tensor, total: int) -> torch.Tensor:
        """Index of each packed token within its request's append: [0..n0-1, 0..n1-1, ...] (T,)."""
        first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each request's first token
        return torch.arange(total) - torch.repeat_interleave(first, num_new)
