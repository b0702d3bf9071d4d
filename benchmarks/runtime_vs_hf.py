"""Native runtime vs transformers `generate`: same weights, same prompts, greedy, measured side by side in one run.

    python benchmarks/runtime_vs_hf.py [--target default] [--max-tokens 128] [--trials 1]

Both generate exactly --max-tokens new tokens per prompt (EOS ignored) for chat-formatted HumanEval prompts, at
batch 1 and batch 16, after an untimed warm-up of each. Runs are interleaved (HF, ours, HF, ours, ...) so machine
noise hits both alike; the printed ratio is what counts, absolute tokens/s drift on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchspec import Engine, SamplingParams, configure_threads, load_model
from batchspec.datasets.prompts import humaneval_chat_prompt, humaneval_prompts
from batchspec.runtime.machine import machine_description


def hf_generate(model, prompt_ids: list[list[int]], max_tokens: int, pad_id: int) -> list[list[int]]:
    """Left-padded batched greedy generation with transformers, exactly max_tokens new tokens.

    EOS is not a stop token here (generation_config.eos_token_id = None, set by the caller), matching
    `ignore_eos=True` on our side: both continue past an EOS token in the same way, so outputs stay comparable.
    """
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompt_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                             do_sample=False, num_beams=1, pad_token_id=pad_id)
    return out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    threads = configure_threads()
    import transformers
    from transformers import AutoModelForCausalLM

    loaded = load_model(args.target)
    engine = Engine(loaded, max_batch_size=max(int(b) for b in args.batch_sizes.split(",")))
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly --max-tokens, like ignore_eos below
    prompts = [humaneval_chat_prompt(p) for p in humaneval_prompts()]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    pad_id = min(loaded.eos_token_ids)

    def run_ours(batch: list[str]) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        outs = engine.generate(batch, params, chat=True)
        return time.perf_counter() - started, [o.token_ids for o in outs]

    def run_hf(batch: list[str]) -> tuple[float, list[list[int]]]:
        ids = [engine.encode_prompt(p, chat=True) for p in batch]
        started = time.perf_counter()
        outs = hf_generate(hf, ids, args.max_tokens, pad_id)
        return time.perf_counter() - started, outs

    # Untimed warm-up of both (allocator, MKL kernels, first-call overheads).
    run_ours(prompts[:2])
    hf_generate(hf, [engine.encode_prompt(p, chat=True) for p in prompts[:2]], 8, pad_id)

    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        times = {"transformers": [], "batchspec": []}
        same = total = 0
        for trial in range(args.trials):
            batch = prompts[trial * batch_size:(trial + 1) * batch_size]
            hf_s, hf_out = run_hf(batch)
            our_s, our_out = run_ours(batch)
            times["transformers"].append(hf_s)
            times["batchspec"].append(our_s)
            same += sum(a == b for a, b in zip(hf_out, our_out))
            total += len(batch)
        tokens = batch_size * args.max_tokens
        hf_tps = tokens / statistics.median(times["transformers"])
        our_tps = tokens / statistics.median(times["batchspec"])
        rows.append({"batch_size": batch_size, "transformers_tokens_per_s": hf_tps, "batchspec_tokens_per_s": our_tps,
                     "speedup": our_tps / hf_tps, "identical_outputs": f"{same}/{total}"})

    if args.json:
        print(json.dumps({"threads": threads, "machine": machine_description(),
                          "transformers": transformers.__version__, "rows": rows}, indent=2))
        return
    print(f"target={args.target} max_tokens={args.max_tokens} trials={args.trials} threads={threads} "
          f"torch={torch.__version__} transformers={transformers.__version__}")
    print(f"machine: {machine_description()}")
    print(f"{'batch':>5} {'transformers tok/s':>19} {'batchspec tok/s':>16} {'speedup':>8} {'same output':>12}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['transformers_tokens_per_s']:>19.1f} {r['batchspec_tokens_per_s']:>16.1f} "
              f"{r['speedup']:>7.2f}x {r['identical_outputs']:>12}")


if __name__ == "__main__":
    main()
