"""A draft's head vocabulary: the tokens its LM head scores, chosen by how often the target produces them.

A draft only earns its keep on tokens the target would emit, and a model's output is dominated by a few thousand
tokens (the default target's answers on standard-library prompts use ~4,700 distinct tokens). Scoring only the most
frequent `N` of them (FR-Spec, EAGLE-3's draft vocabulary) makes the draft's LM head `vocab / N` times cheaper; a
draft token outside the set simply can never be proposed. Losslessness is untouched: q is an ordinary distribution
that is zero outside the set.

Ranking: the number of times each token is the target's own choice in the distillation data (its greedy token at
every scored position, plus every answer token), never HumanEval; ties and unseen tokens by token id, which for
BPE tokenizers is merge order, i.e. the tokenizer's own frequency prior. The special tokens (EOS and the chat
markers) are always included so that the draft can end an answer.

Stored with the model: `head_vocab.json` in an HF directory, or the GGUF key `batchspec.head_vocab`. A draft
batchspec did not distill has no teacher data to count: its vocabulary ships in the repository (`models/`, named by
`KnownModel.head_vocab`), ranked by the tokens' frequency in the Python sources distillation reads
(`benchmarks/draft_head_vocab.py`), and runs as a context head (`Transformer.enable_context_head`): each forward also
scores the tokens its batch's own sequences hold, which a prompt's names and a reply's repetitions need.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batchspec.errors import BatchspecError

HEAD_VOCAB_FILE = "head_vocab.json"
GGUF_KEY = "batchspec.head_vocab"


def choose_head_vocab(counts: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent token ids by `counts` (V,), ties by lower id, plus `always`; sorted, (size,) int64."""
    vocab = int(counts.numel())
    if not 1 <= size <= vocab:
        raise BatchspecError(f"head vocabulary size must be in [1, {vocab}], got {size}")
    forced = sorted({int(t) for t in always})
    if any(not 0 <= t < vocab for t in forced) or len(forced) > size:
        raise BatchspecError(f"cannot force {len(forced)} token ids into a head vocabulary of {size} (vocab {vocab})")
    # Stable descending sort: equal counts keep ascending id order.
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[forced] = True
    rest = order[~keep[order]][:size - len(forced)]
    keep[rest] = True
    return keep.nonzero()[:, 0]


def count_target_tokens(samples: list[dict[str, torch.Tensor]], vocab: int) -> torch.Tensor:
    """(V,) int64: how often each token is the target's greedy choice or an answer token in distillation samples."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for sample in samples:
        counts += torch.bincount(sample["top_ids"][:, 0].long(), minlength=vocab)
        counts += torch.bincount(sample["response"].long(), minlength=vocab)
    return counts


def write_head_vocab(model_dir: Path, token_ids: torch.Tensor, source: str) -> Path:
    path = Path(model_dir) / HEAD_VOCAB_FILE
    path.write_text(json.dumps({"source": source, "size": int(token_ids.numel()),
                                "token_ids": [int(t) for t in token_ids]}) + "\n")
    return path


def read_head_vocab(model_dir: Path) -> torch.Tensor | None:
    """The head vocabulary stored with a model directory, or None when it has none (a full head)."""
    path = Path(model_dir) / HEAD_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise TypeError("token_ids must be a list of integers")
    except (OSError, ValueError, KeyError, TypeError) as bad:
        raise BatchspecError(f"malformed head vocabulary {path}: {bad}") from None
    return torch.tensor(ids, dtype=torch.int64)
