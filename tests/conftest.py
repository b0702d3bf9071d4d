"""Shared fixtures: the real default model (fetched by `make test` before pytest runs) and tiny random models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchspec.weights.fetching import fetch
from batchspec.weights.known_models import DEFAULT_TARGET
from batchspec.weights.loading import TOKENIZER_FILES, load_model, resolve_model_dir

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    fetch(DEFAULT_TARGET)  # a no-op once fetched; `make test` fetches before pytest starts
    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    return load_model(default_model_dir)


def make_tiny_model(out: Path, tokenizer_dir: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A randomly initialised transformers model saved as an HF directory, with the default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    with torch.no_grad():  # default init is tiny; larger weights make logit differences visible
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture
def tiny_model_factory(tmp_path, default_model_dir):
    def factory(model_type: str = "llama", name: str = "tiny", **overrides) -> Path:
        return make_tiny_model(tmp_path / name, default_model_dir, model_type, **overrides)

    return factory


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def make_layer_skip_draft(target_dir: Path, out: Path, layers: int = 4) -> Path:
    """A draft sharing the target's tokenizer: its first `layers` layers, final norm and head (acceptance ~0.5)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    keep = {}
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
                continue
            keep[name] = f.get_tensor(name)
    save_file(keep, out / "model.safetensors")
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def layer_skip_draft(default_model_dir, tmp_path_factory):
    return load_model(make_layer_skip_draft(default_model_dir, tmp_path_factory.mktemp("draft") / "skip4"))
