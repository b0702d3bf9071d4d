"""The OpenAI HTTP API as the server speaks it: request bodies (pydantic) and response, chunk and error bodies.

Only what changes the output is accepted: fields this engine cannot honour (n > 1, logprobs, echo, penalties,
tools, ...) are refused with a message naming them, not silently ignored. Unknown fields are ignored, as the
OpenAI clients send a few optional ones. Types are strict: "5" is not an integer and 1.5 is not a string.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_STOP_STRINGS = 4  # as the OpenAI API


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode text") from None
    return text


def _non_empty(text: str) -> str:
    if not text:
        raise ValueError("must be a non-empty string")
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
StopString = Annotated[Text, AfterValidator(_non_empty)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # int or float JSON numbers, not strings


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1: off (vLLM's extension)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StopString | list[StopString] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension, for benchmarks
    n: StrictInt = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    user: Text | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError(f"n must be 1: this server returns one choice per request (got {self.n})")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (must be 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings (got {len(self.stop)})")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # One prompt per request: a string, a list holding one string, or token ids.
    prompt: Text | list[StrictInt] | list[Text]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: Text | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError(f"prompt: this server takes one prompt per request (got a list of {len(self.prompt)})")
        if self.echo or self.logprobs is not None or self.suffix is not None or self.best_of not in (None, 1):
            raise ValueError("echo, logprobs, suffix and best_of are not supported")
        return self

    @property
    def prompt_value(self) -> str | list[int]:
        """The prompt as text or as token ids."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)]

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"} for the chat template; developer messages are system messages to these models."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    tools: list | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.logprobs:
            raise ValueError("logprobs is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- response bodies -------------------------------------------------------------------------------------------------


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ResponseFormatter:
    """The response body, or the stream chunks, of one request to either endpoint.

    `usage` is OpenAI's (prompt_tokens, completion_tokens, total_tokens) plus `spec`: this request's speculative
    counters (`request.spec_metrics` and the policy). A stream's finishing chunk always carries it; with
    stream_options.include_usage a usage-only chunk (no choices) follows, as OpenAI sends it.
    """

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, object_name: str, choices: list[dict], usage: dict | None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
            return self._envelope("chat.completion", [choice], usage)
        return self.chunk(text, finish_reason, usage)  # a completion and its chunks have the same shape

    def chunk(self, text: str | None, finish_reason: str | None = None, usage: dict | None = None) -> dict:
        """text None: no content (the finishing chunk of a chat stream has an empty delta)."""
        if not self.chat:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("text_completion", [choice], usage)
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk", [choice], usage)

    def role_chunk(self) -> dict:
        """The first chunk of a chat stream."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        return self._envelope("chat.completion.chunk", [choice], None)

    def usage_only(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
