"""Per draft token, SPRINTER's features and labels, from the two models' logits on the same teacher-forced text."""

from __future__ import annotations

import torch

ROWS_PER_FORWARD = 1024  # answer positions per teacher-forced forward: bounds the (rows, vocab) logits in memory


def token_features(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Draft proposal, features and labels at N positions from the two models' logits, both (N, V)."""
    log_q = draft_logits.float().log_softmax(-1)  # (N, V)
    log_p = target_logits.float().log_softmax(-1)  # (N, V)
    logq, draft_token = log_q.max(-1)  # (N,): greedy proposal d = argmax q and log q(d)
    logp = log_p.gather(1, draft_token[:, None])[:, 0]  # (N,) log p(d)
    target_argmax = log_p.argmax(-1)  # (N,)
    entropy = -torch.special.xlogy(log_q.exp(), log_q.exp()).sum(-1)  # (N,) nats; 0 log 0 = 0 (restricted heads)
    return {"draft_token": draft_token.to(torch.int32), "target_argmax": target_argmax.to(torch.int32),
            "logq": logq, "logp": logp, "entropy": entropy,
            "y_sd": (logq <= logp).to(torch.uint8), "y_greedy": (draft_token == target_argmax).to(torch.uint8)}


@torch.inference_mode()
def teacher_forced_rows(model, pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of prompt + answer[:-1] per pair: (hidden (N, H), logits (N, V)) at the N answer positions.

    Row t of a pair is the position whose next-token distribution is over answer token t (context prompt + a_<t).
    """
    seqs = [p + a[:-1] for p, a in pairs]
    num_new = torch.tensor([len(s) for s in seqs])  # (B,)
    first = torch.cumsum(num_new, 0) - num_new  # (B,) packed index of each sequence's first token
    rows = torch.cat([f + len(p) - 1 + torch.arange(len(a)) for f, (p, a) in zip(first.tolist(), pairs)])  # (N,)
    cache = model.new_cache(len(pairs), int(num_new.max()) + 1)
    out = model.forward(cache, torch.arange(len(pairs)), num_new, torch.tensor(sum(seqs, [])), logit_rows=rows)
    return out.hidden[rows.to(out.hidden.device)].float().cpu(), out.logits.cpu()


def chunk_by_rows(lengths: list[int], max_rows: int) -> list[range]:
    """Consecutive groups of items whose lengths sum to at most `max_rows` (an item alone may exceed it)."""
    groups, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > max_rows:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def shard_records(target, draft, pairs: list[tuple[list[int], list[int]]], first_index: int) -> dict:
    """Features and labels of every answer position of these (prompt ids, answer ids) pairs, as shard tensors."""
    parts = []
    for group in chunk_by_rows([len(a) for _, a in pairs], ROWS_PER_FORWARD):
        chunk = [pairs[i] for i in group]
        hidden, draft_logits = teacher_forced_rows(draft.transformer, chunk)
        _, target_logits = teacher_forced_rows(target.transformer, chunk)
        record = token_features(draft_logits, target_logits)
        record["hidden"] = hidden.half()  # (N, H)
        record["prompt_index"] = torch.cat([torch.full((len(a),), first_index + i, dtype=torch.int32)
                                            for i, (_, a) in zip(group, chunk)])
        record["position"] = torch.cat([torch.arange(len(a), dtype=torch.int32) for _, a in chunk])
        parts.append(record)
    return {name: torch.cat([p[name] for p in parts]).contiguous() for name in parts[0]}
