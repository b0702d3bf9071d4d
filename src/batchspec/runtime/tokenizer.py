"""Tokenizer and chat template read from a checkpoint directory (`tokenizer.json` + `tokenizer_config.json`).

Uses the `tokenizers` library directly (fast to import) and renders the chat template with jinja2 the way
transformers does (`trim_blocks`, `lstrip_blocks`, `raise_exception`); tests check both against transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from batchspec.errors import BatchspecError


def _token_text(value) -> str | None:
    """Special tokens appear in tokenizer_config.json either as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise BatchspecError(f"tokenizer not found: {path}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as bad:  # tokenizers raises a bare Exception on malformed files
            raise BatchspecError(f"cannot read tokenizer {path}: {bad}") from None
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text() if template_path.is_file() else config.get("chat_template")
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> tuple[int, str]:
        """Identifies the vocabulary: draft and target must agree on it token for token."""
        import hashlib

        vocab = self._tok.get_vocab(with_added_tokens=True)
        joined = "\n".join(f"{tok}\t{idx}" for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]))
        return len(vocab), hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()

    def special_token_ids(self) -> list[int]:
        """Ids of the special added tokens (EOS, chat markers, ...), sorted."""
        ids = {i for i, added in self._tok.get_added_tokens_decoder().items() if added.special}
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return sorted(ids)

    def encode(self, text: str) -> list[int]:
        # Chat templates already contain their special tokens, so never add more here.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_user_message(self, content: str) -> list[int]:
        """One user turn in the chat template, with the generation prompt, as token ids."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": content}]))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise BatchspecError("this model has no chat template; pass plain prompts instead of --chat")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as bad:
            raise BatchspecError(f"chat template failed: {bad}") from None


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
