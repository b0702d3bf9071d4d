"""How good is a draft for a target? Acceptance on HumanEval (chat-formatted, greedy) and relative cost.

1. The target answers N HumanEval prompts greedily through `Engine` (batch 16, 128 new tokens).
2. Target and draft are teacher-forced over prompt + target answer; at every answer position we have both
   distributions p (target) and q (draft).
3. Greedy SD with window k is simulated exactly: since the output is the target's greedy text, a step starting at
   position i proposes the draft's argmax at i, i+1, ... (each conditioned on the target's tokens, which equal
   the accepted drafts), accepts them while they match, and the target emits one more token.
   Temperature 1: per-position acceptance E_{x~q}[min(1, p(x)/q(x))] = 1 - TV(p, q).
4. Cost: median time of a batch-16 decode forward (one token per request, logits for every row) of draft and
   target, measured interleaved in the same runtime.
5. A draft that ships a head vocabulary (head_vocab.py) is measured twice: as shipped, and scoring the whole
   vocabulary, so the table shows what the restricted head costs in acceptance and saves in time.

    python benchmarks/draft_acceptance.py [--target NAME] [--draft DIR] [--num-prompts 32] [--json]
    python benchmarks/draft_acceptance.py --target qwen2.5-coder-1.5b-instruct --target-dtype bfloat16  # its pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from batchspec.datasets.prompts import humaneval_chat_prompt, humaneval_prompts
from batchspec.engine.engine import Engine
from batchspec.runtime.machine import machine_description
from batchspec.runtime.precision import DRAFT_PRECISION_CHOICES, PRECISIONS, resolve_precision
from batchspec.runtime.sampling import SamplingParams
from batchspec.runtime.threads import configure_threads
from batchspec.weights.known_models import default_draft_dir, paired_draft
from batchspec.weights.loading import check_draft_compatible, load_model


@torch.inference_mode()
def answer_logits(model, sequences: list[tuple[list[int], list[int]]], per_call: int = 4) -> list[torch.Tensor]:
    """Teacher-force (prompt, answer) pairs; return logits (len(answer), V) predicting each answer token."""
    out = []
    for start in range(0, len(sequences), per_call):
        group = sequences[start:start + per_call]
        seqs = [p + a[:-1] for p, a in group]  # the last answer token predicts nothing we score
        cache = model.new_cache(len(group), max(len(s) for s in seqs) + 1)
        num_new = torch.tensor([len(s) for s in seqs])
        first = torch.cumsum(num_new, 0) - num_new
        rows = torch.cat([f + len(p) - 1 + torch.arange(len(a)) for f, (p, a) in zip(first.tolist(), group)])
        logits = model.forward(cache, torch.arange(len(group)), num_new, torch.tensor(sum(seqs, [])),
                               logit_rows=rows).logits
        out += list(logits.split([len(a) for _, a in group]))
    return out


def simulate_greedy_sd(matches: list[torch.Tensor], k: int) -> dict:
    """matches[r][i]: does the draft's argmax equal the target's token at answer position i of request r."""
    proposed = accepted = steps = 0
    per_position = torch.zeros(k)  # accepted count at window position 1..k
    for match in matches:
        row, i, n = match.tolist(), 0, len(match)
        while i < n:
            window = min(k, n - i - 1)  # the target emits the token after the window itself
            run = 0
            while run < window and row[i + run]:
                run += 1
            per_position[:run] += 1
            proposed += window
            accepted += run
            steps += 1
            i += run + 1
    return {"acceptance_greedy": accepted / max(1, proposed), "mean_accept_len": (accepted + steps) / max(1, steps),
            "per_position_accept": (per_position / max(1, steps)).tolist(), "sd_steps": steps}


@torch.inference_mode()
def forward_costs(target, draft, prompt_ids: list[list[int]], batch: int, reps: int) -> dict:
    """Median batch-`batch` decode forward of each model, interleaved, at the context of real prompts."""
    prompts = (prompt_ids * batch)[:batch]
    caches, times = {}, {"target": [], "draft": []}
    for name, model in (("target", target.transformer), ("draft", draft.transformer)):
        cache = model.new_cache(batch, max(len(p) for p in prompts) + 2)
        model.forward(cache, torch.arange(batch), torch.tensor([len(p) for p in prompts]),
                      torch.tensor(sum(prompts, [])), all_logits=False)
        caches[name] = cache
    lengths = caches["target"].lengths.clone()
    tokens = torch.tensor([p[-1] for p in prompts])
    ones, rows = torch.ones(batch, dtype=torch.int64), torch.arange(batch)
    for rep in range(reps + 3):  # three untimed warm-up rounds
        for name, model in (("target", target.transformer), ("draft", draft.transformer)):
            started = time.perf_counter()
            model.forward(caches[name], torch.arange(batch), ones, tokens, logit_rows=rows)
            elapsed = time.perf_counter() - started
            caches[name].truncate_many(torch.arange(batch), lengths)
            if rep >= 3:
                times[name].append(elapsed)
    target_s, draft_s = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"target_forward_ms": 1e3 * target_s, "draft_forward_ms": 1e3 * draft_s, "cost_ratio": draft_s / target_s}


def draft_results(target, draft, target_logits, answers, prompt_ids, args) -> dict:
    """Acceptance (greedy SD simulation, temperature-1 expectation) and forward costs of one draft."""
    draft_logits = answer_logits(draft.transformer, list(zip(prompt_ids, [a.tolist() for a in answers])))
    matches = [d.argmax(-1) == a for d, a in zip(draft_logits, answers)]
    results = simulate_greedy_sd(matches, args.k)
    p, q = torch.cat(target_logits).softmax(-1), torch.cat(draft_logits).softmax(-1)  # (N, V)
    results["acceptance_t1"] = float(1 - 0.5 * (p - q).abs().sum(-1).mean())
    results["draft_top1_match"] = float(torch.cat(matches).float().mean())
    head = draft.transformer.head_ids
    results["head_vocab"] = draft.config.vocab_size if head is None else int(head.numel())
    results.update(forward_costs(target, draft, prompt_ids, args.batch_size, args.timing_reps))
    batch_one = forward_costs(target, draft, prompt_ids, 1, args.timing_reps)
    results.update({f"{key}_b1": value for key, value in batch_one.items()})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--target-dtype", default="float32", choices=PRECISIONS, help="the target's weights")
    parser.add_argument("--draft", default=None,
                        help="draft model (default: the named target's pair, else the shipped draft)")
    parser.add_argument("--draft-dtype", default="auto", choices=DRAFT_PRECISION_CHOICES,
                        help="the draft's weights (auto: bfloat16 on CPUs with native bfloat16, else float32; int8)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("-k", "--k", type=int, default=4)
    parser.add_argument("--timing-reps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = parser.parse_args(argv)
    configure_threads()

    target = load_model(args.target, dtype=args.target_dtype)
    draft_dtype = resolve_precision(args.draft_dtype)
    draft_spec = args.draft or paired_draft(args.target) or default_draft_dir()
    draft = load_model(draft_spec, dtype=draft_dtype)
    check_draft_compatible(target, draft)
    prompts = [humaneval_chat_prompt(p) for p in humaneval_prompts()[:args.num_prompts]]
    engine = Engine(target, max_batch_size=args.batch_size)
    started = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens), chat=True)
    generate_s = time.perf_counter() - started
    eos = min(target.eos_token_ids)
    pairs = [(engine.encode_prompt(p, chat=True), o.token_ids + ([eos] if o.finish_reason == "stop" else []))
             for p, o in zip(prompts, outputs)]

    target_logits = answer_logits(target.transformer, pairs)
    answers = [torch.tensor(a) for _, a in pairs]
    prompt_ids = [i for i, _ in pairs]
    results = draft_results(target, draft, target_logits, answers, prompt_ids, args)
    results["target_forced_greedy_match"] = float(torch.cat(
        [t.argmax(-1) == a for t, a in zip(target_logits, answers)]).float().mean())  # sanity: ~1.0
    if draft.transformer.head_ids is not None:  # the same draft scoring the whole vocabulary, for comparison
        full = load_model(draft_spec, dtype=draft_dtype, full_head=True)
        results["full_head"] = draft_results(target, full, target_logits, answers, prompt_ids, args)
    results.update({"num_prompts": len(prompts), "answer_tokens": sum(len(a) for a in answers), "k": args.k,
                    "batch_size": args.batch_size, "target_generate_s": generate_s,
                    "draft": str(draft.model_dir), "draft_dtype": draft.transformer.precision,
                    "target_dtype": target.transformer.precision,
                    "draft_parameters": draft.transformer.num_parameters(),
                    "target_parameters": target.transformer.num_parameters(), "machine": machine_description()})
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"draft {results['draft']} ({results['draft_parameters'] / 1e6:.1f} M params, "
          f"{results['draft_dtype']}) vs target "
          f"({results['target_parameters'] / 1e6:.1f} M) on {len(prompts)} HumanEval chat prompts, "
          f"{results['answer_tokens']} greedy answer tokens; machine: {results['machine']}")
    rows = [
        ("draft head vocabulary (tokens it can propose)", f"{results['head_vocab']}"),
        (f"acceptance, greedy, k={args.k}", f"{results['acceptance_greedy']:.3f}"),
        ("mean accepted length (1 + accepted)", f"{results['mean_accept_len']:.2f}"),
        ("per-position acceptance", " ".join(f"{a:.2f}" for a in results["per_position_accept"])),
        ("draft top-1 = target token", f"{results['draft_top1_match']:.3f}"),
        ("acceptance, temperature 1 (1 - TV)", f"{results['acceptance_t1']:.3f}"),
        (f"forward ms, batch {args.batch_size} decode: draft / target",
         f"{results['draft_forward_ms']:.1f} / {results['target_forward_ms']:.1f}"),
        ("cost ratio draft / target", f"{results['cost_ratio']:.3f}"),
        ("forward ms, batch 1 decode: draft / target",
         f"{results['draft_forward_ms_b1']:.1f} / {results['target_forward_ms_b1']:.1f}"),
        ("cost ratio draft / target, batch 1", f"{results['cost_ratio_b1']:.3f}"),
    ]
    if "full_head" in results:
        full = results["full_head"]
        rows += [
            (f"the same draft scoring all {full['head_vocab']} tokens:", ""),
            (f"  acceptance, greedy, k={args.k} / temperature 1",
             f"{full['acceptance_greedy']:.3f} / {full['acceptance_t1']:.3f}"),
            ("  cost ratio draft / target, batch 16 / batch 1",
             f"{full['cost_ratio']:.3f} / {full['cost_ratio_b1']:.3f}"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
