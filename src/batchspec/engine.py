"""The generation engine: requests in, texts out, over a batch that requests join and leave independently.

`Engine.generate(prompts, SamplingParams)` is the library API the CLI and server are thin layers over. The step loop
admits waiting requests into free KV-cache slots (prefill), then decodes every active request in one batched
forward per step, retiring each request as soon as it finishes (EOS, stop string or max_tokens).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from batchspec.errors import BatchspecError
from batchspec.kv_cache import KVCache
from batchspec.loading import LoadedModel, load_model
from batchspec.sampling import SamplingParams, params_tensors, sample_with_uniforms, token_probs

Prompt = str | list[dict[str, str]]  # plain text, or chat messages [{"role": ..., "content": ...}]


def configure_threads(threads: int | None = None) -> int:
    """Use every core this process may run on (torch's default can differ inside containers)."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # "stop" | "length"
    text: str = ""
    first_token_s: float | None = None
    finish_s: float | None = None

    def uniform(self) -> torch.Tensor:
        """One uniform draw from this request's own generator, so a seeded request is reproducible in any batch."""
        return torch.rand(1, generator=self.generator)


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


@dataclass
class RunStats:
    """Counters of one `generate` call; the metric definitions live in DESIGN.md section 6."""

    wall_s: float = 0.0
    target_s: float = 0.0
    target_calls: int = 0
    target_tokens: int = 0
    emitted_tokens: int = 0
    steps: int = 0

    def as_dict(self) -> dict:
        out = dict(vars(self))
        out["tokens_per_s"] = self.emitted_tokens / self.wall_s if self.wall_s else 0.0
        out["ter_tokens_per_s"] = self.emitted_tokens / self.target_s if self.target_s else 0.0
        return out


class Engine:
    def __init__(self, target: LoadedModel, max_batch_size: int = 16, prefill_tokens: int = 2048,
                 seed: int = 0) -> None:
        if max_batch_size < 1:
            raise BatchspecError(f"batch size must be at least 1, got {max_batch_size}")
        self.target = target
        self.max_batch_size = max_batch_size
        self.prefill_tokens = prefill_tokens
        self.seed = seed
        self.stats = RunStats()

    @classmethod
    def from_pretrained(cls, target: str = "default", **kwargs) -> Engine:
        configure_threads()
        return cls(load_model(target), **kwargs)

    # --- prompts -> requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool) -> list[int]:
        tokenizer = self.target.tokenizer
        if isinstance(prompt, list):
            text = tokenizer.apply_chat_template(prompt)
        elif chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            text = prompt
        return tokenizer.encode(text)

    def _make_requests(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                       chat: bool) -> list[Request]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise BatchspecError(f"got {len(params)} sampling parameter sets for {len(prompts)} prompts")
        context = self.target.config.max_position_embeddings
        now = time.perf_counter()
        requests = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
                raise BatchspecError(f"prompt {index} is empty")
            ids = self.encode_prompt(prompt, chat)
            if not ids:
                raise BatchspecError(f"prompt {index} is empty after tokenisation")
            if len(ids) + p.max_tokens > context:
                raise BatchspecError(
                    f"prompt {index} has {len(ids)} tokens; with max_tokens {p.max_tokens} it exceeds the "
                    f"context window of {context} tokens"
                )
            generator = torch.Generator().manual_seed(p.seed if p.seed is not None else self.seed * 1_000_003 + index)
            requests.append(Request(index, ids, p, generator, arrival_s=now))
        return requests

    # --- the step loop -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False, progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if not prompts:
            raise BatchspecError("no prompts given")
        requests = self._make_requests(prompts, params or SamplingParams(), chat)
        longest = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        cache = self.target.transformer.new_cache(min(self.max_batch_size, len(requests)), longest + 1)
        self.stats = RunStats()
        bar = _progress_bar(len(requests), progress)
        start = time.perf_counter()
        waiting, active = deque(requests), []
        while waiting or active:
            admitted = []
            while waiting and cache.num_free:
                request = waiting.popleft()
                request.slot = cache.allocate()
                admitted.append(request)
            if admitted:
                self._prefill(cache, admitted)
                active += admitted
            else:
                self._decode_step(cache, active)
            still = []
            for request in active:
                if request.finish_reason is None:
                    still.append(request)
                else:
                    cache.release(request.slot)
                    bar.update(1)
            active = still
        self.stats.wall_s = time.perf_counter() - start
        bar.close()
        return [self._output(r) for r in requests]

    def _run_target(self, cache: KVCache, slots: torch.Tensor, num_new: torch.Tensor, tokens: torch.Tensor,
                    logit_rows: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = self.target.transformer.forward(cache, slots, num_new, tokens, logit_rows=logit_rows)
        self.stats.target_s += time.perf_counter() - started
        self.stats.target_calls += 1
        self.stats.target_tokens += int(tokens.numel())
        return out.logits

    def _prefill(self, cache: KVCache, admitted: list[Request]) -> None:
        """Run the prompts of newly admitted requests, packed, in chunks of about `prefill_tokens` tokens."""
        group: list[Request] = []
        for request in admitted + [None]:
            if request is not None and (not group or sum(len(r.prompt_ids) for r in group) + len(
                    request.prompt_ids) <= self.prefill_tokens):
                group.append(request)
                continue
            num_new = torch.tensor([len(r.prompt_ids) for r in group])
            tokens = torch.tensor([t for r in group for t in r.prompt_ids])
            slots = torch.tensor([r.slot for r in group])
            logits = self._run_target(cache, slots, num_new, tokens, torch.cumsum(num_new, 0) - 1)
            self._sample_and_commit(group, logits)
            group = [request] if request is not None else []

    def _decode_step(self, cache: KVCache, active: list[Request]) -> None:
        slots = torch.tensor([r.slot for r in active])
        tokens = torch.tensor([r.output_ids[-1] for r in active])
        ones = torch.ones(len(active), dtype=torch.int64)
        logits = self._run_target(cache, slots, ones, tokens, torch.arange(len(active)))
        self._sample_and_commit(active, logits)
        self.stats.steps += 1

    def _sample_and_commit(self, requests: list[Request], logits: torch.Tensor) -> None:
        """logits (N, V), one row per request: sample the next token and append it."""
        params = [r.params for r in requests]
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            probs = token_probs(logits, *params_tensors(params))
            uniforms = torch.cat([r.uniform() for r in requests])
            tokens = sample_with_uniforms(probs, uniforms)
        now = time.perf_counter()
        for request, token in zip(requests, tokens.tolist()):
            self._commit(request, [token], now)

    def _commit(self, request: Request, tokens: list[int], now: float) -> None:
        """Append emitted tokens to a request and decide whether it is finished."""
        if request.first_token_s is None:
            request.first_token_s = now
        eos = () if request.params.ignore_eos else self.target.eos_token_ids
        for token in tokens:
            request.output_ids.append(token)
            self.stats.emitted_tokens += 1
            if token in eos:
                request.finish_reason = "stop"
            elif request.params.stop and self._hit_stop_string(request):
                request.finish_reason = "stop"
            elif len(request.output_ids) >= request.params.max_tokens:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                request.finish_s = now
                return

    def _hit_stop_string(self, request: Request) -> bool:
        text = self.target.tokenizer.decode(request.output_ids)
        cut = min((text.find(s) for s in request.params.stop if s in text), default=-1)
        if cut < 0:
            return False
        request.text = text[:cut]  # like vLLM, the stop string itself is not returned
        return True

    def _output(self, request: Request) -> GenerationOutput:
        ids = request.output_ids
        if request.finish_reason == "stop" and ids and ids[-1] in self.target.eos_token_ids:
            ids = ids[:-1]
        text = request.text if request.text else self.target.tokenizer.decode(ids)
        return GenerationOutput(
            index=request.index, text=text, token_ids=ids, finish_reason=request.finish_reason or "length",
            num_prompt_tokens=len(request.prompt_ids),
            ttft_s=(request.first_token_s or request.arrival_s) - request.arrival_s,
            latency_s=(request.finish_s or request.arrival_s) - request.arrival_s,
        )


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, leave=False)
