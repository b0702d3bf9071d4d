"""Teacher forcing: score given answers under a model in one packed prefill (distillation data, output quality)."""

from __future__ import annotations

import torch

from batchspec.runtime.model import Transformer


@torch.inference_mode()
def answer_log_probs(model: Transformer, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """log p(. | prompt, answer[:j]) at every answer position j of every (prompt, answer) pair: (N, V).

    N = total answer length; the rows of pair i follow those of pair i - 1. The last answer token is never fed.
    """
    seqs = [p + a[:-1] for p, a in pairs]
    cache = model.new_cache(len(pairs), max(len(s) for s in seqs) + 1)
    num_new = torch.tensor([len(s) for s in seqs])
    first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each sequence's first token
    # the logits at position len(p) - 1 + j predict answer token j
    rows = torch.cat([f + len(p) - 1 + torch.arange(len(a)) for f, (p, a) in zip(first.tolist(), pairs)])
    return model.forward(cache, torch.arange(len(pairs)), num_new, torch.tensor(sum(seqs, [])),
                         logit_rows=rows).logits.log_softmax(-1)
