"""`batchspec distill`: train a small draft model that imitates the target's next-token distributions.

Three resumable stages, all under `OUT/work/`:

1. prompts — real text shipped on this machine: functions of the Python standard library (signature + docstring,
   or source), turned into chat requests ("Complete the following Python function", "Write a Python function that
   ...", "Explain ..."). HumanEval, the held-out benchmark, is never read.
2. teacher data — the target answers every prompt (mostly greedy, some sampled) with its own batched decode loop
   over the native runtime; the logits that chose each response token are the teacher's distribution at that
   position, so they cost nothing extra: we keep their top-k log-probs (fp16 + int32 ids) in shards of
   `--shard-size` prompts, skipped on resume.
3. training — a Llama-architecture draft (the target's tokenizer, tied embeddings initialised from the top singular
   directions of the target's embedding) is trained with AdamW on KL(target top-k || draft) plus cross-entropy on
   the target's top-1, over response positions. Checkpoints (weights + AdamW moments + step; the data order is a
   function of seed and step) are safetensors, so `--resume` continues exactly.

The result is an ordinary HF-format directory (`config.json`, float16 `model.safetensors`, tokenizer files) that
`load_model` runs like any other Llama checkpoint.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import shutil
import sys
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from batchspec.errors import BatchspecError

@dataclass(frozen=True)
class DistillConfig:
    target: str = "default"
    num_prompts: int = 160
    gen_tokens: int = 160
    shard_size: int = 32  # prompts per teacher-data shard = generation batch size
    sample_fraction: float = 0.2  # share of prompts answered at temperature 1 instead of greedily
    forced_prompts: int = 192  # extra samples: stdlib functions as the answer, teacher-forced (no generation)
    top_k: int = 32  # teacher log-probs kept per position
    max_prompt_tokens: int = 384
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 1
    intermediate: int = 768
    steps: int = 160
    batch_tokens: int = 2048  # input tokens per optimiser step (prompt + response)
    lr: float = 2e-3
    weight_decay: float = 0.01
    ce_weight: float = 0.25
    save_every: int = 50
    seed: int = 0


# --- 1. prompts from the standard library ----------------------------------------------------------------------

SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts)]
    return sorted(files)


def _function_prompts(source: str) -> list[tuple[str, str]]:
    """(kind, text) candidates from one module: signature + docstring, a one-line task, or the source to explain."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        body = node.body[0]
        if not doc or len(doc) < 40 or not isinstance(body, ast.Expr):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        head = textwrap.dedent("\n".join(lines[start:body.end_lineno])) + "\n"
        if "self" in head.split(")", 1)[0]:
            head = head.replace("self, ", "").replace("(self)", "()")  # methods read as plain functions
        out.append(("complete", head))
        summary = " ".join(doc.split("\n\n")[0].split())
        signature = head.split(":\n", 1)[0].removeprefix("def ").removeprefix("async def ")
        out.append(("write", f"Write a Python function `{signature}` that does the following: {summary}"))
        whole = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
        if len(whole) < 1500:
            out.append(("explain", whole))
    return out


POOL_SIZE = 3000  # candidates gathered before choosing; fixed so that prompts[:n] does not depend on the count


def build_prompts(count: int, seed: int, pool_size: int = POOL_SIZE) -> list[str]:
    """`count` chat requests from standard-library functions, deterministic in `seed`.

    Prefix-stable: the first n prompts are the same for every count >= n (up to POOL_SIZE / 2), so a resumed run
    may ask for more or fewer prompts and keep the teacher data already generated.
    """
    rng = random.Random(seed)
    files = stdlib_files()
    rng.shuffle(files)
    pool: list[tuple[str, str]] = []
    for path in files:  # parse only as many modules as needed
        try:
            pool += _function_prompts(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(pool) >= max(pool_size, 4 * count):
            break
    rng.shuffle(pool)
    wrap = {
        "complete": lambda t: f"Complete the following Python function.\n\n```python\n{t}```",
        "write": lambda t: t,
        "explain": lambda t: f"Explain what the following Python function does.\n\n```python\n{t}\n```",
    }
    per_kind = {k: [t for kind, t in pool if kind == k] for k in wrap}
    # Mostly completion requests: the serving workload the draft is meant for is code completion.
    kinds, weights = ["complete", "write", "explain"], [0.6, 0.25, 0.15]
    chosen, seen = [], set()
    while len(chosen) < count and any(per_kind.values()):
        kind = rng.choices(kinds, weights)[0]
        if per_kind[kind]:
            text = wrap[kind](per_kind[kind].pop())
            if text not in seen:
                seen.add(text)
                chosen.append(text)
    if len(chosen) < count:
        raise BatchspecError(f"only {len(chosen)} prompts found in the standard library, {count} requested")
    return chosen


def build_forced_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """(request, answer) pairs whose answer is the real function: "Complete ..." -> the function's source."""
    rng = random.Random(seed + 2)
    files = stdlib_files()
    rng.shuffle(files)
    pairs: list[tuple[str, str]] = []
    for path in files:
        try:
            candidates = _function_prompts(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        heads = [t for kind, t in candidates if kind == "complete"]
        bodies = [t for kind, t in candidates if kind == "explain"]
        for head in heads:  # a function whose source is short enough appears in both lists, in order
            source = next((b for b in bodies if b.startswith(head.rstrip("\n"))), None)
            if source is not None:
                pairs.append((f"Complete the following Python function.\n\n```python\n{head}```",
                              f"```python\n{source}\n```"))
        if len(pairs) >= 2 * count:
            break
    rng.shuffle(pairs)
    return pairs[:count]


# --- 2. teacher data: the target's answers and its top-k log-probs -----------------------------------------------


@torch.inference_mode()
def teacher_generate(target, prompt_ids: list[list[int]], max_new: int, temperatures: list[float], top_k: int,
                     seed: int) -> list[dict[str, torch.Tensor]]:
    """Decode a batch with the runtime; record the top-k log-probs of the distribution behind every new token."""
    model, eos = target.transformer, target.eos_token_ids
    batch = len(prompt_ids)
    cache = model.new_cache(batch, max(len(p) for p in prompt_ids) + max_new + 1)
    generator = torch.Generator().manual_seed(seed)
    temps = torch.tensor(temperatures)  # (B,)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    ids_log: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    logp_log: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    active = list(range(batch))
    num_new = torch.tensor([len(p) for p in prompt_ids])
    logits = model.forward(cache, torch.arange(batch), num_new, torch.tensor(sum(prompt_ids, [])),
                           logit_rows=torch.cumsum(num_new, 0) - 1).logits  # (B, V)
    for _ in range(max_new):
        logp = logits.log_softmax(dim=-1)  # (A, V)
        top_logp, top_ids = logp.topk(top_k, dim=-1)  # (A, k)
        temp = temps[active]
        sampled = torch.multinomial((logp / temp.clamp(min=1e-6)[:, None]).softmax(-1), 1, generator=generator)
        tokens = torch.where(temp > 0, sampled[:, 0], top_ids[:, 0])  # (A,)
        still = []
        for row, request in enumerate(active):
            token = int(tokens[row])
            outputs[request].append(token)
            ids_log[request].append(top_ids[row].to(torch.int32))
            logp_log[request].append(top_logp[row].half())
            if token not in eos and len(outputs[request]) < max_new:
                still.append(request)
        active = still
        if not active:
            break
        ones = torch.ones(len(active), dtype=torch.int64)
        logits = model.forward(cache, torch.tensor(active), ones, torch.tensor([outputs[r][-1] for r in active]),
                               logit_rows=torch.arange(len(active))).logits
    return [{"prompt": torch.tensor(prompt_ids[i], dtype=torch.int32),
             "response": torch.tensor(outputs[i], dtype=torch.int32),
             "top_ids": torch.stack(ids_log[i]), "top_logp": torch.stack(logp_log[i])} for i in range(batch)]


@torch.inference_mode()
def teacher_force(target, pairs: list[tuple[list[int], list[int]]], top_k: int) -> list[dict[str, torch.Tensor]]:
    """One prefill over (prompt, given answer) pairs: the target's top-k log-probs at every answer position."""
    model = target.transformer
    seqs = [p + a[:-1] for p, a in pairs]
    cache = model.new_cache(len(pairs), max(len(s) for s in seqs) + 1)
    num_new = torch.tensor([len(s) for s in seqs])
    first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each sequence's first token
    rows = torch.cat([f + len(p) - 1 + torch.arange(len(a)) for f, (p, a) in zip(first.tolist(), pairs)])
    logp = model.forward(cache, torch.arange(len(pairs)), num_new, torch.tensor(sum(seqs, [])),
                         logit_rows=rows).logits.log_softmax(-1)  # (N, V)
    top_logp, top_ids = logp.topk(top_k, dim=-1)
    out = []
    for (p, a), ids, lp in zip(pairs, top_ids.split([len(a) for _, a in pairs]),
                               top_logp.split([len(a) for _, a in pairs])):
        out.append({"prompt": torch.tensor(p, dtype=torch.int32), "response": torch.tensor(a, dtype=torch.int32),
                    "top_ids": ids.to(torch.int32), "top_logp": lp.half()})
    return out


def _save_shard(path: Path, samples: list[dict[str, torch.Tensor]]) -> None:
    tensors = {f"{i}.{name}": t.contiguous() for i, s in enumerate(samples) for name, t in s.items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp)
    tmp.rename(path)  # a shard exists completely or not at all: resume never sees half a shard


def load_samples(data_dir: Path) -> list[dict[str, torch.Tensor]]:
    samples = []
    for shard in sorted(data_dir.glob("shard-*.safetensors")):
        tensors = load_file(shard)
        for i in range(len({k.split(".")[0] for k in tensors})):
            samples.append({n: tensors[f"{i}.{n}"] for n in ("prompt", "response", "top_ids", "top_logp")})
    return samples


def make_teacher_data(cfg: DistillConfig, target, work: Path, progress: bool,
                      prompts: list[str] | None = None) -> Path:
    from tqdm import tqdm

    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(cfg.num_prompts, cfg.seed) if prompts is None else prompts[:cfg.num_prompts]
    tok = target.tokenizer
    # Prompts are clipped so that prompt + answer fits the target's context.
    prompt_limit = min(cfg.max_prompt_tokens, target.config.max_position_embeddings - cfg.gen_tokens - 1)
    if prompt_limit < 8:
        raise BatchspecError(f"--gen-tokens {cfg.gen_tokens} leaves no room for prompts in the target's context "
                             f"of {target.config.max_position_embeddings} tokens")
    encoded = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))[:prompt_limit]
               for p in prompts]
    rng = random.Random(cfg.seed + 1)
    temperatures = [1.0 if rng.random() < cfg.sample_fraction else 0.0 for _ in prompts]
    shards = range(math.ceil(len(prompts) / cfg.shard_size))
    bar = tqdm(shards, desc="teacher data", unit="shard", disable=not progress)
    for index in bar:
        path = data_dir / f"shard-{index:05d}.safetensors"
        if path.is_file():
            continue
        part = slice(index * cfg.shard_size, (index + 1) * cfg.shard_size)
        samples = teacher_generate(target, encoded[part], cfg.gen_tokens, temperatures[part], cfg.top_k,
                                   seed=cfg.seed * 7919 + index)
        _save_shard(path, samples)
    if cfg.forced_prompts:
        eos = tok.eos_token or ""
        pairs = [(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])), tok.encode(a + eos))
                 for q, a in build_forced_pairs(cfg.forced_prompts, cfg.seed)]
        pairs = [(q[:prompt_limit], a[:cfg.gen_tokens]) for q, a in pairs]
        per_shard = max(1, cfg.shard_size // 4)  # ~4x longer sequences per forward than a decode step
        for index in tqdm(range(math.ceil(len(pairs) / per_shard)), desc="teacher-forced data", unit="shard",
                          disable=not progress):
            path = data_dir / f"shard-forced-{index:05d}.safetensors"
            if not path.is_file():
                _save_shard(path, teacher_force(target, pairs[index * per_shard:(index + 1) * per_shard],
                                                cfg.top_k))
    return data_dir


# --- 3. the draft model and its training -------------------------------------------------------------------------


def draft_hf_config(cfg: DistillConfig, target_config):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": target_config.rope_theta},
        bos_token_id=target_config.bos_token_id,
        eos_token_id=list(target_config.eos_token_ids) or None,
    )


def init_draft(cfg: DistillConfig, target) -> torch.nn.Module:
    """Random layers; embedding = the target's embedding projected on its top `hidden` singular directions."""
    from transformers import LlamaForCausalLM

    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise BatchspecError(f"--hidden {cfg.hidden} must divide into --heads {cfg.heads}, "
                             f"which must be a multiple of --kv-heads {cfg.kv_heads}")
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(draft_hf_config(cfg, target.config)).float()
    embed = target.transformer.embed.float()  # (V, H_target)
    if cfg.hidden <= embed.shape[1]:
        _, _, vh = torch.linalg.svd(embed, full_matrices=False)  # vh (H_target, H_target)
        projected = embed @ vh[:cfg.hidden].T  # (V, hidden): keeps the directions that separate tokens most
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(projected)
    return model


def batch_schedule(lengths: list[int], batch_tokens: int, steps: int, seed: int) -> list[list[int]]:
    """Sample indices per step: epochs of seeded permutations packed into batches of <= batch_tokens tokens."""
    schedule: list[list[int]] = []
    epoch = 0
    while len(schedule) < steps:
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        current, longest = [], 0
        for i in order:
            longest_if = max(longest, lengths[i])
            if current and longest_if * (len(current) + 1) > batch_tokens:
                schedule.append(current)
                current, longest_if = [], lengths[i]
            current.append(i)
            longest = longest_if
        schedule.append(current)
        epoch += 1
    return schedule[:steps]


def make_batch(samples, indices: list[int], max_len: int, pad_id: int):
    """Right-padded inputs (B, L) and the response positions with their teacher top-k (N, k)."""
    rows, positions, top_ids, top_logp = [], [], [], []
    for b, i in enumerate(indices):
        s = samples[i]
        seq = torch.cat([s["prompt"], s["response"]]).long()[:max_len + 1]
        inputs = seq[:-1]  # position p predicts seq[p + 1]
        first = len(s["prompt"]) - 1  # the position that predicts response token 0
        n = min(len(s["response"]), len(inputs) - first)
        rows.append(inputs)
        positions.append(torch.stack([torch.full((n,), b), torch.arange(first, first + n)], 1))
        top_ids.append(s["top_ids"][:n].long())
        top_logp.append(s["top_logp"][:n].float())
    length = max(len(r) for r in rows)
    inputs = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for b, r in enumerate(rows):
        inputs[b, :len(r)] = r  # right padding is invisible to earlier positions under a causal mask
    return inputs, torch.cat(positions), torch.cat(top_ids), torch.cat(top_logp)


def distill_loss(model, inputs, positions, top_ids, top_logp, ce_weight: float) -> tuple[torch.Tensor, dict]:
    """KL(renormalised teacher top-k || draft) + ce_weight * cross-entropy on the teacher's top-1."""
    hidden = model.model(input_ids=inputs).last_hidden_state  # (B, L, hidden), after the final norm
    chosen = hidden[positions[:, 0], positions[:, 1]]  # (N, hidden): only response positions need the LM head
    log_q = F.linear(chosen, model.model.embed_tokens.weight).log_softmax(dim=-1)  # (N, V)
    log_q_top = log_q.gather(1, top_ids)  # (N, k)
    p = top_logp.softmax(dim=-1)  # (N, k) renormalised teacher top-k
    kl = (p * (p.clamp_min(1e-12).log() - log_q_top)).sum(-1).mean()
    ce = -log_q_top[:, 0].mean()
    match = (log_q.argmax(-1) == top_ids[:, 0]).float().mean()
    stats = {"kl": kl.item(), "ce": ce.item(), "top1": match.item()}
    return kl + ce_weight * ce, stats


def _lr_at(step: int, cfg: DistillConfig) -> float:
    warmup = max(1, min(100, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(work: Path, model, optimizer, step: int, log: list[dict]) -> None:
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"adam.{key}.{names[id(p)]}"] = state[key].contiguous()
    tmp = work / "checkpoint.tmp"
    save_file(tensors, tmp)
    tmp.rename(work / "checkpoint.safetensors")
    (work / "checkpoint.json").write_text(json.dumps({"step": step, "log": log}))


def load_checkpoint(work: Path, model, optimizer) -> tuple[int, list[dict]]:
    meta = json.loads((work / "checkpoint.json").read_text())
    tensors = load_file(work / "checkpoint.safetensors")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
            if f"adam.exp_avg.{n}" in tensors:
                optimizer.state[p] = {"step": torch.tensor(float(meta["step"])),
                                      "exp_avg": tensors[f"adam.exp_avg.{n}"],
                                      "exp_avg_sq": tensors[f"adam.exp_avg_sq.{n}"]}
    return meta["step"], meta["log"]


@torch.no_grad()
def evaluate(model, samples, indices: list[int], cfg: DistillConfig, pad_id: int) -> dict:
    totals, count = {"kl": 0.0, "ce": 0.0, "top1": 0.0}, 0
    for start in range(0, len(indices), 8):
        batch = make_batch(samples, indices[start:start + 8], cfg.max_prompt_tokens + cfg.gen_tokens, pad_id)
        _, stats = distill_loss(model, *batch, cfg.ce_weight)
        n = len(batch[1])
        for key in totals:
            totals[key] += stats[key] * n
        count += n
    return {key: value / max(1, count) for key, value in totals.items()}


def train(cfg: DistillConfig, target, work: Path, progress: bool) -> tuple[torch.nn.Module, list[dict]]:
    from tqdm import tqdm

    samples = load_samples(work / "data")
    if len(samples) < 2:
        raise BatchspecError(f"too little teacher data in {work / 'data'} ({len(samples)} samples)")
    held_out = max(1, len(samples) // 20)
    val_idx, train_idx = list(range(held_out)), list(range(held_out, len(samples)))
    max_len = cfg.max_prompt_tokens + cfg.gen_tokens
    lengths = [min(max_len, len(samples[i]["prompt"]) + len(samples[i]["response"]) - 1) for i in train_idx]
    schedule = [[train_idx[j] for j in b] for b in batch_schedule(lengths, cfg.batch_tokens, cfg.steps, cfg.seed)]
    pad_id = target.tokenizer.eos_token_id or 0

    model = init_draft(cfg, target)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    step, log = 0, []
    if (work / "checkpoint.json").is_file():
        step, log = load_checkpoint(work, model, optimizer)
    else:
        log.append({"step": 0, **{f"val_{k}": v for k, v in evaluate(model, samples, val_idx, cfg, pad_id).items()}})
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress)
    model.train()
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss, stats = distill_loss(model, *make_batch(samples, schedule[step], max_len, pad_id), cfg.ce_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{stats['kl']:.3f}", top1=f"{stats['top1']:.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            model.eval()
            val = evaluate(model, samples, val_idx, cfg, pad_id)
            model.train()
            log.append({"step": step, "train_kl": stats["kl"], **{f"val_{k}": v for k, v in val.items()}})
            save_checkpoint(work, model, optimizer, step, log)
    bar.close()
    if not (work / "checkpoint.json").is_file():  # steps == 0 on a fresh run
        save_checkpoint(work, model, optimizer, step, log)
    return model.eval(), log


def export_draft(model, cfg: DistillConfig, target, out: Path) -> Path:
    """Write an HF-format Llama directory the runtime loads: float16 weights (tied head), config, tokenizer."""
    from batchspec.config import ModelConfig
    from batchspec.loading import TOKENIZER_FILES

    tc = target.config
    config = ModelConfig(model_type="llama", vocab_size=tc.vocab_size, hidden_size=cfg.hidden,
                         intermediate_size=cfg.intermediate, num_layers=cfg.layers, num_heads=cfg.heads,
                         num_kv_heads=cfg.kv_heads, head_dim=cfg.hidden // cfg.heads,
                         max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                         rope_theta=tc.rope_theta, tie_word_embeddings=True, bos_token_id=tc.bos_token_id,
                         eos_token_ids=tc.eos_token_ids)
    raw = config.to_hf_dict()
    raw["torch_dtype"] = "float16"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    weights = {n: p.detach().half().contiguous() for n, p in model.state_dict().items() if n != "lm_head.weight"}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt", "source": "batchspec distill"})
    for name in TOKENIZER_FILES:
        if (target.model_dir / name).is_file():
            shutil.copy(target.model_dir / name, out / name)
    return out


# --- command line ------------------------------------------------------------------------------------------------


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    d = DistillConfig()
    p = subparsers.add_parser(
        "distill", help="train a small draft model for a target by distillation",
        description="Generate teacher data with the target from standard-library prompts (never HumanEval), then "
                    "train a small Llama draft on the target's top-k distributions. Resumable (--resume).")
    p.add_argument("--target", default="default", help="target model: 'default', a GGUF file or an HF directory")
    p.add_argument("--out", required=True, help="output directory: the draft model, plus work/ (data, checkpoints)")
    add = p.add_argument
    add("--num-prompts", type=int, default=d.num_prompts, help=f"prompts answered by the target ({d.num_prompts})")
    add("--gen-tokens", type=int, default=d.gen_tokens, help=f"max response tokens per prompt ({d.gen_tokens})")
    add("--shard-size", type=int, default=d.shard_size, help=f"prompts per generation batch/shard ({d.shard_size})")
    add("--forced-prompts", type=int, default=d.forced_prompts,
        help=f"extra teacher-forced samples: stdlib functions as answers, no generation ({d.forced_prompts})")
    add("--top-k", type=int, default=d.top_k, help=f"teacher log-probs kept per position ({d.top_k})")
    add("--sample-fraction", type=float, default=d.sample_fraction,
        help=f"share of prompts answered at temperature 1 rather than greedily ({d.sample_fraction})")
    add("--hidden", type=int, default=d.hidden, help=f"draft hidden size ({d.hidden})")
    add("--layers", type=int, default=d.layers, help=f"draft layers ({d.layers})")
    add("--heads", type=int, default=d.heads, help=f"draft attention heads ({d.heads})")
    add("--kv-heads", type=int, default=d.kv_heads, help=f"draft key/value heads ({d.kv_heads})")
    add("--intermediate", type=int, default=d.intermediate, help=f"draft MLP size ({d.intermediate})")
    add("--steps", type=int, default=d.steps, help=f"optimiser steps ({d.steps})")
    add("--batch-tokens", type=int, default=d.batch_tokens, help=f"tokens per step ({d.batch_tokens})")
    add("--lr", type=float, default=d.lr, help=f"peak learning rate ({d.lr})")
    add("--ce-weight", type=float, default=d.ce_weight, help=f"weight of the top-1 cross-entropy ({d.ce_weight})")
    add("--save-every", type=int, default=d.save_every, help=f"checkpoint every N steps ({d.save_every})")
    add("--seed", type=int, default=d.seed, help=f"random seed ({d.seed})")
    add("--threads", type=int, default=None, help="torch threads (default: all cores)")
    add("--resume", action="store_true", help="continue an interrupted run in --out")
    add("--data-only", action="store_true", help="stop after generating the teacher data")
    add("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(run=cmd_distill)
    return p


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    fields = DistillConfig.__dataclass_fields__
    cfg = DistillConfig(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    for name in ("num_prompts", "gen_tokens", "shard_size", "top_k", "hidden", "layers", "heads", "kv_heads",
                 "intermediate", "batch_tokens", "save_every"):
        if getattr(cfg, name) < 1:
            raise BatchspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.steps < 0 or cfg.lr <= 0 or not 0 <= cfg.sample_fraction <= 1:
        raise BatchspecError("--steps must be >= 0, --lr > 0 and --sample-fraction in [0, 1]")
    return cfg


TRAINING_FIELDS = {"hidden", "layers", "heads", "kv_heads", "intermediate", "batch_tokens", "lr", "weight_decay",
                   "ce_weight"}


def run_distill(cfg: DistillConfig, out: Path, resume: bool = False, progress: bool = False,
                data_only: bool = False, prompts: list[str] | None = None) -> dict:
    """The library entry point: all three stages, then export. Returns a summary (also written to work/).

    `prompts` replaces the standard-library prompts (user data; tests use a handful).
    """
    from batchspec.loading import load_model

    work = out / "work"
    settings = work / "settings.json"
    if settings.is_file():
        if not resume:
            raise BatchspecError(f"{out} already holds a distillation run; pass --resume to continue it "
                                 "or choose another --out")
        old = json.loads(settings.read_text())
        free = {"steps", "save_every", "num_prompts", "forced_prompts"}  # may change on resume (prompts are prefix-stable)
        if not (work / "checkpoint.json").is_file():
            free |= TRAINING_FIELDS  # no training yet: only the teacher data must stay consistent
        changed = {k for k in old if k not in free and old[k] != asdict(cfg).get(k)}
        if changed:
            raise BatchspecError(f"--resume with different settings than the run in {out}: {sorted(changed)}")
    work.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(asdict(cfg), indent=2))
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target)
    if cfg.top_k > target.config.vocab_size:
        raise BatchspecError(f"--top-k {cfg.top_k} exceeds the vocabulary ({target.config.vocab_size})")
    make_teacher_data(cfg, target, work, progress, prompts)
    data_s = time.perf_counter() - started
    if data_only:
        return {"config": asdict(cfg), "data_s": data_s, "log": []}
    model, log = train(cfg, target, work, progress)
    export_draft(model, cfg, target, out)
    summary = {"config": asdict(cfg), "data_s": data_s, "total_s": time.perf_counter() - started,
               "samples": len(load_samples(work / "data")),
               "parameters": sum(p.numel() for p in model.parameters()), "log": log}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def cmd_distill(args: argparse.Namespace) -> int:
    from batchspec.engine import configure_threads

    cfg = config_from_args(args)
    configure_threads(args.threads)
    out = Path(args.out).expanduser()
    progress = not args.no_progress and sys.stderr.isatty()
    summary = run_distill(cfg, out, resume=args.resume, progress=progress, data_only=args.data_only)
    if args.data_only:
        print(f"teacher data in {out / 'work' / 'data'} ({summary['data_s'] / 60:.1f} min)")
        return 0
    first, last = summary["log"][0], summary["log"][-1]
    print(f"draft written to {out} ({summary['parameters'] / 1e6:.1f} M parameters, {cfg.steps} steps, "
          f"{summary['total_s'] / 60:.1f} min): held-out KL {first['val_kl']:.3f} -> {last['val_kl']:.3f}, "
          f"top-1 agreement {first['val_top1']:.3f} -> {last['val_top1']:.3f}")
    return 0
