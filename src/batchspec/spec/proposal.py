"""One speculative step's model passes: `propose` (the draft, K' sequential steps) and `score` (one ragged target pass).

Cache convention, for both models: a request's cache holds its committed tokens except the ones listed as pending
for that model. The target always has exactly one pending token (the last one emitted); the draft has one, or two
when the target accepted every draft of the last step (the draft never ran on its own final proposal), or more: the
whole prompt after prefill, and every token of the plain decoding steps since it last drafted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from batchspec.runtime.kv_cache import KVCache
from batchspec.runtime.model import Transformer
from batchspec.runtime.sampling import greedy_tokens, sample_with_uniforms, token_probs
from batchspec.spec.verifier import DraftScorer


@dataclass
class Proposal:
    tokens: Tensor  # (B, K') int64 draft tokens
    probs: Tensor | None  # (B, K', V) processed q each draft was drawn from; None when every request is greedy
    logprobs: Tensor  # (B, K') selection scores: log q(d), from the unprocessed softmax for greedy requests
    drafted: Tensor | None = None  # (B,) drafts each request has: K', or fewer where it stopped early (a SPRINTER
    # block ends at its first draft the verifier rejected; a pruned request's next draft could not be verified)
    verifier_probs: Tensor | None = None  # (B, K') SPRINTER verifier's P(accept) of each draft, when asked for

    def __post_init__(self) -> None:
        if self.drafted is None:
            self.drafted = torch.full((self.tokens.shape[0],), self.tokens.shape[1], dtype=torch.int64)


@dataclass
class Scored:
    """Target output over [last, d_1 .. d_l] per request, padded to K'+1 positions."""

    probs: Tensor | None  # (B, K'+1, V) processed p; None when every request is greedy
    argmax: Tensor  # (B, K'+1) int64


# (log q of the drafts so far (B, j): -inf past a request's last, which requests are still drafting (B,) bool) ->
# which of them draft one more token (B,) bool. A policy's rule for not drafting what it will never verify.
KeepDrafting = Callable[[Tensor, Tensor], Tensor]


def ragged_inputs(pending: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """(num_new (B,), packed tokens (T,), rows of each request's last token (B,)) for a list of token lists."""
    num_new = torch.tensor([len(p) for p in pending], dtype=torch.int64)
    tokens = torch.tensor([t for p in pending for t in p], dtype=torch.int64)
    return num_new, tokens, torch.cumsum(num_new, 0) - 1


def propose(draft: Transformer, cache: KVCache, slots: Tensor, pending: list[list[int]], k_prime: int,
            sampling: tuple[Tensor, Tensor, Tensor], uniforms: Tensor | None,
            scorer: DraftScorer | None = None, keep_drafting: KeepDrafting | None = None,
            first: Tensor | None = None) -> Proposal:
    """Run the draft up to K' sequential steps for the whole batch; step 1 also feeds each request's pending tokens.

    sampling: (temperature, top_k, top_p), each (B,); uniforms (B, K') for the draws, None when all greedy.
    scorer: also score every draft with SPRINTER's verifier; with its `stop_below`, a request stops drafting after its
    first draft scored below that (SPRINTER blocks). keep_drafting: the policy's rule, asked after every step but the
    last, for which requests draft on. Later steps run only the requests still drafting; none left: drafting ends.
    first: (B,) bool, the requests that draft at all (None: every one); the others draft nothing, and their pending
    tokens wait for a step in which they draft.
    """
    greedy_all = uniforms is None
    batch = len(pending)
    tokens_out = torch.zeros(batch, k_prime, dtype=torch.int64)
    logprobs = torch.full((batch, k_prime), -math.inf)
    probs = torch.zeros(batch, k_prime, draft.config.vocab_size) if not greedy_all and k_prime else None
    scores = torch.zeros(batch, k_prime) if scorer is not None else None
    drafted = torch.full((batch,), k_prime, dtype=torch.int64)
    rows = torch.arange(batch)  # requests still drafting
    if first is not None:
        drafted[~first] = 0
        rows = rows[first]
    num_new, tokens, last_rows = ragged_inputs(pending if first is None else [pending[i] for i in rows.tolist()])
    for step in range(k_prime):
        out = draft.forward(cache, slots[rows], num_new, tokens, logit_rows=last_rows)
        if not greedy_all:
            out = out.logits_to_host()  # a draft on a GPU: sampling (q, the draws) happens on the host
        # Over the draft's head vocabulary (all tokens, or the ones a restricted head can propose): q is 0 elsewhere.
        log_softmax = out.head_logits.log_softmax(dim=-1)  # (R, N)
        if greedy_all:
            index = greedy_tokens(out.head_logits)  # (R,) position in the head vocabulary (sorted: ties as in V)
            token = index if out.head_ids is None else out.head_ids[index]
            score = log_softmax.gather(-1, index[:, None])[:, 0].cpu()
            token = token.cpu()
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
        if scorer is not None:
            # SPRINTER features: the hidden state that produced the token, its log q and the draft's entropy.
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (R,)
            logq = log_softmax.gather(-1, index[:, None])[:, 0]  # (R,)
            scores[rows, step] = scorer(out.hidden[last_rows], logq, entropy).cpu()
            if scorer.stop_below is not None:
                keep = scores[rows, step] >= scorer.stop_below
        if keep_drafting is not None and step + 1 < k_prime:
            drafting = torch.zeros(batch, dtype=torch.bool)
            drafting[rows[keep]] = True
            keep &= keep_drafting(logprobs[:, :step + 1], drafting)[rows]
        drafted[rows[~keep]] = step + 1
        rows, token = rows[keep], token[keep]
        if not len(rows):
            break
        # The next step feeds the token just drafted: one new token per request still drafting.
        num_new, tokens, last_rows = torch.ones(len(rows), dtype=torch.int64), token, torch.arange(len(rows))
    return Proposal(tokens_out, probs, logprobs, drafted, scores)


def replay_drafting(keep_drafting: KeepDrafting, logprobs: Tensor) -> Tensor:
    """How many of these drafts (B, K') each request would have made had `propose` asked `keep_drafting` as it went.
    (B,) int64. The simulator replays pruned drafting on recorded steps with it; tests compare with drafting all."""
    batch, k_prime = logprobs.shape
    drafted = torch.full((batch,), k_prime, dtype=torch.int64)
    drafting = torch.ones(batch, dtype=torch.bool)
    seen = torch.full_like(logprobs, -math.inf)
    for step in range(k_prime - 1):
        seen[drafting, step] = logprobs[drafting, step]
        keep = drafting & keep_drafting(seen[:, :step + 1], drafting)
        drafted[drafting & ~keep] = step + 1
        drafting = keep
        if not drafting.any():
            break
    return drafted


def undrafted(logprobs: Tensor, drafted: Tensor) -> Tensor:
    """The log-probs with -inf past each request's `drafted` drafts (what `propose` returns for them)."""
    positions = torch.arange(logprobs.shape[1])[None, :]
    return torch.where(positions < drafted[:, None], logprobs, torch.full_like(logprobs, -math.inf))


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
    argmax[used] = greedy_tokens(logits).cpu()
    if sampling is None:
        return Scored(None, argmax)
    logits = logits.cpu()  # a target on a GPU: p on the host, where the acceptance rule runs
    rows = torch.repeat_interleave(torch.arange(batch), num_new)  # (T,) request of each scored position
    p = token_probs(logits, sampling[0][rows], sampling[1][rows], sampling[2][rows])  # (T, V)
    probs = torch.zeros(batch, k_prime + 1, p.shape[-1])
    probs[used] = p
    return Scored(probs, argmax)
