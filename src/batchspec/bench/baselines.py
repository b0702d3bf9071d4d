"""Baselines outside the project, as extra bench rows: Hugging Face transformers on the same weights and prompts,
and llama.cpp on the GGUF file the target was converted from.

- `hf_generate` — `model.generate` with the target alone, greedy, left-padded batches of `batch_size`;
- `hf_generate_b1` — the same, one prompt at a time;
- `hf_assisted_b1` — assisted generation (`assistant_model=` the draft, in the float type batchspec runs it in),
  batch 1 (transformers supports no other), with transformers' default assistant schedule;
- `llama_cpp_b1` — the CPU user's alternative: llama.cpp (through `llama-cpp-python`, an optional extra that pip
  builds from source: `pip install -e '.[llamacpp]'`) running the target's GGUF file itself, quantised weights and
  all, greedy, one prompt at a time, on as many threads as torch uses. Where it is not installed, or the target is
  not a GGUF file, the row is left out with a note (`unavailable_reason`), never an error.

Each row reports `tokens_per_s` (output tokens, EOS included as our engine counts it, / wall time of the whole
generation, prefill included — the same definition as batchspec's rows) and `match_ar`, the share of prompts whose
output equals batchspec's `ar` output, so a row that is fast but wrong is visible. Rows name the library version.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from batchspec.errors import BatchspecError
from batchspec.runtime.precision import cpu_flags
from batchspec.weights.loading import LoadedModel

BASELINES = ("hf_generate", "hf_generate_b1", "hf_assisted_b1", "llama_cpp_b1")
ALL_PROMPTS = ("hf_generate", "llama_cpp_b1")  # the baselines fast enough to run every bench prompt


def check_baselines(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise BatchspecError(f"unknown baseline {unknown[0]!r}; valid baselines: {', '.join(BASELINES)}")


def unavailable_reason(name: str, target: LoadedModel) -> str | None:
    """Why baseline `name` cannot run here (a note for the table), or None where it can."""
    if name != "llama_cpp_b1":
        return None
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp_b1 left out: llama-cpp-python is not installed (pip install -e '.[llamacpp]')"
    if target.gguf_path is None:
        return f"llama_cpp_b1 left out: the target {target.name} is not a GGUF file"
    return None


def _llama_cpp_needs_no_repack() -> bool:
    return "amx_int8" in cpu_flags()


def _llama_cpp_model(target: LoadedModel, context: int):
    """llama.cpp's model and context for the target's GGUF file.

    On CPUs with AMX, llama.cpp 0.3.36's AMX kernels crash (SIGSEGV in `ggml_backend_amx_mul_mat`, measured on a
    Xeon with amx_int8), so there it runs without its extra buffer types, as its own `--no-repack` option does:
    `Llama` does not expose that flag, so its default model parameters are wrapped while the model loads.
    """
    import llama_cpp.llama_cpp as low_level
    from llama_cpp import Llama

    defaults = low_level.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    if _llama_cpp_needs_no_repack():
        low_level.llama_model_default_params = without_extra_buffers
    try:
        return Llama(model_path=str(target.gguf_path), n_ctx=context, n_threads=torch.get_num_threads(),
                     n_threads_batch=torch.get_num_threads(), n_batch=512, verbose=False)
    finally:
        low_level.llama_model_default_params = defaults


def _llama_cpp_generate(llm, prompt_ids: list[int], max_tokens: int, eos: frozenset[int]) -> list[int]:
    """Greedy tokens after `prompt_ids` (its KV cache reset first: no prefix reuse from the previous prompt)."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if token in eos or len(out) >= max_tokens:
            break
    return out


def _run_llama_cpp(target: LoadedModel, prompt_ids: list[list[int]], max_tokens: int,
                   loaded: dict) -> tuple[list[list[int]], float, str]:
    import llama_cpp

    if "llama_cpp" not in loaded:
        loaded["llama_cpp"] = _llama_cpp_model(target, max(len(ids) for ids in prompt_ids) + max_tokens + 8)
    llm, eos = loaded["llama_cpp"], target.eos_token_ids
    _llama_cpp_generate(llm, prompt_ids[0], 4, eos)  # warm-up
    started = time.perf_counter()
    outputs = [_llama_cpp_generate(llm, ids, max_tokens, eos) for ids in prompt_ids]
    library = (f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, {torch.get_num_threads()} threads"
               + (", no repack (its AMX kernels crash here)" if _llama_cpp_needs_no_repack() else ""))
    return outputs, time.perf_counter() - started, library


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

    loaded: a dict that keeps the baselines' models between calls (bench runs every baseline once per trial).
    """
    check_baselines((name,))
    loaded = {} if loaded is None else loaded
    pad_id = min(target.eos_token_ids) if target.eos_token_ids else 0
    if name == "llama_cpp_b1":
        outputs, wall, library = _run_llama_cpp(target, prompt_ids, max_tokens, loaded)
        batch = 1
    else:
        outputs, wall = _run_transformers(name, target, draft, prompt_ids, max_tokens, batch_size, pad_id, loaded)
        batch = batch_size if name == "hf_generate" else 1
        library = f"transformers {_transformers_version()}"
    eos = target.eos_token_ids
    emitted = sum(len(_trim(row, eos, pad_id, emitted=True)) for row in outputs)
    row = {"policy": name, "library": library, "batch_size": batch,
           "num_prompts": len(prompt_ids), "emitted_tokens": emitted, "wall_s": wall,
           "tokens_per_s": emitted / wall if wall else 0.0, "trial": trial}
    if reference is not None:
        mine = [_trim(r, eos, pad_id, emitted=False) for r in outputs]
        row["match_ar"] = sum(a == b for a, b in zip(mine, reference)) / len(mine)
    return row


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _run_transformers(name: str, target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[list[int]],
                      max_tokens: int, batch_size: int, pad_id: int, loaded: dict) -> tuple[list[list[int]], float]:
    if name == "hf_assisted_b1" and draft is None:
        raise BatchspecError("the hf_assisted_b1 baseline needs a draft model (--draft)")
    if "target" not in loaded:
        loaded["target"] = _hf_model(target)
    if name == "hf_assisted_b1" and "draft" not in loaded:
        loaded["draft"] = _hf_model(draft)
    hf, assistant = loaded["target"], loaded["draft"] if name == "hf_assisted_b1" else None
    batch = batch_size if name == "hf_generate" else 1
    _generate(hf, prompt_ids[:1], 4, pad_id, assistant)  # warm-up
    outputs = []
    started = time.perf_counter()
    for start in range(0, len(prompt_ids), batch):
        outputs += _generate(hf, prompt_ids[start:start + batch], max_tokens, pad_id, assistant)
    return outputs, time.perf_counter() - started
