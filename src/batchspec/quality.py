"""Output quality of lossy decoding (SPRINTER) against the target alone: ROUGE-L and the target's NLL.

- `rouge_l`: mean ROUGE-L F1 of each output against the target-only (`ar`) output of the same prompt, with the
  `rouge-score` package's standard tokenisation (lower-cased alphanumeric words — punctuation does not count).
- `target_nll`: the target's mean negative log-likelihood per generated token (nats) of the outputs, scored in
  batched teacher-forced prefills; lower is more target-like. Untimed: it runs after the measured generation.
"""

from __future__ import annotations

import torch

from batchspec.model import Transformer


def rouge_l(candidates: list[str], references: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(ref, cand)["rougeL"].fmeasure for cand, ref in zip(candidates, references)]
    return sum(scores) / len(scores) if scores else 0.0


@torch.inference_mode()
def target_nll(target: Transformer, prompts: list[list[int]], outputs: list[list[int]], per_call: int = 8) -> float:
    """Mean -log p(output token | prompt, earlier output) over every generated token of every request."""
    total, count = 0.0, 0
    pairs = [(p, o) for p, o in zip(prompts, outputs) if o]
    for start in range(0, len(pairs), per_call):
        chunk = pairs[start:start + per_call]
        seqs = [p + o for p, o in chunk]
        cache = target.new_cache(len(chunk), max(len(s) for s in seqs) + 1)
        num_new = torch.tensor([len(s) for s in seqs])
        first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each sequence's first token
        # the logits at position len(p) - 1 + j predict output token j
        rows = torch.cat([f + len(p) - 1 + torch.arange(len(o)) for f, (p, o) in zip(first.tolist(), chunk)])
        logp = target.forward(cache, torch.arange(len(chunk)), num_new, torch.tensor(sum(seqs, [])),
                              logit_rows=rows).logits.log_softmax(-1)  # (N, V)
        wanted = torch.tensor([t for _, o in chunk for t in o])  # (N,)
        total -= float(logp.gather(1, wanted[:, None]).sum())
        count += len(wanted)
    return total / count if count else 0.0
