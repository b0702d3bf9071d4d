"""Output quality of lossy decoding (SPRINTER) against the target alone: ROUGE-L and the target's NLL.

- `rouge_l`: mean ROUGE-L F1 of each output against the target-only (`ar`) output of the same prompt, with the
  `rouge-score` package's standard tokenisation (lower-cased alphanumeric words — punctuation does not count).
- `target_scores`: from one batched teacher-forced target pass over the outputs (untimed: after the measured
  generation), the target's mean negative log-likelihood per generated token (nats; lower is more target-like) and
  the greedy disagreement: the share of generated tokens that are not the target's argmax given the same prefix (the
  output's own). At temperature 0 that is the mean per-token total variation between the target's law (a point
  mass on its argmax) and the decoder's, on the decoder's own trajectory: 0 for every lossless policy, and what
  SPRINTER's TV(p, p_S) = eta_FP * TV(p, q) predicts for a token kept without a target check.
"""

from __future__ import annotations

import torch

from batchspec.runtime.model import Transformer
from batchspec.runtime.sampling import greedy_tokens
from batchspec.runtime.teacher_forcing import answer_log_probs


def rouge_l(candidates: list[str], references: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score(ref, cand)["rougeL"].fmeasure for cand, ref in zip(candidates, references)]
    return sum(scores) / len(scores) if scores else 0.0


def target_scores(target: Transformer, prompts: list[list[int]], outputs: list[list[int]],
                  per_call: int = 8) -> tuple[float, float]:
    """(mean -log p(output token | prompt, earlier output), share of output tokens != the target's argmax there), over
    every generated token of every request."""
    nll, disagree, count = 0.0, 0, 0
    pairs = [(p, o) for p, o in zip(prompts, outputs) if o]
    for start in range(0, len(pairs), per_call):
        chunk = pairs[start:start + per_call]
        logp = answer_log_probs(target, chunk)  # (N, V)
        wanted = torch.tensor([t for _, o in chunk for t in o])  # (N,)
        nll -= float(logp.gather(1, wanted[:, None]).sum())
        disagree += int((greedy_tokens(logp) != wanted).sum())  # ties resolve as in `ar`
        count += len(wanted)
    return (nll / count, disagree / count) if count else (0.0, 0.0)
