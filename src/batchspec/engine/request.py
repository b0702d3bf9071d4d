"""One request's state through the engine, its finishing rules (EOS, stop string, max_tokens) and its output.

Everything here is bookkeeping on plain lists and ints; the model never appears. The engine appends tokens with
`commit_tokens`; the scheduler and the server read `output_of` and `spec_metrics`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from batchspec.runtime.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Request:
    index: int  # position in `Engine.generate`'s prompt list, or the scheduler's request id
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    num_prefilled: int = 0  # prompt tokens in the target's cache (the scheduler counts them; chunked prefill)
    draft_pending: list[int] = field(default_factory=list)  # committed tokens the draft's cache lacks
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str | None = None  # the output cut before a stop string, once one is hit
    first_token_s: float | None = None
    finish_s: float | None = None
    num_reported: int = 0  # output tokens already handed out by `Scheduler.step`
    # Per-request speculative counters (the batch-wide ones live in RunStats).
    target_steps: int = 0  # decode / verification steps this request took part in (prefill not counted)
    drafted_tokens: int = 0  # tokens the draft proposed for it (K' per speculative step)
    verified_tokens: int = 0  # of those, sent to the target (its window l per step)
    accepted_tokens: int = 0  # of those, accepted
    windows: list[int] = field(default_factory=list)  # its window l at each speculative step (when the run keeps them)

    def uniform(self, n: int = 1) -> torch.Tensor:
        """Uniform draws from this request's own generator, so a seeded request is reproducible in any batch."""
        return torch.rand(n, generator=self.generator)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens_from(self, start: int) -> list[int]:
        """Committed tokens (prompt + output) from position `start` on."""
        if start >= len(self.prompt_ids):
            return self.output_ids[start - len(self.prompt_ids):]
        return self.prompt_ids[start:] + self.output_ids


@dataclass
class GenerationOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    ttft_s: float
    latency_s: float

    def as_dict(self) -> dict:
        return dict(vars(self))


def commit_tokens(request: Request, tokens: list[int], now: float, eos_ids: Collection[int], tokenizer) -> int:
    """Append emitted tokens to a request until it finishes; returns how many were appended.

    Tokens after the finishing one (a step may emit several at once) are dropped.
    """
    if request.first_token_s is None:
        request.first_token_s = now
    eos = () if request.params.ignore_eos else eos_ids
    appended = 0
    for token in tokens:
        request.output_ids.append(token)
        appended += 1
        if token in eos:
            request.finish_reason = "stop"
        elif request.params.stop and _hit_stop_string(request, tokenizer):
            request.finish_reason = "stop"
        elif len(request.output_ids) >= request.params.max_tokens:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            request.finish_s = now
            break
    return appended


def _hit_stop_string(request: Request, tokenizer) -> bool:
    text = tokenizer.decode(request.output_ids)
    cut = min((text.find(s) for s in request.params.stop if s in text), default=-1)
    if cut < 0:
        return False
    request.text = text[:cut]  # like vLLM, the stop string itself is not returned
    return True


def visible_ids(request: Request, eos_ids: Collection[int]) -> list[int]:
    """The output token ids a user sees: without the final EOS token."""
    ids = request.output_ids
    if request.finish_reason == "stop" and ids and ids[-1] in eos_ids:
        return ids[:-1]
    return ids


def visible_text(request: Request, eos_ids: Collection[int], tokenizer) -> str:
    """The output text so far: cut before the stop string once one is hit, without EOS."""
    if request.text is not None:
        return request.text
    return tokenizer.decode(visible_ids(request, eos_ids))


def output_of(request: Request, eos_ids: Collection[int], tokenizer) -> GenerationOutput:
    return GenerationOutput(
        index=request.index, text=visible_text(request, eos_ids, tokenizer), token_ids=visible_ids(request, eos_ids),
        finish_reason=request.finish_reason or "length", num_prompt_tokens=len(request.prompt_ids),
        ttft_s=(request.first_token_s or request.arrival_s) - request.arrival_s,
        latency_s=(request.finish_s or request.arrival_s) - request.arrival_s,
    )


def spec_metrics(request: Request) -> dict:
    """Per-request speculative counters, as the server reports them next to `usage`.

    mean_accepted_length: tokens emitted per target step (1 + accepted drafts); prefill emits the first output token
    and is not a step. acceptance_rate: accepted / verified drafts (None when nothing was verified, e.g. under ar).
    """
    step_tokens = max(0, len(request.output_ids) - 1)
    return {
        "drafted_tokens": request.drafted_tokens,
        "verified_tokens": request.verified_tokens,
        "accepted_tokens": request.accepted_tokens,
        "acceptance_rate": request.accepted_tokens / request.verified_tokens if request.verified_tokens else None,
        "mean_accepted_length": step_tokens / request.target_steps if request.target_steps else None,
        "target_steps": request.target_steps,
    }
