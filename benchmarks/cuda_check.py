"""The runtime on a CUDA GPU, checked in one run: logits against the CPU, greedy equality of every lossless policy
with `ar`, and tokens/s at batch 1, 16 and 64, on the shapes of both pairs.

    python benchmarks/cuda_check.py --models DIR [--out results.json]

DIR holds one folder per model of the two pairs (SmolLM2-135M + its shipped draft, Qwen2.5-Coder 1.5B + 0.5B) with
its config.json, tokenizer files and, for the shipped draft, its head vocabulary, but no weights: the machines with a
GPU this project is lent take a 64 MiB working tree and reach no network, so the weights cannot travel. The script
writes random weights in each model's real shape (same sizes, so the same time per forward) and loads them through
the runtime's own loader onto the GPU. Random weights make random text, so the acceptance rate is set by
construction, and stated beside every figure: the draft's layers are drawn small enough (`--draft-std`) that its next
token is its last one (its residual stream stays near the embedding of the input token, which is also its head),
and the target's at the scale (from `--target-stds`) whose copy rate on random tokens is nearest `--copy-rate`; the
draft then agrees with the target about that often. Tokens/s of the speculative policies are therefore the engine's
costs on real shapes at that acceptance, not a claim about the real models.

Printed and written to --out: per model and dtype, the largest |logit| difference CUDA vs CPU and the share of
equal argmaxes; per pair, batch size and policy, tokens/s, target calls, mean accepted length and whether every
output equals `ar`'s token for token. Not part of CI (CI has no GPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchspec.engine.engine import Engine
from batchspec.runtime.config import ModelConfig
from batchspec.runtime.sampling import SamplingParams
from batchspec.runtime.threads import configure_threads
from batchspec.spec.config import SpecConfig
from batchspec.weights.loading import load_model

PAIRS = {"qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
         "smollm2": ("smollm2-135m-instruct", "draft-smollm2-135m")}
POLICIES = (("ar", {}), ("sd", {}), ("dsd", {}), ("tetris", {}), ("tetris_auto", {"capacity": "auto"}))
WEIGHT_FILE = "model.safetensors"


def log(message: str) -> None:
    print(message, flush=True)


def random_weights(config: ModelConfig, seed: int, layer_std: float, device: str) -> dict[str, torch.Tensor]:
    """HF-named bfloat16 tensors of `config`'s shapes: N(0, 0.02) embedding, N(0, layer_std) layer matrices, unit
    norms, zero biases (tied head: the embedding)."""
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": normal(c.vocab_size, c.hidden_size, std=0.02),
         "model.norm.weight": torch.ones(c.hidden_size, dtype=torch.bfloat16, device=device)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, c.hidden_size)), ("self_attn.k_proj", (kv, c.hidden_size)),
                            ("self_attn.v_proj", (kv, c.hidden_size)), ("self_attn.o_proj", (c.hidden_size, q)),
                            ("mlp.gate_proj", (c.intermediate_size, c.hidden_size)),
                            ("mlp.up_proj", (c.intermediate_size, c.hidden_size)),
                            ("mlp.down_proj", (c.hidden_size, c.intermediate_size))):
            w[p + name + ".weight"] = normal(*shape, std=layer_std)
        if c.attention_bias:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = torch.zeros(size, dtype=torch.bfloat16, device=device)
        for name in ("input_layernorm", "post_attention_layernorm"):
            w[p + name + ".weight"] = torch.ones(c.hidden_size, dtype=torch.bfloat16, device=device)
    return w


def copy_rate(config: ModelConfig, layer_std: float, device: str) -> float:
    """Share of random tokens whose greedy next token, under random weights of this scale, is the token itself."""
    from batchspec.runtime.model import Transformer

    model = Transformer.from_hf_state_dict(config, random_weights(config, 0, layer_std, device), consume=True)
    cache = model.new_cache(8, 64)
    tokens = torch.randint(0, config.vocab_size, (8 * 32,), generator=torch.Generator().manual_seed(1))
    out = model.forward(cache, torch.arange(8), torch.full((8,), 32), tokens)
    return float((out.logits.argmax(-1).cpu() == tokens).float().mean())


def write_model(source: Path, out: Path, layer_std: float, seed: int, device: str) -> Path:
    """`source`'s files (config, tokenizer) with random weights of `layer_std`, as a model directory."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out)
    config = ModelConfig.from_file(out / "config.json")
    weights = random_weights(config, seed, layer_std, device)
    save_file({name: t.cpu().contiguous() for name, t in weights.items()}, out / WEIGHT_FILE)
    return out


def logits_check(model_dir: Path, dtype: str, device: str) -> dict:
    """One ragged prefill of four prompts (7, 33, 64, 120 tokens), then a decode step: CUDA against the CPU."""
    outs = {}
    generator = torch.Generator().manual_seed(2)
    lengths = torch.tensor([7, 33, 64, 120])
    vocab = ModelConfig.from_file(model_dir / "config.json").vocab_size
    prompt = torch.randint(0, vocab, (int(lengths.sum()),), generator=generator)
    step = torch.randint(0, vocab, (4,), generator=generator)
    for where in ("cpu", device):
        model = load_model(model_dir, dtype=dtype, device=where, full_head=True).transformer
        cache = model.new_cache(4, 160)
        slots = torch.arange(4)
        first = model.forward(cache, slots, lengths, prompt).logits.cpu()
        second = model.forward(cache, slots, torch.ones(4, dtype=torch.int64), step).logits.cpu()
        outs[where] = torch.cat([first, second])
        del model, cache
    cpu, gpu = outs["cpu"], outs[device]
    return {"model": model_dir.name, "dtype": dtype, "rows": cpu.shape[0],
            "max_abs_diff": float((cpu - gpu).abs().max()), "max_abs_logit": float(cpu.abs().max()),
            "argmax_equal": float((cpu.argmax(-1) == gpu.argmax(-1)).float().mean())}


def bench_pair(target_dir: Path, draft_dir: Path, prompts: list[str], batch_sizes: list[int], max_tokens: int,
               target_dtype: str, device: str) -> list[dict]:
    target = load_model(target_dir, dtype=target_dtype, device=device)
    draft = load_model(draft_dir, dtype="bfloat16", device=device)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for batch in batch_sizes:
        chosen = prompts[:max(4, batch)]
        reference = None
        for name, extra in POLICIES:
            policy = "tetris" if name == "tetris_auto" else name
            engine = Engine(target, draft if policy != "ar" else None, spec=SpecConfig(policy=policy, k=4, **extra),
                            max_batch_size=batch)
            engine.generate(chosen[:min(len(chosen), batch)], params, chat=True)  # warm-up (and profiling)
            started = time.perf_counter()
            outputs = engine.generate(chosen, params, chat=True)
            wall = time.perf_counter() - started
            stats = engine.metrics()
            ids = [o.token_ids for o in outputs]
            reference = ids if name == "ar" else reference
            row = {"target": target_dir.name, "target_dtype": target_dtype, "batch": batch, "policy": name,
                   "prompts": len(chosen), "tokens_per_s": stats["tokens_per_s"], "wall_s": round(wall, 3),
                   "target_calls": stats["target_calls"], "mean_accept_len": stats["mean_accept_len"],
                   "match_ar": ids == reference}
            rows.append(row)
            log(json.dumps(row))
        if batch == max(batch_sizes):  # the sampling path on the GPU (seeded; its distribution is the CPU tests')
            sampled = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.7, seed=0)
            for policy in ("ar", "sd", "tetris"):
                engine = Engine(target, draft if policy != "ar" else None, spec=SpecConfig(policy=policy, k=4),
                                max_batch_size=batch)
                engine.generate(chosen, sampled, chat=True)
                row = {"target": target_dir.name, "target_dtype": target_dtype, "batch": batch,
                       "policy": policy, "temperature": 0.7, "prompts": len(chosen),
                       "tokens_per_s": engine.metrics()["tokens_per_s"],
                       "mean_accept_len": engine.metrics()["mean_accept_len"], "match_ar": None}
                rows.append(row)
                log(json.dumps(row))
    if device == "cuda":
        log(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        torch.cuda.reset_peak_memory_stats()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="folder of the four models' files (no weights)")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of prompt texts (64 or more)")
    parser.add_argument("--out", type=Path, default=Path("cuda_check.json"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/cuda_check"))
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--copy-rate", type=float, default=0.7)
    parser.add_argument("--target-stds", default=",".join(f"{0.003 + 0.0005 * i:.4f}" for i in range(19)))
    parser.add_argument("--draft-std", type=float, default=0.002)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script without a GPU")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: this PyTorch build sees no CUDA GPU", file=sys.stderr)
        return 1
    configure_threads()  # the CPU side of the logits check
    prompts = json.loads(args.prompts.read_text())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "none (dry run)",
              "torch": torch.__version__, "logits": [], "runs": [], "scales": {}}
    log(f"{result['gpu']}, torch {result['torch']}")
    for pair in args.pairs.split(","):
        target_name, draft_name = PAIRS[pair]
        started = time.perf_counter()
        config = ModelConfig.from_file(args.models / target_name / "config.json")
        stds = [float(s) for s in args.target_stds.split(",")]
        rates = {std: copy_rate(config, std, device) for std in stds}
        std = min(rates, key=lambda s: abs(rates[s] - args.copy_rate))
        result["scales"][pair] = {"target_copy_rates": rates, "target_std": std, "draft_std": args.draft_std}
        log(f"{pair}: target copy rate by layer std {rates}: {std}")
        target_dir = write_model(args.models / target_name, args.work / target_name, std, 0, device)
        draft_dir = write_model(args.models / draft_name, args.work / draft_name, args.draft_std, 1, device)
        log(f"{pair}: weights written in {time.perf_counter() - started:.1f} s")
        for model_dir, dtypes in ((target_dir, ("float32", "bfloat16")), (draft_dir, ("bfloat16",))):
            for dtype in dtypes:
                row = logits_check(model_dir, dtype, device)
                result["logits"].append(row)
                log(json.dumps(row))
        for dtype in ("bfloat16",) if pair == "qwen" else ("bfloat16", "float32"):
            result["runs"] += bench_pair(target_dir, draft_dir, prompts, batch_sizes, args.max_tokens, dtype,
                                         device)
            args.out.write_text(json.dumps(result, indent=1))
        log(f"{pair}: done in {time.perf_counter() - started:.1f} s")
    args.out.write_text(json.dumps(result, indent=1))
    greedy = [r for r in result["runs"] if r["match_ar"] is not None]
    mismatches = [r for r in greedy if not r["match_ar"]]
    log(f"match_ar: {len(greedy) - len(mismatches)} of {len(greedy)} greedy runs")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
