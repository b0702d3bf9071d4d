"""Native PyTorch runtime for Llama- and Qwen2-family causal LMs, with batched forward over ragged appends.

One forward call serves a batch of requests, each appending its own number of new tokens (0..n) at its own position
in the KV cache. Linear layers run on the packed tokens `(T, hidden)` with no padding; only attention pads, to
`(B, n_max)` queries against each request's cached keys, masked by position. Projections are fused on load
(`wqkv`, `w_gate_up`) and logits are computed only for the rows the caller asks for (the LM head is ~20 % of a
small model's weights). `forward` builds the batch's `attention.AttentionMetadata` once, then runs each
`decoder_block.decoder_block` (attention, then MLP) on it; RoPE tables come from `rope`.

A draft may also restrict its LM head to a *head vocabulary* (`restrict_head`): the tokens it can ever propose, as
in FR-Spec / EAGLE-3's draft vocabularies. For a small draft the head is much of the work (a 49152 x 576 head is
two thirds of a four-layer SmolLM2 slice's FLOPs); 8192 frequent tokens cut such drafts' step time by 40-50 %.
The draft's q is then the softmax over those tokens and exactly zero elsewhere, which rejection sampling handles
like any other q, so speculative decoding stays lossless.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchspec.errors import BatchspecError
from batchspec.runtime.attention import attention_metadata
from batchspec.runtime.config import ModelConfig
from batchspec.runtime.decoder_block import decoder_block
from batchspec.runtime.device import check_precision_on, synchronize
from batchspec.runtime.kv_cache import KVCache
from batchspec.runtime.layer_weights import LayerWeights
from batchspec.runtime.linear import default_backend, dense, linear
from batchspec.runtime.onednn import PackedWeights, invariant_chunk_rows, onednn_layout
from batchspec.runtime.quantized import Int4Weight, Int8Weight, QuantizedWeight
from batchspec.runtime.rope import rope_inv_freq, rope_tables, rotate_half

__all__ = ["ForwardOutput", "LayerWeights", "Transformer", "rope_inv_freq", "rotate_half"]


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

    def logits_to_host(self) -> ForwardOutput:
        """The same output with its logits (and head ids) on the host; the hidden states stay where they are."""
        if self.head_logits is None or self.head_logits.device.type == "cpu":
            return self
        head_ids = None if self.head_ids is None else self.head_ids.cpu()
        return ForwardOutput(self.head_logits.cpu(), self.hidden, head_ids, self.vocab_size)


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
        # With a restricted head: also score, in every forward, the tokens the batch's sequences already hold that
        # the head lacks (`context_head_ids`).
        self.context_head = False
        self._in_head: torch.Tensor | None = None  # (vocab,) bool: the restricted head's tokens
        self._merged: dict = {}  # extra ids -> their layout in the union (`_with_context_logits`)
        self.rope_cos, self.rope_sin = rope_tables(config, config.max_position_embeddings, self.device,
                                                 self.dtype)  # (P, D) each
        # "mkl" or "onednn" on the CPU (`batchspec.runtime.linear`), "cuda" (cuBLAS) on a GPU
        self.linear_backend = "cuda" if self.device.type == "cuda" else default_backend(self.dtype)
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
        exactly, `linear.dense` recovers them), so the model holds its weights once, not twice. So is an untied full
        LM head; a tied one (the embedding, which token lookups read) or a restricted one gets a packed copy (the
        1.5B target in float32, untied: 6.6 GiB of weights, 7.9 GiB resident after packing with a copy of its
        0.85 GiB head, 7.0 without). A float32 model of at most `PackedWeights.GEMV_COPY_BYTES` of matrices keeps
        them plain too, for one-row calls (MKL's gemv, 7-17 % faster there). A batch-invariant bfloat16 model also
        runs `onednn.invariant_chunk_rows`'s checks now, once per matrix shape.
        """
        if self.linear_backend != "onednn" or isinstance(self.lm_head, QuantizedWeight):
            return

        # Counted without a list of the matrices: one kept until packing ends would hold every unpacked matrix beside
        # the packed ones (the 1.5B target in float32: 12.8 GiB peak instead of 7.9).
        elements = self.lm_head.numel() + sum(getattr(layer, name).numel() for layer in self.layers
                                              for name in LayerWeights.MATRICES)
        keep_plain = self.dtype == torch.float32 and 4 * elements <= PackedWeights.GEMV_COPY_BYTES

        def pack(weight: torch.Tensor) -> torch.Tensor:
            if weight.is_mkldnn:
                return weight
            self.packed_weights.discard(weight)  # a copy made on first use, before this
            packed = onednn_layout(weight)
            if keep_plain:  # for one-row calls (`PackedWeights.GEMV_COPY_BYTES`)
                self.packed_weights.keep_plain(packed, weight)
            return packed

        self._map_layer_matrices(pack)
        if self.lm_head is self.full_head and self.full_head is not self.embed:
            self.lm_head = self.full_head = pack(self.full_head)
        head = self.lm_head if self.lm_head.is_mkldnn else self.packed_weights.get(self.lm_head)
        if self.batch_invariant and self.dtype == torch.bfloat16 and self.layers:
            layer = self.layers[0]
            for weight, bias in ((layer.wqkv, layer.bqkv), (layer.wo, None), (layer.w_gate_up, None),
                                 (layer.w_down, None), (head, None)):
                invariant_chunk_rows(weight, bias)

    def quantize_weights(self, precision: str, wide: str | None = None) -> None:
        """Weight-only `int8` (`quantized.Int8Weight`) or `int4` (`quantized.Int4Weight`) for every layer matrix and the
        LM head. The model must be in bfloat16, which its activations, norms, embedding and KV cache stay in;
        restrict the head first. wide (int4): keep an `int8` or `float32` copy for calls of many rows
        (`Int4Weight.wide`)."""
        kinds = {"int8": Int8Weight, "int4": Int4Weight}
        if precision not in kinds:
            raise BatchspecError(f"unknown weight-only precision {precision!r}; use int8 or int4")
        check_precision_on(self.device, precision)
        if self.dtype != torch.bfloat16 or self.precision != "bfloat16":
            raise BatchspecError(f"{precision} weights need a bfloat16 model, this one is {self.precision}")
        int4_wide = wide if precision == "int4" else None
        quantize = functools.partial(Int4Weight.quantize, wide=int4_wide) if int4_wide else kinds[precision].quantize
        self._map_layer_matrices(quantize)
        self.packed_weights.clear()
        self.lm_head = quantize(self.lm_head, wide_rows=Int4Weight.HEAD_WIDE_ROWS) if int4_wide \
            else quantize(self.lm_head)
        if self.head_ids is None and self.full_head is not self.embed:  # an untied head: keep one copy
            self.full_head = self.lm_head

    def _map_layer_matrices(self, fn) -> None:
        """Replace each layer's matrices by `fn` of them (packed, quantized), one layer at a time: a layer's old
        matrices are freed before the next layer's new ones are made, so the model never holds two forms of all its
        weights at once (a new list, built whole, did: the 1.5B target's float32 layers twice while packing). The
        list is this model's own copy, in case another model was built on the same list."""
        self.layers = list(self.layers)
        for i, layer in enumerate(self.layers):
            self.layers[i] = layer.map_matrices(fn)
            del layer

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Compute logits only for `token_ids` (every other token gets probability 0); None restores the full head."""
        if isinstance(self.lm_head, QuantizedWeight):
            raise BatchspecError(f"restrict the head vocabulary before quantizing the model to {self.precision}")
        self.context_head = False  # (`enable_context_head` again for the new head)
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
        self.lm_head = dense(self.full_head)[ids.to(self.device)].contiguous()  # dense: a packed full head
        self.head_ids = ids.to(self.device)

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

    def attention_dtype(self, batch_invariant: bool) -> torch.dtype:
        """The type attention computes in: float64 for a batch-invariant bfloat16 forward, else the model's.

        SDPA's result for a row changes with the padding around it (the batch's other requests set kv_len and
        n_max): measured, one bfloat16 ulp between kv lengths 40 and 80 in bfloat16, 1.8e-7 in float32 — and
        rounded back to bfloat16 even 1e-7 flips some values, which the layers above amplify, so a request's tokens
        would depend on its batch neighbours and verification would drift from `ar`. In float64 the differences
        (~1e-16) are far below bfloat16's resolution. A float32 model keeps float32 attention (its rounding
        differences stay ~1e-7 without a cast). The price grows with the context and the padded windows: the Qwen
        1.5B target verifying 8 requests at 300 tokens of context (32 rows, 252-291 ms a pass) spent 26-41 ms in
        float64 SDPA and ~10 ms casting keys and values, where bfloat16 SDPA takes a quarter of the time (one layer:
        0.51 ms against 1.80 + 0.37). On a CUDA GPU every batch-invariant model attends in float64: which SDPA kernel
        runs, and how it splits the keys, depends on the shapes.
        """
        wide = self.dtype == torch.bfloat16 or self.device.type == "cuda"
        return torch.float64 if batch_invariant and wide else self.dtype

    @property
    def invariance_costs(self) -> bool:
        """Whether batch invariance slows this model's wide calls down (bfloat16 or CUDA: row blocks of the
        products, float64 attention), so that a forward whose rows never depend on its neighbours should drop it."""
        return self.batch_invariant and (self.dtype == torch.bfloat16 or self.device.type == "cuda")

    def enable_context_head(self) -> None:
        """Score the tokens of each batch's own sequences besides a restricted head's (`context_head_ids`).

        A draft's head vocabulary (`restrict_head`: FR-Spec's most frequent tokens) makes its LM head cheaper but
        cannot propose a rarer token, and the tokens a request's prompt holds (a function's name, its arguments) are
        the rare ones its answer repeats most. Measured on the Qwen pair (`sd`, k = 3, batch 8, 16 HumanEval
        prompts, greedy, 128 tokens): 32,768 tokens ranked on Python sources, VSR 0.981 with the full head, 0.936
        with that head alone, 0.981 with the prompts' tokens added; the int4 draft's pass over 8 rows 52 -> 46 ms.
        Restricting the head again turns it off."""
        if self.head_ids is None:
            raise BatchspecError("a context head extends a restricted head vocabulary: restrict the head first")
        if isinstance(self.full_head, QuantizedWeight) or self.full_head.is_mkldnn:
            raise BatchspecError("a context head reads the full head's rows: it needs a plain (tied or unquantized) "
                                 "full head")
        self._in_head = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        self._in_head[self.head_ids.cpu()] = True
        self._merged = {}
        self.context_head = True

    def context_head_ids(self, cache: KVCache, slots: torch.Tensor, num_new: torch.Tensor,
                         tokens: torch.Tensor) -> tuple[int, ...]:
        """Record the appended tokens the restricted head lacks in `cache.context_tokens` (a slot appending from
        position 0 starts afresh) and return those the batch's sequences hold, sorted: work in the tokens appended,
        not in the vocabulary (a bitmap over it took ~0.26 ms a forward at 8 rows)."""
        held = cache.context_tokens
        if held is None:
            held = cache.context_tokens = [set() for _ in range(cache.num_slots)]
        slots, num_new, tokens = slots.cpu(), num_new.cpu(), tokens.cpu()
        for slot in slots[cache.lengths[slots] == 0].tolist():
            held[slot].clear()
        outside = ~self._in_head[tokens]  # (T,)
        if bool(outside.any()):
            owners = torch.repeat_interleave(slots, num_new)[outside].tolist()
            for slot, token in zip(owners, tokens[outside].tolist()):
                held[slot].add(token)
        return tuple(sorted(set().union(*(held[slot] for slot in slots.tolist()))))

    # Layouts of the union of the head and the extra tokens kept (`_with_context_logits`): a step's draft passes
    # over subsets of its requests ask for a few different ones in turn.
    MERGED_LAYOUTS = 32

    def _with_context_logits(self, logits: torch.Tensor, rows: torch.Tensor,
                             extra: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's logits (R, N) and those of the `extra` tokens (sorted ids) from the full head's rows, as one
        head over their sorted union: ((R, N + E) float32, (N + E,) ids)."""
        layout = self._merged.get(extra)
        if layout is None:
            if len(self._merged) >= self.MERGED_LAYOUTS:
                self._merged.clear()
            head, added_ids = self.head_ids.cpu(), torch.tensor(extra, dtype=torch.int64)
            own = torch.arange(head.numel()) + torch.searchsorted(added_ids, head)  # the head's columns in the union
            added = torch.arange(added_ids.numel()) + torch.searchsorted(head, added_ids)
            merged = torch.empty(head.numel() + added_ids.numel(), dtype=torch.int64)
            merged[own], merged[added] = head, added_ids
            layout = self._merged[extra] = (added_ids.to(self.device), merged.to(self.device), own.to(self.device),
                                            added.to(self.device))
        added_ids, merged, own, added = layout
        extra_logits = F.linear(rows, self.full_head[added_ids]).float()  # (R, E)
        union = logits.new_empty(logits.shape[0], merged.numel())
        union.index_copy_(1, own, logits)
        union.index_copy_(1, added, extra_logits)
        return union, merged

    @torch.inference_mode()
    def forward(self, cache: KVCache, slots: torch.Tensor, num_new: torch.Tensor, tokens: torch.Tensor,
                logit_rows: torch.Tensor | None = None, all_logits: bool = True,
                batch_invariant: bool | None = None) -> ForwardOutput:
        """Append `num_new[b]` tokens to the cache slot `slots[b]` for every request b and run the model on them.

        slots, num_new: (B,) int64; tokens: (T,) int64 packed in request order, T = num_new.sum().
        logit_rows: indices into the T packed tokens whose logits are wanted (None with all_logits: every row).
        batch_invariant: None for the model's own setting; False for a forward whose batch is the same whatever
        else runs (one whole prompt alone), which then takes the full-width kernels.
        Advances the cache lengths by num_new. Returns logits for the chosen rows and hidden states for all T, on the
        model's device (the inputs may be on the host).
        """
        c = self.config
        invariant = self.batch_invariant if batch_invariant is None else batch_invariant
        num_new = num_new.to(torch.int64)
        keep = num_new > 0  # a request with nothing to append sits this step out
        if not bool(keep.all()):
            slots, num_new = slots[keep], num_new[keep]
        total = int(tokens.numel())
        if int(num_new.sum()) != total:
            raise ValueError(f"num_new sums to {int(num_new.sum())} but {total} tokens were given")
        if total == 0:
            return ForwardOutput(None, torch.empty(0, c.hidden_size, dtype=self.dtype, device=self.device),
                                 self.head_ids, c.vocab_size)
        # Positions, mask and cache paths depend on the batch, not the layer: built once, read by every layer.
        meta = attention_metadata(cache, slots, num_new, self.rope_cos, self.rope_sin, c.num_groups,
                                  self.attention_dtype(invariant), self.device)

        extra = self.context_head_ids(cache, slots, num_new, tokens) if self.context_head else None
        dev = self.device
        lin = functools.partial(linear, backend=self.linear_backend, packed=self.packed_weights,
                                batch_invariant=invariant)
        x = self.embed[tokens.to(dev)]  # (T, hidden)
        for index, layer in enumerate(self.layers):
            x = decoder_block(x, layer, cache.k[index], cache.v[index], meta, c, lin)  # cache: (S, KV, max_len, D)

        cache.lengths[slots] = meta.ends
        hidden = F.rms_norm(x, (c.hidden_size,), self.final_norm, c.rms_norm_eps)  # (T, hidden)
        rows = hidden[logit_rows.to(dev)] if logit_rows is not None else hidden if all_logits else None
        logits = None if rows is None else lin(rows, self.lm_head).float()
        head_ids = self.head_ids
        if logits is not None and extra:
            logits, head_ids = self._with_context_logits(logits, rows, extra)
        out = ForwardOutput(logits, hidden, head_ids, c.vocab_size)
        synchronize(dev)  # on a GPU: the callers time their forwards (stats, profiles) and read the results next
        return out
