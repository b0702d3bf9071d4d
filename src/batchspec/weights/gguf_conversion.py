"""GGUF files: read with the `gguf` package, dequantised and converted once into a Hugging Face directory.

The directory (`config.json`, `model.safetensors` in float32, tokenizer files, and the head vocabulary if the file
carries one) lives under the cache, keyed by the file's sha256; later loads read it in seconds. llama.cpp's tensor
names map to HF's (`GGUF_LAYER_NAMES`, `GGUF_GLOBAL_NAMES`; `distill.gguf_export` writes the other way), and
Llama q/k rows are put back from llama.cpp's interleaved RoPE order (`unpermute_rope`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig
from batchspec.weights import known_models
from batchspec.weights.fetching import sha256_of
from batchspec.weights.head_vocab import GGUF_KEY as HEAD_VOCAB_GGUF_KEY, write_head_vocab

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    import gguf

    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    if field.types and field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]]
    return value.tolist()[0] if len(value) == 1 else value.tolist()


def unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Llama q/k rows (interleaved RoPE pairs -> HF's rotate-half halves).

    llama.cpp stores each head's rows as (D/2, 2) pairs; HF stores them as (2, D/2) halves.
    """
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise BatchspecError(f"unsupported architecture {arch!r} in GGUF file (supported: llama, qwen2)")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        attention_bias=arch == "qwen2",
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def gguf_state_dict(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to float32 under its Hugging Face name."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in GGUF_GLOBAL_NAMES:
            name = GGUF_GLOBAL_NAMES[tensor.name]
        elif tensor.name.startswith("blk."):
            _, layer, rest = tensor.name.split(".", 2)
            if rest not in GGUF_LAYER_NAMES:
                raise BatchspecError(f"unexpected tensor {tensor.name!r} in GGUF file")
            name = f"model.layers.{layer}.{GGUF_LAYER_NAMES[rest]}"
        else:
            continue  # e.g. rope_freqs: derived from the config instead
        # GGML lists dims fastest-first; numpy's shape is the reverse, i.e. HF's (out_features, in_features).
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = unpermute_rope(array, config.num_heads)
        elif config.model_type == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = unpermute_rope(array, config.num_kv_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(array))
    return out


def convert_gguf(path: Path) -> Path:
    """Convert a GGUF file once into an HF directory under the cache; return that directory."""
    digest = sha256_of(path)
    target = known_models.cache_root() / "converted" / f"{path.stem}-{digest[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    try:
        import gguf

        reader = gguf.GGUFReader(path)
    except Exception as bad:  # the gguf package raises bare ValueError/struct/memmap errors on corrupt files
        raise BatchspecError(f"cannot read GGUF file {path}: {bad}") from None
    config = gguf_config(reader)
    target.parent.mkdir(parents=True, exist_ok=True)
    needed = 4 * sum(int(t.n_elements) for t in reader.tensors)  # float32 safetensors
    free = shutil.disk_usage(target.parent).free
    if free < needed:
        raise BatchspecError(f"not enough disk to convert {path.name}: {needed / 2**30:.2f} GiB needed in "
                             f"{target.parent}, {free / 2**30:.2f} GiB free")
    try:
        weights = gguf_state_dict(reader, config)
    except BatchspecError:
        raise
    except Exception as bad:
        raise BatchspecError(f"cannot dequantise GGUF file {path}: {bad}") from None
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp)
        (staging / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt", "source": path.name})
        _save_gguf_tokenizer(path, staging)
        head_ids = reader.fields.get(HEAD_VOCAB_GGUF_KEY)
        if head_ids is not None:
            write_head_vocab(staging, torch.tensor(head_ids.contents(), dtype=torch.int64), source=path.name)
        staging.chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        staging.mkdir()  # TemporaryDirectory's cleanup expects its folder to exist
    return target


def _save_gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Turn the GGUF vocabulary, merges and chat template into HF tokenizer files (transformers does this once)."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as bad:
        raise BatchspecError(f"cannot build a tokenizer from GGUF file {path}: {bad}") from None
    tokenizer.save_pretrained(str(out_dir))
