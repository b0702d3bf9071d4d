"""The OpenAI HTTP API as the server speaks it: request bodies (pydantic) and response, chunk and error bodies.

Only what changes the output is accepted: fields this engine cannot honour (n > 1, logprobs, echo, penalties,
tools, ...) are refused with a message naming them, not silently ignored. Unknown fields are ignored, as the
OpenAI clients send a few optional ones. Types are strict: "5" is not an integer and 1.5 is not a string.
Content parts other than text (images, audio, files) get one `unsupported_content_part` error, which
`serving.errors` answers with 400, as OpenAI and vLLM answer an image sent to a text-only model.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

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


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_shape(prompt):
    """One error for a prompt of none of OpenAI's four shapes, not one per shape it failed to be."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and (
            all(_is_id(p) for p in prompt) or all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt))):
        return prompt
    raise ValueError("must be a string, an array of token ids, an array of strings (one choice each) or an array of "
                     "token-id arrays (one choice each)")


class CompletionRequest(SamplingFields):
    # A prompt is text or token ids; a list of them (strings, or lists of ids) asks for one choice per prompt.
    prompt: Annotated[Text | list[StrictInt] | Annotated[list[Text], Field(min_length=1)]
                      | Annotated[list[list[StrictInt]], Field(min_length=1)], BeforeValidator(_prompt_shape)]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: Text | None = None

    @model_validator(mode="after")
    def _supported_completion(self):
        if self.echo or self.logprobs is not None or self.suffix is not None or self.best_of not in (None, 1):
            raise ValueError("echo, logprobs, suffix and best_of are not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt, as text or token ids, in choice order; one prompt (text or ids) is a list of one."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):  # [] is one (empty) id prompt
            return [prompt]
        return list(prompt)

    def one_prompt(self, prompt: str | list[int]) -> CompletionRequest:
        """This request with only `prompt` (one of `prompts`): each prompt is tokenised and run on its own."""
        return self.model_copy(update={"prompt": prompt})

    @property
    def prompt_value(self) -> str | list[int]:
        """The prompt of a one-prompt request (see `one_prompt`) as text or token ids."""
        prompts = self.prompts
        if len(prompts) != 1:
            raise ValueError(f"prompt_value of a request with {len(prompts)} prompts; split it with one_prompt")
        return prompts[0]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


def _text_parts_only(content):
    """Refuses a content part that is not text (image_url, input_audio, file, ...) with one error naming it, before
    the union below would report every way the whole list fails to be a string or a list of text parts."""
    if isinstance(content, list):
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError("unsupported_content_part",
                                          "unsupported content part type {kind}; this server takes text parts only",
                                          {"kind": repr(kind), "index": index})
    return content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    # null (or no content) only for an assistant message: clients replay those after tool calls.
    content: Annotated[Text | Annotated[list[TextPart], Field(min_length=1)] | None,
                       BeforeValidator(_text_parts_only)] = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content, info: ValidationInfo):
        role = info.data.get("role")  # absent when the role itself was invalid: that error is reported instead
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of text parts); "
                             f"only assistant messages may have null content")
        return content

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"} for the chat template; developer messages are system messages to these models, null
        content is empty text."""
        if self.content is None:
            text = ""
        else:
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
    """OpenAI's error body. `code` is never null: clients branch on it, so a caller without one gets its type's."""
    return {"error": {"message": message, "type": type, "param": param, "code": code or _DEFAULT_CODES.get(type, type)}}


_DEFAULT_CODES = {"invalid_request_error": "invalid_request", "server_error": "internal_error",
                  "rate_limit_error": "rate_limit_exceeded"}


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def total_usage(usages: list[dict]) -> dict:
    """The usage of a request with several prompts: token counts and speculative counters add up, the two ratios
    are recomputed from the sums (tokens emitted per target step: mean_accepted_length x target_steps each)."""
    if len(usages) == 1:
        return usages[0]
    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    specs = [u["spec"] for u in usages]
    counters = {key: sum(s[key] for s in specs) for key in ("drafted_tokens", "verified_tokens", "accepted_tokens")}
    steps = sum(s["target_steps"] for s in specs)
    step_tokens = sum(round(s["mean_accepted_length"] * s["target_steps"]) for s in specs if s["target_steps"])
    verified = counters["verified_tokens"]
    spec = {"policy": specs[0]["policy"], **counters,
            "acceptance_rate": counters["accepted_tokens"] / verified if verified else None,
            "mean_accepted_length": step_tokens / steps if steps else None, "target_steps": steps}
    return {**total, "spec": spec}


class ResponseFormatter:
    """The response body, or the stream chunks, of one request to either endpoint (one choice per prompt).

    `usage` is OpenAI's (prompt_tokens, completion_tokens, total_tokens) plus `spec`: the speculative counters of the
    request (`request.spec_metrics` and the policy; summed over prompts by `total_usage`). A response body always
    has it. A stream has it as OpenAI sends it: only with stream_options.include_usage, and then once, in a last
    chunk with no choices (`usage_only`), every other chunk carrying `"usage": null`; so a client that adds up the
    usage of every chunk counts each token once.
    """

    def __init__(self, chat: bool, model: str, include_usage: bool = False) -> None:
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.include_usage = include_usage  # a stream with stream_options.include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, object_name: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None or self.include_usage:
            body["usage"] = usage
        return body

    def whole(self, outputs: list[tuple[str, str]], usage: dict) -> dict:
        """The response body: outputs are (text, finish_reason) in prompt order."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                        "logprobs": None} for i, (text, reason) in enumerate(outputs)]
            return self._envelope("chat.completion", choices, usage)
        choices = [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                   for i, (text, reason) in enumerate(outputs)]
        return self._envelope("text_completion", choices, usage)  # the same shape as a stream's chunks

    def chunk(self, text: str | None, finish_reason: str | None = None, index: int = 0) -> dict:
        """Output of the prompt `index`; text None: no content (the finishing chunk of a chat stream has an empty
        delta)."""
        if not self.chat:
            choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("text_completion", [choice])
        delta = {} if text is None else {"content": text}
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk", [choice])

    def role_chunk(self) -> dict:
        """The first chunk of a chat stream."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_only(self, usage: dict) -> dict:
        """The last chunk of a stream with stream_options.include_usage: the whole request's usage, no choices."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
