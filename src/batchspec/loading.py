"""Loading checkpoints: Hugging Face–format directories and GGUF files (converted once into a cache directory).

A GGUF file is dequantised with the `gguf` package and written as an ordinary HF directory (`config.json`,
`model.safetensors`, tokenizer files) under the cache, keyed by the file's sha256; later loads read that directory
in seconds. Weights are only ever read from safetensors or GGUF — nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from batchspec import known_models
from batchspec.fetching import sha256_of
from batchspec.config import ModelConfig
from batchspec.errors import BatchspecError
from batchspec.head_vocab import GGUF_KEY as HEAD_VOCAB_GGUF_KEY, HEAD_VOCAB_FILE, read_head_vocab, write_head_vocab
from batchspec.model import Transformer
from batchspec.precision import compute_dtype, dtype_name, resolve_precision

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


def load_transformer(model_dir: Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                     full_head: bool = False) -> Transformer:
    """The model in an HF directory; its LM head restricted to the stored head vocabulary unless `full_head`.

    dtype: a float type, or a precision name (`precision.PRECISIONS`: float32, bfloat16, int8; the draft's `auto`
    and `int4`).

    Tensors are read one at a time from the memory-mapped files and converted to `dtype` on the way, and the fused
    matrices replace their parts as they are built, so loading never holds the weights twice.
    """
    precision = resolve_precision(dtype) if isinstance(dtype, str) else dtype_name(dtype)
    dtype = compute_dtype(precision)
    config = ModelConfig.from_file(model_dir / "config.json")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BatchspecError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=device) as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, ValueError) as bad:
            raise BatchspecError(f"cannot read weights {file}: {bad}") from None
    transformer = Transformer.from_hf_state_dict(config, weights, consume=True)
    head_ids = None if full_head else read_head_vocab(model_dir)
    if head_ids is not None:
        try:
            transformer.restrict_head(head_ids)
        except BatchspecError as bad:
            raise BatchspecError(f"{model_dir / HEAD_VOCAB_FILE}: {bad}") from None
    if precision in ("int8", "int4"):
        transformer.quantize_weights(precision)
    return transformer


# --- GGUF -----------------------------------------------------------------------------------------------------

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


def load_model(spec: str | Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
               full_head: bool = False) -> LoadedModel:
    """Load `default`, a known model's name, a GGUF file or an HF directory: weights into the native runtime (in
    `dtype`: a float type or a precision name, see `load_transformer`), plus the tokenizer.

    A draft that ships a head vocabulary (`head_vocab.py`) scores only those tokens unless `full_head`.
    """
    from batchspec.tokenizer import Tokenizer

    model_dir = resolve_model_dir(spec)
    transformer = load_transformer(model_dir, dtype=dtype, device=device, full_head=full_head)
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
