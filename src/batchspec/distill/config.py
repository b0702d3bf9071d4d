"""The settings of `batchspec distill` (one frozen dataclass) and their validation."""

from __future__ import annotations

from dataclasses import dataclass

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
    init_layers: str = ""  # "0,1": copy these target layers (and its embedding/head) instead of a fresh model
    freeze_embedding: bool = False  # keep the (tied) embedding / LM head fixed
    steps: int = 160
    batch_tokens: int = 2048  # input tokens per optimiser step (prompt + response)
    lr: float = 2e-3
    weight_decay: float = 0.01
    ce_weight: float = 0.25
    save_every: int = 50
    seed: int = 0
    head_vocab: int = 0  # >0: the draft's LM head scores only the N tokens the target emits most (head_vocab.py)
    train_dtype: str = "auto"  # matrix products in bfloat16 under CPU autocast where the CPU has it natively
    gguf_type: str = "Q8_0"  # block format of the trained matrices in OUT/draft.gguf (gguf_export.MATRIX_TYPES)

    def validate(self) -> None:
        """One-line errors, named by the command-line flag, for settings no run can use."""
        for name in ("num_prompts", "gen_tokens", "shard_size", "top_k", "hidden", "layers", "heads", "kv_heads",
                     "intermediate", "batch_tokens", "save_every"):
            if getattr(self, name) < 1:
                raise BatchspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.head_vocab < 0:
            raise BatchspecError(f"--head-vocab must be >= 0 (0: the full vocabulary), got {self.head_vocab}")
        if self.steps < 0 or self.lr <= 0 or not 0 <= self.sample_fraction <= 1:
            raise BatchspecError("--steps must be >= 0, --lr > 0 and --sample-fraction in [0, 1]")
