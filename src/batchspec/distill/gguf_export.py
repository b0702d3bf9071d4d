"""Pack a distilled draft as a GGUF file that shares the target's quantised embedding.

A draft sliced from the target with a frozen embedding (`batchspec distill --init-layers ... --freeze-embedding`)
carries the target's 49152 x 576 embedding, which alone is 57 MB in float16. When the target is a GGUF file, the
draft can instead store that tensor exactly as the target does (Q8_0 in the default target's file: bit for bit the
values the target computes with), its own trained matrices in Q8_0 and norms in float32, and the target's metadata
and tokenizer: 43 MiB for the default draft instead of 85 MiB as float16 safetensors. The result is an ordinary GGUF file that `load_model` reads like any other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from batchspec.errors import BatchspecError
from batchspec.runtime.config import ModelConfig
from batchspec.weights.head_vocab import GGUF_KEY as HEAD_VOCAB_GGUF_KEY, read_head_vocab
from batchspec.weights.loading import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES

_TO_GGUF_GLOBAL = {hf: gg for gg, hf in GGUF_GLOBAL_NAMES.items()}
_TO_GGUF_LAYER = {hf: gg for gg, hf in GGUF_LAYER_NAMES.items()}


def permute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k row order -> llama.cpp's interleaved pairs (the inverse of `unpermute_rope`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[hf_name]
    if hf_name.startswith("model.layers."):
        layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        if rest in _TO_GGUF_LAYER:
            return f"blk.{layer}.{_TO_GGUF_LAYER[rest]}"
    raise BatchspecError(f"no GGUF name for tensor {hf_name!r}")


MATRIX_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1")  # block formats gguf-py can write, finest first


def write_draft_gguf(draft_dir: Path, target_gguf: Path, out: Path, matrix_type: str = "Q8_0") -> Path:
    """Write `out` (.gguf): the draft in `draft_dir` (HF format, same family and tokenizer as the target).

    `matrix_type`: how the draft's own trained matrices are stored (Q5_1 fits a deeper draft in the 50 MB budget).

    A head vocabulary stored in `draft_dir` (`head_vocab.json`) goes into the GGUF metadata as `batchspec.head_vocab`.
    """
    import gguf
    from gguf.quants import dequantize, quantize

    if matrix_type not in MATRIX_TYPES:
        raise BatchspecError(f"matrix type must be one of {', '.join(MATRIX_TYPES)}, got {matrix_type!r}")
    block_type = getattr(gguf.GGMLQuantizationType, matrix_type)
    config = ModelConfig.from_file(draft_dir / "config.json")
    weights = {n: t.float().numpy() for n, t in load_file(draft_dir / "model.safetensors").items()}
    reader = gguf.GGUFReader(target_gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != config.model_type:
        raise BatchspecError(f"the draft is {config.model_type!r} but the target GGUF is {arch!r}")
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        value = config.num_layers if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type)

    head_ids = read_head_vocab(draft_dir)
    if head_ids is not None:
        writer.add_array(HEAD_VOCAB_GGUF_KEY, [int(t) for t in head_ids])

    target_tensors = {t.name: t for t in reader.tensors}
    for hf_name, array in weights.items():
        name = _gguf_name(hf_name)
        shared = target_tensors.get(name) if name in ("token_embd.weight", "output.weight") else None
        if shared is not None:
            # Reuse the target's own encoding when the draft's copy is the target's tensor (frozen at training).
            shape = tuple(reversed([int(d) for d in shared.shape]))
            reference = dequantize(shared.data, shared.tensor_type).reshape(shape)
            if reference.shape == array.shape and np.abs(reference - array).max() <= 1e-3 * np.abs(reference).max():
                writer.add_tensor(name, shared.data, raw_shape=shared.data.shape, raw_dtype=shared.tensor_type)
                continue
        if config.model_type == "llama" and hf_name.endswith("q_proj.weight"):
            array = permute_rope(array, config.num_heads)
        elif config.model_type == "llama" and hf_name.endswith("k_proj.weight"):
            array = permute_rope(array, config.num_kv_heads)
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            # Matrices in blocks of 32 (Q8_0: 8-bit with a float16 scale, ~0.4 % error, half of float16's size);
            # norms and biases stay float32.
            packed = quantize(np.ascontiguousarray(array, dtype=np.float32), block_type)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=block_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array.astype(np.float16 if array.ndim == 2 else np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
