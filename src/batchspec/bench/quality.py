"""Output quality of lossy decoding (SPRINTER) against the target alone: ROUGE-L and the target's NLL.

- `rouge_l`: mean ROUGE-L F1 of each output against the target-only (`ar`) output of the same prompt, with the
  `rouge-score` package's standard tokenisation (lower-cased alphanumeric words — punctuation does not count).
- `target_nll`: the target's mean negative log-likelihood per generated token (nats) of the outputs, scored in
  batched teacher-forced prefills; lower is more target-like. Untimed: it runs after the measured generation.
"""

from __future__ import annotations

import torch

from batchspec.runtime.model import Transformer
from batchspec.runtime.teacher_forcing import answer_log_probs


def rouge_l(candidates: list[str], references: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(ref, cand)["rougeL"].fmeasure for cand, ref in zip(candidates, references)]
    return sum(scores) / len(scores) if scores else 0.0


def target_nll(target: Transformer, prompts: list[list[int]], outputs: list[list[int]], per_call: int = 8) -> float:
    """Mean -log p(output token | prompt, earlier output) over every generated token of every request."""
    total, count = 0.0, 0
    pairs = [(p, o) for p, o in zip(prompts, outputs) if o]
    for start in range(0, len(pairs), per_call):
        chunk = pairs[start:start + per_call]
        logp = answer_log_probs(target, chunk)  # (N, V)
        wanted = torch.tensor([t for _, o in chunk for t in o])  # (N,)
        total -= float(logp.gather(1, wanted[:, None]).sum())
        count += len(wanted)
    return total / count if count else 0.0
