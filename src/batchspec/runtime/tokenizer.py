"""Tokenizer and chat template read from a checkpoint directory (`tokenizer.json` + `tokenizer_config.json`).

Uses the `tokenizers` library directly (fast to import) and renders the chat template with jinja2 the way
transformers does (`trim_blocks`, `lstrip_blocks`, `raise_exception`); tests check both against transformers.

User text is always tokenised as plain text: `<|im_start|>` typed into a prompt or a chat message becomes the
characters `<`, `|`, `im`, ..., never the control token, so a user cannot close their turn and forge a system or
assistant turn. Special tokens come only from the chat template itself (`encode_chat`).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
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
            self._text_tok = _text_only_tokenizer(path)
        except Exception as bad:  # tokenizers raises a bare Exception on malformed files
            raise BatchspecError(f"cannot read tokenizer {path}: {bad}") from None
        self._added_ids = {token.content: i for i, token in self._tok.get_added_tokens_decoder().items()}
        # Longest first, so that at each position the regex takes the longest added token, as the tokenizer does.
        alternatives = "|".join(re.escape(text) for text in sorted(self._added_ids, key=len, reverse=True)) or "(?!)"
        self._added_pattern = re.compile(f"({alternatives})")
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
        """Text that holds control tokens on purpose (an EOS string we appended, a template we trust): every
        added-token string in it becomes its token. Never call this on user text: use `encode_text` or `encode_chat`."""
        # Chat templates already contain their special tokens, so never add more (BOS) here.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """User text as token ids, every added-token string in it (`<|im_start|>`, `<tool_call>`) read as plain text."""
        return self._text_tok.encode(text, add_special_tokens=False).ids if text else []

    def encode_user_message(self, content: str) -> list[int]:
        """One user turn in the chat template, with the generation prompt, as token ids."""
        return self.encode_chat([{"role": "user", "content": content}])

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages in the template, as token ids: the template's special tokens are control tokens, the message
        contents are plain text (`encode_text`).

        The template is rendered with each content replaced by a marker, so the render splits into template pieces
        and contents. The tokenizer cuts its input at added tokens and encodes the text between them independently,
        so we do the same: cut the template pieces at their added tokens and encode each run of text between two of
        them (template text + content + template text) as one piece of plain text. For contents without added-token
        strings this gives exactly `encode(apply_chat_template(messages))` (given added tokens that strip no
        whitespace, `lstrip`/`rstrip` false, as in our tokenizers; tests check both).
        """
        rendered = self.apply_chat_template(messages, add_generation_prompt)
        nonce = secrets.token_hex(8)  # unguessable, so no content or template can contain a marker by chance
        marked = [dict(m, content=f"\ue000{nonce}:{i}\ue001") if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        # [template, content index, template, content index, ..., template]
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", self.apply_chat_template(marked, add_generation_prompt))
        pieces = [part if k % 2 == 0 else messages[int(part)]["content"] for k, part in enumerate(parts)]
        if "".join(pieces) != rendered:
            return self._encode_transformed_chat(messages, rendered)
        ids, text = [], []
        for k, part in enumerate(parts):
            if k % 2:  # a message's content: plain text, whatever it holds
                text.append(pieces[k])
                continue
            for j, piece in enumerate(self._added_pattern.split(part)):  # [text, added token, text, ...]
                if j % 2:
                    ids += self.encode_text("".join(text)) + [self._added_ids[piece]]
                    text = []
                else:
                    text.append(piece)
        return ids + self.encode_text("".join(text))

    def _encode_transformed_chat(self, messages: list[dict[str, str]], rendered: str) -> list[int]:
        """A template that changes the contents (e.g. `| trim`; ours insert them verbatim) hides where they are in the
        render. Without an added-token string in any content, tokenising the render cannot forge a turn; with one,
        refuse rather than guess."""
        for message in messages:
            content = message.get("content")
            found = self._added_pattern.search(content) if isinstance(content, str) else None
            if found:
                raise BatchspecError(f"message content contains {found.group()!r}, which this model's chat template "
                                     f"cannot keep as plain text")
        return self.encode(rendered)

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


def _text_only_tokenizer(path: Path) -> HFTokenizer:
    """A second tokenizer from the same file that reads every added token as plain text.

    `encode_special_tokens` makes a tokenizer encode the special tokens' strings as text, but only tokens marked
    special (Qwen's `<tool_call>` is not), so mark them all (re-adding an added token keeps its id). Set once here and
    never toggled: the server tokenises from several threads at once, and toggling a shared tokenizer would race.
    """
    tokenizer = HFTokenizer.from_file(str(path))
    tokenizer.add_special_tokens([AddedToken(token.content, single_word=token.single_word, lstrip=token.lstrip,
                                             rstrip=token.rstrip, normalized=token.normalized, special=True)
                                  for token in tokenizer.get_added_tokens_decoder().values() if not token.special])
    tokenizer.encode_special_tokens = True
    return tokenizer


@functools.lru_cache(maxsize=8)  # a compile took ~23 ms per chat prompt (Qwen's); a Template renders thread-safely
def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
