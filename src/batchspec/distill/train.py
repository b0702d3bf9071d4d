"""The training stage of `batchspec distill`: KL to the target's top-k plus cross-entropy, AdamW, checkpoints.

`pipeline.py` builds the draft and the teacher data (`teacher_data.py`); this module trains it. A checkpoint holds
weights, AdamW moments and the step; the data order is a function of seed and step, so a resumed run continues
exactly where an interrupted one stopped.

Two things make a step cheap on a CPU. A draft with a head vocabulary (`head_vocab.py`) is trained as it is
deployed: its LM head scores only those rows, and the teacher's top-k is renormalised over the ones among them (the
full 49152-row head took 41 % of an eight-layer draft's float32 step). And `--train-dtype bfloat16` runs the matrix
products under `torch.autocast` in bfloat16 — weights, gradients and AdamW stay float32 — which on CPUs with native
bfloat16 (AVX512-BF16, AMX) is 2-3x faster than float32 (measured: an eight-layer draft, 2048 tokens per step on
2 Zen 5 cores, 2.58 -> 1.06 s with an 8192-token head; 4.38 s in float32 with the full head).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from batchspec.distill.config import DistillConfig
from batchspec.errors import BatchspecError
from batchspec.runtime.precision import resolve_dtype
from batchspec.weights.shards import save_atomically


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


def head_index(head: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """(V,) int64: each token's row in the head vocabulary `head` (sorted ids), -1 for tokens outside it."""
    if head is None:
        return None
    index = torch.full((vocab,), -1, dtype=torch.int64)
    index[head] = torch.arange(len(head))
    return index


def distill_loss(model, inputs, positions, top_ids, top_logp, ce_weight: float, head: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict]:
    """KL(renormalised teacher top-k || draft) + ce_weight * cross-entropy on the teacher's top-1.

    With a head vocabulary `head` (sorted token ids) the draft's distribution is over those rows only, as deployed:
    teacher tokens outside it are dropped from the top-k before renormalising, and count as misses in `top1`.
    `dtype` bfloat16 runs the forward under CPU autocast (softmax and losses stay float32).
    """
    weight = model.lm_head.weight if head is None else model.lm_head.weight[head]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        hidden = model.model(input_ids=inputs).last_hidden_state  # (B, L, hidden), after the final norm
        chosen = hidden[positions[:, 0], positions[:, 1]]  # (N, hidden): only response positions need the LM head
        logits = F.linear(chosen, weight)  # (N, V) or (N, len(head))
    log_q = logits.float().log_softmax(dim=-1)
    index = head_index(head, model.lm_head.weight.shape[0])
    rows = top_ids if index is None else index[top_ids]  # (N, k): columns of log_q, -1 outside the head
    inside = rows >= 0
    log_q_top = log_q.gather(1, rows.clamp_min(0))  # (N, k)
    p = top_logp.masked_fill(~inside, float("-inf")).softmax(dim=-1)  # (N, k) teacher top-k within the head
    p = torch.where(inside, p, 0.0)  # rows with no token inside the head are all zero, not NaN
    scored = inside.any(-1).float()  # positions with at least one teacher token the draft can propose
    kl = ((p * (p.clamp_min(1e-12).log() - log_q_top)).sum(-1) * scored).sum() / scored.sum().clamp_min(1)
    top_inside = inside[:, 0].float()
    ce = -(log_q_top[:, 0] * top_inside).sum() / top_inside.sum().clamp_min(1)
    choice = log_q.argmax(-1) if head is None else head[log_q.argmax(-1)]
    match = (choice == top_ids[:, 0]).float().mean()
    stats = {"kl": kl.item(), "ce": ce.item(), "top1": match.item()}
    return kl + ce_weight * ce, stats


def _lr_at(step: int, cfg: DistillConfig) -> float:
    warmup = max(1, min(100, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(work: Path, model, optimizer, step: int, log: list[dict], held_out: int) -> None:
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"adam.{key}.{names[id(p)]}"] = state[key].contiguous()
    save_atomically(tensors, work / "checkpoint.safetensors")
    (work / "checkpoint.json").write_text(json.dumps({"step": step, "log": log, "held_out": held_out}))


def held_out_count(work: Path, samples: int) -> int:
    """How many leading samples are held out: 5 % of the data training started on (checkpoints from before this
    was recorded: 5 % of the data now)."""
    checkpoint = work / "checkpoint.json"
    recorded = json.loads(checkpoint.read_text()).get("held_out") if checkpoint.is_file() else None
    return recorded if recorded is not None else max(1, samples // 20)


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
def evaluate(model, samples, indices: list[int], cfg: DistillConfig, pad_id: int, head: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32) -> dict:
    totals, count = {"kl": 0.0, "ce": 0.0, "top1": 0.0}, 0
    for start in range(0, len(indices), 8):
        batch = make_batch(samples, indices[start:start + 8], cfg.max_prompt_tokens + cfg.gen_tokens, pad_id)
        _, stats = distill_loss(model, *batch, cfg.ce_weight, head, dtype)
        n = len(batch[1])
        for key in totals:
            totals[key] += stats[key] * n
        count += n
    return {key: value / max(1, count) for key, value in totals.items()}


def train(cfg: DistillConfig, model: torch.nn.Module, samples: list[dict[str, torch.Tensor]], work: Path,
          pad_id: int, progress: bool, head: torch.Tensor | None = None) -> tuple[torch.nn.Module, list[dict]]:
    """AdamW over `cfg.steps` steps of the teacher `samples` (`teacher_data.load_samples(work / "data")`),
    resuming from `work/checkpoint.*`; returns (model, log). `head`: the draft's head vocabulary (sorted ids) or
    None for the full vocabulary.

    The first 5 % of the samples (in shard order) are held out for the logged validation KL / top-1. That count is
    fixed when training starts (kept in the checkpoint): a run resumed on more teacher data — new shards sort after
    the first ones — keeps the same held-out samples and trains on all of the new ones.
    """
    from tqdm import tqdm

    dtype = resolve_dtype(cfg.train_dtype)

    if len(samples) < 2:
        raise BatchspecError(f"too little teacher data in {work / 'data'} ({len(samples)} samples)")
    held_out = held_out_count(work, len(samples))
    val_idx, train_idx = list(range(held_out)), list(range(held_out, len(samples)))
    max_len = cfg.max_prompt_tokens + cfg.gen_tokens
    lengths = [min(max_len, len(samples[i]["prompt"]) + len(samples[i]["response"]) - 1) for i in train_idx]
    schedule = [[train_idx[j] for j in b] for b in batch_schedule(lengths, cfg.batch_tokens, cfg.steps, cfg.seed)]

    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    step, log = 0, []
    if (work / "checkpoint.json").is_file():
        step, log = load_checkpoint(work, model, optimizer)
    else:
        val = evaluate(model, samples, val_idx, cfg, pad_id, head, dtype)
        log.append({"step": 0, **{f"val_{k}": v for k, v in val.items()}})
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress)
    model.train()
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        batch = make_batch(samples, schedule[step], max_len, pad_id)
        loss, stats = distill_loss(model, *batch, cfg.ce_weight, head, dtype)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{stats['kl']:.3f}", top1=f"{stats['top1']:.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            model.eval()
            val = evaluate(model, samples, val_idx, cfg, pad_id, head, dtype)
            model.train()
            log.append({"step": step, "train_kl": stats["kl"], **{f"val_{k}": v for k, v in val.items()}})
            save_checkpoint(work, model, optimizer, step, log, held_out)
    bar.close()
    if not (work / "checkpoint.json").is_file():  # steps == 0 on a fresh run
        save_checkpoint(work, model, optimizer, step, log, held_out)
    return model.eval(), log
