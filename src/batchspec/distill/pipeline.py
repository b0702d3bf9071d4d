"""`batchspec distill`: train a small draft model that imitates the target's next-token distributions.

Three resumable stages, all under `OUT/work/`: prompts and teacher data (`teacher_data.py`), then training
(`train.py`); this module builds the draft, runs the stages and exports the result. The settings are `config.py`'s
`DistillConfig`; the command line is `batchspec.cli.distill`.

The draft is either a slice of the target's own layers (`--init-layers 0,1`: the target's embedding, those layers,
its final norm and head — a layer-skipping draft that training adapts) or a small fresh Llama whose tied embedding
starts as the target's projected on its top singular directions. It is trained with AdamW on KL(target top-k ||
draft) plus cross-entropy on the target's top-1, over response positions. Checkpoints (weights + AdamW moments +
step; the data order is a function of seed and step) are safetensors, so `--resume` continues exactly.

The result is an ordinary HF-format directory (`config.json`, float16 `model.safetensors`, tokenizer files) that
`load_model` runs like any other checkpoint of the target's family.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from batchspec.distill.config import DistillConfig
from batchspec.distill.teacher_data import load_samples, make_teacher_data
from batchspec.distill.train import train
from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig
from batchspec.weights.head_vocab import (HEAD_VOCAB_FILE, choose_head_vocab, count_target_tokens, read_head_vocab,
                                          write_head_vocab)
from batchspec.weights.shards import save_atomically


# --- 3. the draft model (trained in train.py) -----------------------------------------------------------


def parse_init_layers(spec: str, num_layers: int) -> list[int]:
    """"0,1" -> [0, 1]: target layers copied into the draft, in order (negative indices count from the end)."""
    try:
        layers = [int(part) for part in spec.split(",")]
    except ValueError:
        raise BatchspecError(f"--init-layers must be comma-separated layer indices, got {spec!r}") from None
    if not layers or any(not -num_layers <= i < num_layers for i in layers):
        raise BatchspecError(f"--init-layers {spec!r}: the target has layers 0..{num_layers - 1}")
    return [i % num_layers for i in layers]


def draft_config(cfg: DistillConfig, target_config: ModelConfig) -> ModelConfig:
    """The draft's architecture: a slice of the target's layers (`--init-layers`) or a small fresh Llama."""
    if cfg.init_layers:
        layers = parse_init_layers(cfg.init_layers, target_config.num_layers)
        return replace(target_config, num_layers=len(layers))
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise BatchspecError(f"--hidden {cfg.hidden} must divide into --heads {cfg.heads}, "
                             f"which must be a multiple of --kv-heads {cfg.kv_heads}")
    tc = target_config
    return ModelConfig(model_type="llama", vocab_size=tc.vocab_size, hidden_size=cfg.hidden,
                       intermediate_size=cfg.intermediate, num_layers=cfg.layers, num_heads=cfg.heads,
                       num_kv_heads=cfg.kv_heads, head_dim=cfg.hidden // cfg.heads,
                       max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                       rope_theta=tc.rope_theta, tie_word_embeddings=True, bos_token_id=tc.bos_token_id,
                       eos_token_ids=tc.eos_token_ids)


def _target_state_dict(target) -> dict[str, torch.Tensor]:
    files = sorted(target.model_dir.glob("*.safetensors"))
    return {name: tensor for f in files for name, tensor in load_file(f).items()}


def init_draft(cfg: DistillConfig, target) -> torch.nn.Module:
    """A transformers model of the draft's architecture, initialised from the target.

    With `--init-layers`, embedding, the chosen layers, final norm and head are copies of the target's (a
    layer-skipping draft that training then adapts). Otherwise the layers are random and the embedding is the
    target's projected on its top `hidden` singular directions, rescaled to the target's per-token norm.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = draft_config(cfg, target.config)
    torch.manual_seed(cfg.seed)
    raw = config.to_hf_dict()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).float()
    if cfg.init_layers:
        layers = parse_init_layers(cfg.init_layers, target.config.num_layers)
        source = _target_state_dict(target)
        renamed = {}
        for name, tensor in source.items():
            if name.startswith("model.layers."):
                index, rest = name.removeprefix("model.layers.").split(".", 1)
                if int(index) in layers:
                    renamed[f"model.layers.{layers.index(int(index))}.{rest}"] = tensor
            else:
                renamed[name] = tensor
        missing, unexpected = model.load_state_dict(renamed, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise BatchspecError(f"cannot initialise the draft from {target.model_dir}: missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}")
        if config.tie_word_embeddings:
            model.tie_weights()
    else:
        embed = target.transformer.embed.float()  # (V, H_target)
        if cfg.hidden <= embed.shape[1]:
            _, _, vh = torch.linalg.svd(embed, full_matrices=False)  # vh (H_target, H_target)
            projected = embed @ vh[:cfg.hidden].T  # (V, hidden): keeps the directions that separate tokens most
            projected *= embed.norm(dim=1).mean() / projected.norm(dim=1).mean()
            with torch.no_grad():
                model.model.embed_tokens.weight.copy_(projected)
    if cfg.freeze_embedding:
        model.model.embed_tokens.weight.requires_grad_(False)
        model.lm_head.weight.requires_grad_(False)
    return model


def export_draft(model, cfg: DistillConfig, target, out: Path) -> Path:
    """Write an HF-format directory the runtime loads: float16 weights, config, the target's tokenizer files."""
    from batchspec.weights.loading import TOKENIZER_FILES

    config = draft_config(cfg, target.config)
    raw = config.to_hf_dict()
    raw["torch_dtype"] = "float16"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    weights = {n: p.detach().half().contiguous() for n, p in model.state_dict().items()
               if not (config.tie_word_embeddings and n == "lm_head.weight")}
    save_atomically(weights, out / "model.safetensors", metadata={"format": "pt", "source": "batchspec distill"})
    for name in TOKENIZER_FILES:
        if (target.model_dir / name).is_file():
            shutil.copy(target.model_dir / name, out / name)
    return out


TRAINING_FIELDS = {"hidden", "layers", "heads", "kv_heads", "intermediate", "init_layers", "freeze_embedding",
                   "batch_tokens", "lr", "weight_decay", "ce_weight", "head_vocab"}


def training_head_vocab(cfg: DistillConfig, target, samples: list[dict], work: Path) -> torch.Tensor | None:
    """The draft's head vocabulary (sorted ids; None for a full head), chosen from the teacher data when training
    starts and kept in work/ so that a resumed run — even on more data — trains and exports the same rows."""
    if not cfg.head_vocab:
        return None
    head = read_head_vocab(work) if (work / "checkpoint.json").is_file() else None
    if head is None:  # a fresh run, or one from before the head was chosen ahead of training
        counts = count_target_tokens(samples, target.config.vocab_size)
        head = choose_head_vocab(counts, cfg.head_vocab, target.tokenizer.special_token_ids())
        write_head_vocab(work, head, source="chosen at the start of training")
    return head


def run_distill(cfg: DistillConfig, out: Path, resume: bool = False, progress: bool = False,
                data_only: bool = False, prompts: list[str] | None = None) -> dict:
    """The library entry point: all three stages, then export. Returns a summary (also written to work/).

    `prompts` replaces the built-in prompts (user data; tests use a handful).
    """
    from batchspec.distill.gguf_export import write_draft_gguf
    from batchspec.weights.known_models import default_target_path
    from batchspec.weights.loading import load_model

    cfg.validate()
    work = out / "work"
    settings = work / "settings.json"
    if settings.is_file():
        if not resume:
            raise BatchspecError(f"{out} already holds a distillation run; pass --resume to continue it "
                                 "or choose another --out")
        old = json.loads(settings.read_text())
        # May change on resume (prompts are prefix-stable; the head vocabulary is fixed once training starts).
        free = {"steps", "save_every", "num_prompts", "forced_prompts", "gguf_type", "train_dtype"}
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
    if cfg.top_k > target.config.vocab_size or cfg.head_vocab > target.config.vocab_size:
        raise BatchspecError(f"--top-k {cfg.top_k} / --head-vocab {cfg.head_vocab} exceed the vocabulary "
                             f"({target.config.vocab_size})")
    make_teacher_data(cfg, target, work, progress, prompts)
    data_s = time.perf_counter() - started
    if data_only:
        return {"config": asdict(cfg), "data_s": data_s, "log": []}
    samples = load_samples(work / "data")  # once: training, the head vocabulary and the summary all read it
    head = training_head_vocab(cfg, target, samples, work)
    model, log = train(cfg, init_draft(cfg, target), samples, work, target.tokenizer.eos_token_id or 0, progress,
                       head)
    export_draft(model, cfg, target, out)
    if head is not None:
        write_head_vocab(out, head, source="batchspec distill: the target's most frequent tokens in its teacher data")
    else:
        (out / HEAD_VOCAB_FILE).unlink(missing_ok=True)  # a full head: no choice left over from an earlier export
    target_file = default_target_path() if cfg.target == "default" else Path(cfg.target).expanduser()
    if cfg.freeze_embedding and cfg.init_layers and target_file.suffix.lower() == ".gguf":
        # The HF export repeats the target's embedding in float16; the GGUF shares its quantised encoding.
        write_draft_gguf(out, target_file, out / "draft.gguf", matrix_type=cfg.gguf_type)
    summary = {"config": asdict(cfg), "data_s": data_s, "total_s": time.perf_counter() - started,
               "samples": len(samples),
               "parameters": sum(p.numel() for p in model.parameters()), "log": log}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
