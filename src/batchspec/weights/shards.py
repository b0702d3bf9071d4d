"""Safetensors files that exist completely or not at all: data shards and checkpoints that a resumed run reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def save_atomically(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` to `path` through a temporary file in the same directory, renamed into place: a reader
    (or a run resumed after a crash) sees the old file or the whole new one, never half of one."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata=metadata)
    tmp.replace(path)
    return path
