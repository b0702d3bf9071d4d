"""Baselines outside the project, as extra bench rows: Hugging Face transformers on the same weights and prompts.

- `hf_generate` — `model.generate` with the target alone, greedy, left-padded batches of `batch_size`;
- `hf_generate_b1` — the same, one prompt at a time;
- `hf_assisted_b1` — assisted generation (`assistant_model=` the draft, in the float type batchspec runs it in),
  batch 1 (transformers supports no other), with transformers' default assistant schedule.

Each row reports `tokens_per_s` (output tokens, EOS included as our engine counts it, / wall time of the whole
generation, prefill included — the same definition as batchspec's rows) and `match_ar`, the share of prompts whose
output equals batchspec's `ar` output, so a row that is fast but wrong is visible. Rows name the library version.
"""

from __future__ import annotations

import time

import torch

from batchspec.errors import BatchspecError
from batchspec.loading import LoadedModel

BASELINES = ("hf_generate", "hf_generate_b1", "hf_assisted_b1")


def check_baselines(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise BatchspecError(f"unknown baseline {unknown[0]!r}; valid baselines: {', '.join(BASELINES)}")


def _hf_model(model: LoadedModel):
    """The same weights in transformers, in the float type batchspec runs them in (a bfloat16 draft stays one)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no weight-loading bars or deprecation chatter in the bench output
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(str(model.model_dir), dtype=model.transformer.dtype).eval()
    hf.generation_config.eos_token_id = sorted(model.eos_token_ids) or None
    return hf


def _trim(ids: list[int], eos: frozenset[int], pad_id: int, emitted: bool) -> list[int]:
    """Cut one generated row at its first EOS (kept when counting emitted tokens, dropped for comparison)."""
    for n, token in enumerate(ids):
        if token in eos:
            return ids[:n + 1] if emitted else ids[:n]
    return ids


def _generate(hf, prompt_ids: list[list[int]], max_tokens: int, pad_id: int, assistant=None) -> list[list[int]]:
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompt_ids])  # left padding
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    extra = {"assistant_model": assistant} if assistant is not None else {}
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                          num_beams=1, pad_token_id=pad_id, **extra)
    return out[:, width:].tolist()


def run_baseline(name: str, target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[list[int]],
                 max_tokens: int, batch_size: int, reference: list[list[int]] | None, trial: int = 0,
                 loaded: dict | None = None) -> dict:
    """One baseline row over `prompt_ids` (already chat-formatted and tokenised), greedy, after a warm-up call.

    loaded: a dict that keeps the transformers models between calls (bench runs every baseline once per trial).
    """
    import transformers

    check_baselines((name,))
    if name == "hf_assisted_b1" and draft is None:
        raise BatchspecError("the hf_assisted_b1 baseline needs a draft model (--draft)")
    loaded = {} if loaded is None else loaded
    if "target" not in loaded:
        loaded["target"] = _hf_model(target)
    if name == "hf_assisted_b1" and "draft" not in loaded:
        loaded["draft"] = _hf_model(draft)
    hf, assistant = loaded["target"], loaded["draft"] if name == "hf_assisted_b1" else None
    pad_id = min(target.eos_token_ids) if target.eos_token_ids else 0
    batch = batch_size if name == "hf_generate" else 1
    _generate(hf, prompt_ids[:1], 4, pad_id, assistant)  # warm-up
    outputs = []
    started = time.perf_counter()
    for start in range(0, len(prompt_ids), batch):
        outputs += _generate(hf, prompt_ids[start:start + batch], max_tokens, pad_id, assistant)
    wall = time.perf_counter() - started
    eos = target.eos_token_ids
    emitted = sum(len(_trim(row, eos, pad_id, emitted=True)) for row in outputs)
    row = {"policy": name, "library": f"transformers {transformers.__version__}", "batch_size": batch,
           "num_prompts": len(prompt_ids), "emitted_tokens": emitted, "wall_s": wall,
           "tokens_per_s": emitted / wall if wall else 0.0, "trial": trial}
    if reference is not None:
        mine = [_trim(r, eos, pad_id, emitted=False) for r in outputs]
        row["match_ar"] = sum(a == b for a, b in zip(mine, reference)) / len(mine)
    return row
