"""Loading checkpoints: Hugging Face–format directories and GGUF files (converted once into a cache directory).

A GGUF file is turned into an ordinary HF directory first (`gguf_conversion`), so every model loads the same way:
safetensors read tensor by tensor into the native `Transformer`, plus its tokenizer. Weights are only ever read
from safetensors or GGUF — nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig
from batchspec.runtime.device import check_precision_on, resolve_device
from batchspec.runtime.onednn import onednn_available, onednn_int8_available
from batchspec.weights import known_models
from batchspec.weights.gguf_conversion import (GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, convert_gguf, gguf_config,
                                               gguf_state_dict, unpermute_rope)
from batchspec.runtime.model import Transformer
from batchspec.runtime.precision import compute_dtype, dtype_name, resolve_precision
from batchspec.weights.head_vocab import HEAD_VOCAB_FILE, read_head_vocab

__all__ = ["GGUF_GLOBAL_NAMES", "GGUF_LAYER_NAMES", "LoadedModel", "TOKENIZER_FILES", "check_draft_compatible",
           "convert_gguf", "gguf_config", "gguf_state_dict", "load_model", "load_transformer", "model_source",
           "resolve_model_dir", "unpermute_rope"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def model_source(spec: str | Path) -> Path:
    """`default`, a known model's name (`known_models.KNOWN_MODELS`), a GGUF file or an HF directory -> that file
    or directory on disk."""
    return known_models.local_path(str(spec)) if known_models.is_known_name(spec) else Path(spec).expanduser()


def resolve_model_dir(spec: str | Path) -> Path:
    """`default`, a known model's name, a GGUF file or an HF directory -> an HF-format directory (converting a GGUF
    file if needed)."""
    path = model_source(spec)
    if not path.exists():
        raise BatchspecError(f"model path not found: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BatchspecError(f"{path} is not a model directory: it has no config.json")
        return path
    if path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    raise BatchspecError(f"unrecognised model file {path}: expected a directory with config.json or a .gguf file")


def load_transformer(model_dir: Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                     full_head: bool = False, head_vocab_dir: Path | None = None) -> Transformer:
    """The model in an HF directory; its LM head restricted to the stored head vocabulary unless `full_head`.
    head_vocab_dir: a head vocabulary shipped beside the model instead (`known_models.shipped_head_vocab_dir`), run as
    a context head (`Transformer.enable_context_head`).

    dtype: a float type, or a precision name (`precision.PRECISIONS`: float32, bfloat16, int8; the draft's `auto`
    and `int4`). device: `cpu`, `cuda` or `cuda:N` (`runtime.device`; int8 and int4 are the CPU's only).

    Tensors are read one at a time into memory of their own (`read_tensors`) and converted to `dtype` on the way,
    and the fused matrices replace their parts as they are built, so loading never holds the weights twice.
    """
    device = resolve_device(device)
    precision = resolve_precision(dtype, device) if isinstance(dtype, str) else dtype_name(dtype)
    check_precision_on(device, precision)
    dtype = compute_dtype(precision)
    config = ModelConfig.from_file(model_dir / "config.json")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BatchspecError(f"no *.safetensors weights in {model_dir}")
    weights = {name: tensor for file in files for name, tensor in read_tensors(file, dtype, device)}
    transformer = Transformer.from_hf_state_dict(config, weights, consume=True)
    vocab_dir = model_dir if head_vocab_dir is None else Path(head_vocab_dir)
    head_ids = None if full_head else read_head_vocab(vocab_dir)
    if head_ids is not None:
        try:
            transformer.restrict_head(head_ids)
            if head_vocab_dir is not None:
                transformer.enable_context_head()
        except BatchspecError as bad:
            raise BatchspecError(f"{vocab_dir / HEAD_VOCAB_FILE}: {bad}") from None
    if precision in ("int8", "int4"):
        # An int4 model is a draft: it also prefills, where int4's kernel is slow (`Int4Weight.WIDE_ROWS`).
        # Its copy for them: int8 where the CPU multiplies int8 fast, else float32 on oneDNN, else none.
        wide = "int8" if onednn_int8_available() else "float32" if onednn_available() else None
        transformer.quantize_weights(precision, wide=wide)  # (an int8 model keeps no copy)
    return transformer


def read_tensors(file: Path, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file as (name, tensor in `dtype` on `device`), in memory of its own.

    safetensors memory-maps the file and hands out views of the mapping: a tensor kept as such a view (any tensor
    already in `dtype`) pins the whole mapping, and every page of the file the process ever reads stays resident
    beside the model's own copies (measured, the 1.5B target in float32 after oneDNN packing: 11.9 GiB resident,
    5.8 of it the file's pages; peak 13.4). So every tensor is copied out, and the file is opened anew for each one:
    its pages are unmapped as soon as the tensor is read, and the process never holds more than one tensor of the
    file besides the weights (peak 2.6 GiB for the 0.5B draft's 2.3 GiB of float32, 4.9 with one mapping open
    throughout).
    """
    try:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
        for name in names:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                tensor = f.get_tensor(name)
            yield name, tensor.to(dtype, copy=True)
    except (SafetensorError, OSError, ValueError) as bad:
        raise BatchspecError(f"cannot read weights {file}: {bad}") from None


# --- a model ready to run: weights plus tokenizer -------------------------------------------------------------


class LoadedModel:
    """A runtime `Transformer` with its tokenizer, the directory it came from and, for a model converted from a GGUF
    file, that file (`gguf_path`: what llama.cpp runs as a baseline)."""

    def __init__(self, name: str, model_dir: Path, transformer: Transformer, tokenizer,
                 gguf_path: Path | None = None) -> None:
        self.name = name
        self.model_dir = model_dir
        self.gguf_path = gguf_path
        self.transformer = transformer
        self.tokenizer = tokenizer

    @property
    def config(self) -> ModelConfig:
        return self.transformer.config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        generation = self.model_dir / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return frozenset(int(i) for i in ids)


def load_model(spec: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               full_head: bool = False, shipped_head: bool = False) -> LoadedModel:
    """Load `default`, a known model's name, a GGUF file or an HF directory: weights into the native runtime (in
    `dtype`: a float type or a precision name, see `load_transformer`), plus the tokenizer.

    A draft that ships a head vocabulary (`head_vocab.py`) scores only those tokens unless `full_head`. With
    `shipped_head`, a known model with a head vocabulary in the repository (`KnownModel.head_vocab`) runs it as a
    context head: for a draft only (a target scores every token), and not under a SPRINTER verifier trained on the
    draft's full head (it reads its log q and entropy).
    """
    from batchspec.runtime.tokenizer import Tokenizer

    model_dir = resolve_model_dir(spec)
    shipped = known_models.shipped_head_vocab_dir(spec) if shipped_head else None
    transformer = load_transformer(model_dir, dtype=dtype, device=device, full_head=full_head, head_vocab_dir=shipped)
    tokenizer = Tokenizer(model_dir)
    if tokenizer.vocab_size > transformer.config.vocab_size:
        raise BatchspecError(f"tokenizer of {model_dir} has {tokenizer.vocab_size} tokens but the model only "
                             f"{transformer.config.vocab_size}")
    name = str(spec) if known_models.is_known_name(spec) else Path(spec).name
    source = model_source(spec)
    return LoadedModel(name, model_dir, transformer, tokenizer,
                       gguf_path=source if source.suffix.lower() == ".gguf" else None)


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer or vocabulary differs from the target's.

    Speculative decoding compares draft and target token ids directly, so even one differing id would silently
    turn accepted drafts into wrong text.
    """
    target_size, target_hash = target.tokenizer.fingerprint()
    draft_size, draft_hash = draft.tokenizer.fingerprint()
    if (target_size, target_hash) != (draft_size, draft_hash):
        detail = (f"{draft_size} vs {target_size} tokens" if draft_size != target_size
                  else f"same size ({draft_size} tokens) but different tokens or ids")
        raise BatchspecError(f"draft tokenizer does not match the target's: {detail} "
                             f"(draft {draft.model_dir}, target {target.model_dir})")
    if draft.config.vocab_size != target.config.vocab_size:
        raise BatchspecError(f"draft vocabulary size {draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size} (draft {draft.model_dir})")
