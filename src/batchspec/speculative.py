"""One speculative step, as its stages: propose (draft) -> select (policy) -> verify (target) -> commit (caller).

Cache convention, for both models: a request's cache holds its committed tokens except the ones listed as pending
for that model. The target always has exactly one pending token (the last one emitted); the draft has one, or two
when the target accepted every draft of the last step (the draft never ran on its own final proposal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from batchspec.errors import BatchspecError
from batchspec.kv_cache import KVCache
from batchspec.model import Transformer
from batchspec.sampling import sample_with_uniforms, token_probs
from batchspec.selection import check_policy, default_capacity, validate_spec


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings. `capacity` None means C = k * B at each step (B = active requests)."""

    policy: str = "ar"
    k: int = 4
    extra: int = 2
    capacity: int | None = None
    turn_on_batch_size: int = 1  # Tetris acts as sd below this many active requests
    k_max: int = 8  # dsd's largest window
    measure_oracle: bool = False  # untimed extra target pass over all K' drafts: true a, oracle_fraction
    verifier: str | None = None  # SPRINTER verifier directory: needed by `sprinter` and by tetris_scores="verifier"
    tau: float | None = None  # sprinter: accept a draft without the target iff verifier prob >= tau (None: its own)
    block_cap: int = 20  # sprinter: L, the most tokens a request drafts before the target is called
    tetris_scores: str = "q"  # tetris ranks by cumulative draft probability ("q") or verifier probability

    def validate(self, batch_size: int) -> None:
        if check_policy(self.policy) == "ar":
            return
        if self.tetris_scores not in ("q", "verifier"):
            raise BatchspecError(f"tetris scores must be 'q' or 'verifier', got {self.tetris_scores!r}")
        if self.verifier is None and (self.policy == "sprinter" or self.tetris_scores == "verifier"):
            raise BatchspecError(f"policy {self.policy!r} with these settings needs a SPRINTER verifier (--verifier)")
        if self.policy == "sprinter":
            if self.block_cap < 1:
                raise BatchspecError(f"--block-cap must be >= 1, got {self.block_cap}")
            if self.tau is not None and not 0.0 <= self.tau <= 1.0:
                raise BatchspecError(f"--tau must be in [0, 1], got {self.tau}")
            return
        validate_spec(self.k, self.extra, self.capacity_for(batch_size), batch_size)
        if self.policy == "dsd" and self.k_max < 1:
            raise BatchspecError(f"k_max must be >= 1 for dsd (got {self.k_max})")

    def capacity_for(self, batch_size: int) -> int:
        return default_capacity(self.k, batch_size) if self.capacity is None else self.capacity


@dataclass
class Proposal:
    tokens: Tensor  # (B, K') int64 draft tokens
    probs: Tensor | None  # (B, K', V) processed q each draft was drawn from; None when every request is greedy
    logprobs: Tensor  # (B, K') selection scores: log q(d), from the unprocessed softmax for greedy requests
    verifier_probs: Tensor | None = None  # (B, K') SPRINTER verifier's P(accept) of each draft, when asked for
    blocks: Tensor | None = None  # (B,) sprinter: drafts up to and including the first the verifier rejected


@dataclass
class Scored:
    """Target output over [last, d_1 .. d_l] per request, padded to K'+1 positions."""

    probs: Tensor | None  # (B, K'+1, V) processed p; None when every request is greedy
    argmax: Tensor  # (B, K'+1) int64


def ragged_inputs(pending: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """(num_new (B,), packed tokens (T,), rows of each request's last token (B,)) for a list of token lists."""
    num_new = torch.tensor([len(p) for p in pending], dtype=torch.int64)
    tokens = torch.tensor([t for p in pending for t in p], dtype=torch.int64)
    return num_new, tokens, torch.cumsum(num_new, 0) - 1


def propose(draft: Transformer, cache: KVCache, slots: Tensor, pending: list[list[int]], k_prime: int,
            sampling: tuple[Tensor, Tensor, Tensor], uniforms: Tensor | None, verifier=None,
            stop_below: float | None = None) -> Proposal:
    """Run the draft K' sequential steps for the whole batch; step 1 also feeds each request's pending tokens.

    sampling: (temperature, top_k, top_p), each (B,); uniforms (B, K') for the draws, None when all greedy.
    verifier (a `sprinter.Verifier`): also score every draft with it; with `stop_below`, a request stops drafting
    after its first draft scored below that (SPRINTER blocks) — later steps run only the requests still drafting.
    """
    from batchspec.sprinter import verifier_probs

    greedy_all = uniforms is None
    batch = len(pending)
    tokens_out = torch.zeros(batch, k_prime, dtype=torch.int64)
    logprobs = torch.full((batch, k_prime), -math.inf)
    probs = torch.zeros(batch, k_prime, draft.config.vocab_size) if not greedy_all and k_prime else None
    scores = torch.zeros(batch, k_prime) if verifier is not None else None
    blocks = torch.full((batch,), k_prime, dtype=torch.int64)
    rows = torch.arange(batch)  # requests still drafting
    num_new, tokens, last_rows = ragged_inputs(pending)
    for step in range(k_prime):
        out = draft.forward(cache, slots[rows], num_new, tokens, logit_rows=last_rows)
        # Over the draft's head vocabulary (all tokens, or the ones a restricted head can propose): q is 0 elsewhere.
        log_softmax = out.head_logits.log_softmax(dim=-1)  # (R, N)
        if greedy_all:
            index = out.head_logits.argmax(dim=-1)  # (R,) position in the head vocabulary (sorted: ties as in V)
            token = index if out.head_ids is None else out.head_ids[index]
            score = log_softmax.gather(-1, index[:, None])[:, 0]
        else:
            q = token_probs(out.logits, sampling[0][rows], sampling[1][rows], sampling[2][rows])  # (R, V)
            token = sample_with_uniforms(q, uniforms[rows, step])
            index = token if out.head_ids is None else torch.searchsorted(out.head_ids, token)
            score = torch.where(sampling[0][rows] > 0, q.gather(-1, token[:, None])[:, 0].clamp_min(1e-30).log(),
                                log_softmax.gather(-1, index[:, None])[:, 0])
            probs[rows, step] = q
        tokens_out[rows, step] = token
        logprobs[rows, step] = score
        keep = torch.ones(len(rows), dtype=torch.bool)
        if verifier is not None:
            # SPRINTER features: the hidden state that produced the token, its log q and the draft's entropy.
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (R,)
            logq = log_softmax.gather(-1, index[:, None])[:, 0]  # (R,)
            scores[rows, step] = verifier_probs(verifier, out.hidden[last_rows], logq, entropy)
            if stop_below is not None:
                keep = scores[rows, step] >= stop_below
                blocks[rows[~keep]] = step + 1
        rows, token = rows[keep], token[keep]
        if not len(rows):
            break
        # The next step feeds the token just drafted: one new token per request still drafting.
        num_new, tokens, last_rows = torch.ones(len(rows), dtype=torch.int64), token, torch.arange(len(rows))
    return Proposal(tokens_out, probs, logprobs, scores, blocks if stop_below is not None else None)


def score(target: Transformer, cache: KVCache, slots: Tensor, last: Tensor, proposal: Proposal, windows: Tensor,
          sampling: tuple[Tensor, Tensor, Tensor] | None) -> Scored:
    """One batched ragged target pass over [last, d_1 .. d_windows[i]] for every request.

    last (B,) the pending token; windows (B,) int64. Returns p (or argmax) padded to (B, K'+1, ...).
    """
    batch, k_prime = proposal.tokens.shape
    num_new = windows + 1  # (B,)
    position = torch.arange(k_prime + 1)[None, :]  # (1, K'+1)
    inputs = torch.cat([last[:, None], proposal.tokens], dim=1)  # (B, K'+1)
    used = position < num_new[:, None]  # (B, K'+1) which inputs each request sends
    logits = target.forward(cache, slots, num_new, inputs[used]).logits  # (T, V), T = sum(l) + B
    argmax = torch.zeros(batch, k_prime + 1, dtype=torch.int64)
    argmax[used] = logits.argmax(dim=-1)
    if sampling is None:
        return Scored(None, argmax)
    rows = torch.repeat_interleave(torch.arange(batch), num_new)  # (T,) request of each scored position
    p = token_probs(logits, sampling[0][rows], sampling[1][rows], sampling[2][rows])  # (T, V)
    probs = torch.zeros(batch, k_prime + 1, p.shape[-1])
    probs[used] = p
    return Scored(probs, argmax)
