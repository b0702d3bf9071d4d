"""Training data for SPRINTER's verifier (`batchspec sprinter collect`): per draft token, features and labels.

For every prompt (real prompts — the standard library by default, never HumanEval):
1. the target writes its greedy answer a_0..a_{T-1} with `Engine.generate` (chat-formatted, batched);
2. prompt + answer goes once, teacher-forced, through the draft and once through the target. At every answer
   position t the context is prompt + a_<t; there the draft proposes d = argmax q (the greedy setting) and we keep
   features — the draft's last hidden state at that position (after the final norm, what its LM head reads; float16),
   log q(d) and the entropy of q — and labels: y_sd = 1 iff q(d) <= p(d) (SD would accept d with probability 1) and
   y_greedy = 1 iff d == argmax p.

Approximation. When decoding, the draft proposes d_j after its own earlier proposals d_<j; here every proposal
follows the target's own prefix. This is the one-token-ahead, on-policy-prefix approximation of the decoding-time
distribution: exact for the first draft token of a block, and close for later ones as long as the verifier keeps
the prefix mostly target-like. q and p are the models' plain softmax distributions (temperature 1, no top-k/top-p).

Shards of `shard_size` prompts are written atomically (`shard-NNNNN.safetensors`), so `--resume` skips finished
shards. `meta.json` records the settings, the validation prompts (a seeded split by prompt) and the identity of the
draft and target (config.json contents + a fingerprint of the weights).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from batchspec.errors import BatchspecError
from batchspec.sprinter.features import shard_records, token_features  # noqa: F401 (token_features: the API)
from batchspec.weights.fingerprint import weight_fingerprint
from batchspec.weights.shards import save_atomically

DATA_FORMAT = "batchspec-sprinter-data/1"
HELD_OUT = ("HumanEval is the held-out benchmark: never collect verifier data on it "
            "(use stdlib, jsonl:PATH or sharegpt:PATH)")


@dataclass(frozen=True)
class CollectConfig:
    target: str = "default"
    draft: str = "default"
    prompts: str = "stdlib"  # stdlib | jsonl:PATH | sharegpt:PATH
    num_prompts: int = 256
    max_tokens: int = 128  # answer tokens per prompt
    max_prompt_tokens: int = 512  # longer prompts are skipped
    shard_size: int = 16  # prompts per shard
    batch_size: int = 16  # requests the target decodes together
    seed: int = 1000  # distill uses seed 0: other stdlib functions
    val_fraction: float = 0.1
    draft_dtype: str = "auto"  # as the engine runs the draft (`precision.resolve_precision`): same features as at use
    target_dtype: str = "float32"  # as the engine will run the target: its greedy answers are the labels

    def validate(self) -> None:
        for name in ("num_prompts", "max_tokens", "max_prompt_tokens", "shard_size", "batch_size"):
            if getattr(self, name) < 1:
                raise BatchspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.num_prompts < 2:
            raise BatchspecError("--num-prompts must be at least 2 (one training and one validation prompt)")
        if not 0.0 < self.val_fraction < 1.0:
            raise BatchspecError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.prompts == "humaneval":
            raise BatchspecError(HELD_OUT)
        if self.prompts != "stdlib" and not self.prompts.startswith(("jsonl:", "sharegpt:")):
            raise BatchspecError(f"unknown --prompts {self.prompts!r}: use stdlib, jsonl:PATH or sharegpt:PATH")


# --- identity of a model: what a verifier belongs to ---------------------------------------------------------------


def model_identity(model) -> dict:
    """name, directory, hidden size, config.json contents and weight fingerprint of a `LoadedModel`."""
    config_path = Path(model.model_dir) / "config.json"
    return {"name": model.name, "model_dir": str(model.model_dir), "hidden_size": model.config.hidden_size,
            "config": json.loads(config_path.read_text()), "fingerprint": weight_fingerprint(model.transformer)}


# --- prompts and the split -------------------------------------------------------------------------------------------


def candidate_prompts(spec: str, count: int, seed: int) -> list[str]:
    """Up to `count` prompts from `stdlib` (seeded), `jsonl:PATH` or `sharegpt:PATH`. HumanEval is refused."""
    from batchspec.datasets.prompts import load_prompts_file, sharegpt_prompts
    from batchspec.distill.teacher_data import build_prompts, stdlib_pool

    if spec == "stdlib":
        return build_prompts(min(count, len(stdlib_pool()) // 2), seed)
    if spec == "humaneval":
        raise BatchspecError(HELD_OUT)
    kind, _, path = spec.partition(":")
    if kind == "jsonl" and path:
        return load_prompts_file(path)[:count]
    if kind == "sharegpt" and path:
        return [p for p, _ in sharegpt_prompts(Path(path))][:count]
    raise BatchspecError(f"unknown --prompts {spec!r}: use stdlib, jsonl:PATH or sharegpt:PATH")


def encode_fitting(tokenizer, prompts: list[str], count: int, limit: int) -> tuple[list[str], list[list[int]]]:
    """Chat-format and encode prompts; keep the first `count` with at most `limit` tokens (texts and ids)."""
    texts, ids = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        tokens = tokenizer.encode_user_message(prompt)  # the prompt's own text stays text
        if 0 < len(tokens) <= limit:
            texts.append(text)
            ids.append(tokens)
        if len(texts) == count:
            break
    return texts, ids


def validation_prompts(num_prompts: int, val_fraction: float, seed: int) -> list[int]:
    """Seeded split by prompt: the indices of the validation prompts (at least one, never all)."""
    num_val = min(num_prompts - 1, max(1, round(val_fraction * num_prompts)))
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed))
    return sorted(order[:num_val].tolist())


# --- the collection run ---------------------------------------------------------------------------------------------


def _previous_meta(out: Path, cfg: CollectConfig, resume: bool) -> dict | None:
    """The meta.json of an earlier run in `out` (None if none); refuse to mix it with other settings."""
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        return None
    if not resume:
        raise BatchspecError(f"{out} already holds SPRINTER data; pass --resume to continue it or choose another --out")
    try:
        old = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise BatchspecError(f"corrupt {meta_path}: {bad}") from None
    changed = sorted(k for k, v in asdict(cfg).items() if old.get("config", {}).get(k) != v)
    if changed:
        raise BatchspecError(f"--resume with different settings than the data in {out}: {changed}")
    return old


def run_collect(cfg: CollectConfig, out: Path, resume: bool = False, progress: bool = False,
                prompts: list[str] | None = None) -> dict:
    """Collect verifier data into `out`; returns (and writes into meta.json) a summary.

    `prompts` replaces the `cfg.prompts` source (user data; tests use a handful).
    """
    from tqdm import tqdm

    from batchspec.engine.engine import Engine
    from batchspec.runtime.precision import resolve_precision
    from batchspec.runtime.sampling import SamplingParams
    from batchspec.weights.loading import check_draft_compatible, load_model

    cfg.validate()
    old = _previous_meta(out, cfg, resume)
    target = load_model(cfg.target, dtype=cfg.target_dtype)
    draft = load_model(cfg.draft, dtype=resolve_precision(cfg.draft_dtype))  # its full head: what verifiers read
    check_draft_compatible(target, draft)
    limit = min(cfg.max_prompt_tokens, target.config.max_position_embeddings - cfg.max_tokens,
                draft.config.max_position_embeddings - cfg.max_tokens)
    if limit < 1:
        raise BatchspecError(f"--max-tokens {cfg.max_tokens} leaves no room for prompts in the models' context")
    # Ask for spares: over-long prompts are skipped (stdlib prompts are prefix-stable, so this stays seeded).
    pool = prompts if prompts is not None else candidate_prompts(cfg.prompts, cfg.num_prompts * 2 + 16, cfg.seed)
    texts, prompt_ids = encode_fitting(target.tokenizer, pool, cfg.num_prompts, limit)
    if len(texts) < cfg.num_prompts:
        raise BatchspecError(f"only {len(texts)} prompts of at most {limit} tokens available, "
                             f"{cfg.num_prompts} requested")
    # `auto` resolves per machine (`precision.resolve_precision`): record what the features were computed in (a
    # weight precision: int4 weights compute in bfloat16 but are another model than the bfloat16 draft).
    meta = {"format": DATA_FORMAT, "config": asdict(cfg), "draft": model_identity(draft),
            "draft_dtype": draft.transformer.precision, "target": model_identity(target),
            "target_dtype": cfg.target_dtype,
            "prompt_source": cfg.prompts if prompts is None else "given by the caller",
            "val_prompts": validation_prompts(cfg.num_prompts, cfg.val_fraction, cfg.seed),
            "approximation": "one-token-ahead: every draft proposal follows the target's own greedy prefix"}
    for role in ("draft", "target"):
        if old is not None and old.get(role, {}).get("fingerprint") != meta[role]["fingerprint"]:
            raise BatchspecError(f"--resume with another {role} model than the data in {out} was collected with")
    if old is not None and old.get("draft_dtype", meta["draft_dtype"]) != meta["draft_dtype"]:
        raise BatchspecError(f"--resume would compute the draft's features in {meta['draft_dtype']}, but the data in "
                             f"{out} was collected in {old['draft_dtype']}: pass --draft-dtype {old['draft_dtype']}")
    if old is not None and old.get("target_dtype", "float32") != cfg.target_dtype:
        raise BatchspecError(f"--resume would label with the target in {cfg.target_dtype}, but the data in {out} was "
                             f"collected with it in {old.get('target_dtype', 'float32')}: pass --target-dtype "
                             f"{old.get('target_dtype', 'float32')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))

    engine = Engine(target, max_batch_size=cfg.batch_size, seed=cfg.seed)
    params = SamplingParams(max_tokens=cfg.max_tokens)  # greedy
    shards = range(math.ceil(cfg.num_prompts / cfg.shard_size))
    skipped, started = 0, time.perf_counter()
    for index in tqdm(shards, desc="sprinter collect", unit="shard", disable=not progress):
        path = out / f"shard-{index:05d}.safetensors"
        if path.is_file():
            skipped += 1
            continue
        part = slice(index * cfg.shard_size, (index + 1) * cfg.shard_size)
        # The texts are already chat-formatted, so the engine encodes them to exactly `prompt_ids`.
        answers = [o.token_ids for o in engine.generate(texts[part], params, chat=False)]
        pairs = list(zip(prompt_ids[part], answers))
        save_atomically(shard_records(target, draft, pairs, part.start), path)  # all of a shard or none
        if not progress:  # output going to a file still shows progress: a line per shard
            print(f"sprinter collect: shard {index + 1}/{len(shards)} written ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    data = load_data(out)
    meta["summary"] = {"shards": len(shards), "shards_skipped": skipped, "positions": data.num_rows,
                       "train_positions": int((~data.val).sum()), "val_positions": int(data.val.sum()),
                       "greedy_accept_rate": float(data.tensors["y_greedy"].float().mean()),
                       "sd_accept_rate": float(data.tensors["y_sd"].float().mean())}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta["summary"]


# --- reading it back --------------------------------------------------------------------------------------------------


@dataclass
class SprinterData:
    meta: dict
    tensors: dict[str, torch.Tensor]  # hidden (N, H) f16, logq/logp/entropy (N,) f32, y_sd/y_greedy (N,) u8, ...
    val: torch.Tensor  # (N,) bool: the row belongs to a validation prompt

    @property
    def num_rows(self) -> int:
        return int(self.val.numel())

    def split(self, which: str) -> dict[str, torch.Tensor]:
        """Rows of `train`, `val` or `all`."""
        if which == "all":
            return self.tensors
        mask = self.val if which == "val" else ~self.val
        return {name: t[mask] for name, t in self.tensors.items()}


SHARD_FIELDS = ("hidden", "logq", "logp", "entropy", "draft_token", "target_argmax", "y_sd", "y_greedy",
                "prompt_index", "position")


def load_data(path: str | Path) -> SprinterData:
    """Every shard of a `sprinter collect` directory, with clear errors for missing or corrupt files."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise BatchspecError(f"no SPRINTER data in {path}: {meta_path.name} not found (run `batchspec sprinter "
                             "collect --out DIR` first)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise BatchspecError(f"corrupt {meta_path}: {bad}") from None
    if not isinstance(meta, dict) or meta.get("format") != DATA_FORMAT:
        raise BatchspecError(f"{meta_path} is not SPRINTER data (expected format {DATA_FORMAT!r})")
    missing = [k for k in ("config", "draft", "target", "val_prompts") if k not in meta]
    if missing:
        raise BatchspecError(f"incomplete {meta_path}: {missing} missing")
    shards = sorted(path.glob("shard-*.safetensors"))
    if not shards:
        raise BatchspecError(f"no shards in {path}: the collection has not finished any shard yet")
    parts = []
    for shard in shards:
        try:
            tensors = load_file(shard)
        except (SafetensorError, OSError, ValueError) as bad:
            raise BatchspecError(f"cannot read shard {shard}: {bad}") from None
        missing = [f for f in SHARD_FIELDS if f not in tensors]
        if missing:
            raise BatchspecError(f"shard {shard} lacks {missing}")
        parts.append(tensors)
    tensors = {name: torch.cat([p[name] for p in parts]) for name in SHARD_FIELDS}
    val_prompts = torch.tensor(meta["val_prompts"], dtype=torch.int32)
    val = torch.isin(tensors["prompt_index"], val_prompts)
    return SprinterData(meta, tensors, val)
