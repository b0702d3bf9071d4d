"""Model configuration: a typed dataclass read from a Hugging Face `config.json`, validated at the edge."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchspec.errors import BatchspecError

# model_type -> HF architecture class name. Qwen2 differs from Llama only in q/k/v biases (and usually untied heads).
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise BatchspecError(
                f"unsupported architecture {self.model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise BatchspecError(f"invalid model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise BatchspecError(
                f"invalid model config: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        kind = rope_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_SCALING:
            raise BatchspecError(
                f"unsupported rope_scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_SCALING)})"
            )

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type is None:
            archs = raw.get("architectures") or []
            by_class = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            model_type = next((by_class[a] for a in archs if a in by_class), archs[0] if archs else "unknown")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise BatchspecError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(raw),
                # Qwen2 always has q/k/v biases; Llama has them only when `attention_bias` says so.
                attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as missing:
            raise BatchspecError(f"invalid model config: config.json lacks {missing}") from None
        except (TypeError, ValueError) as bad:
            raise BatchspecError(f"invalid model config: {bad}") from None

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise BatchspecError(f"model config not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise BatchspecError(f"cannot parse model config {path}: {bad}") from None
        if not isinstance(raw, dict):
            raise BatchspecError(f"cannot parse model config {path}: expected a JSON object")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that `transformers` reads as the same model (used when converting GGUF files)."""
        out = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    # transformers 5 folds rope settings into `rope_parameters`; older configs use `rope_scaling`.
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling or rope_type(scaling) == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}
