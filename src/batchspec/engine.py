"""The generation engine: requests in, texts out, over a batch that requests join and leave independently.

`Engine.generate(prompts, SamplingParams)` is the library API the CLI is a thin layer over. It is a loop over
`scheduler.Scheduler` (admission into free KV-cache slots, retiring finished requests), which the server drives
directly; this module does the model work of each step: packed prefill and batched decode here, the speculative
step (propose -> select -> verify -> commit) in `speculative_step.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from batchspec import speculative, speculative_step
from batchspec.errors import BatchspecError
from batchspec.kv_cache import KVCache
from batchspec.loading import LoadedModel, check_draft_compatible, load_model
from batchspec.precision import DEFAULT_TARGET_DTYPE
from batchspec.metrics import RunStats, summarize
from batchspec.request import GenerationOutput, Request, commit_tokens, output_of
from batchspec.sampling import SamplingParams, params_tensors, sample_with_uniforms, token_probs
from batchspec.scheduler import Scheduler
from batchspec.dsd import AcceptanceEMA, StepTimeModel
from batchspec.speculative import SpecConfig

Prompt = str | list[dict[str, str]]  # plain text, or chat messages [{"role": ..., "content": ...}]


def configure_threads(threads: int | None = None) -> int:
    """Use every core this process may run on (torch's default can differ inside containers)."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


class Engine:
    """Batched generation with the target alone (`ar`), speculatively with a draft (sd, dsd, tetris, oracle; all
    lossless), or with SPRINTER's learned verifier (`sprinter`, approximate)."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, spec: SpecConfig | None = None,
                 max_batch_size: int = 16, prefill_tokens: int = 2048, seed: int = 0,
                 step_time: StepTimeModel | None = None, trace=None) -> None:
        """`step_time` is dsd's T(B, k) model; None profiles this machine on the first dsd `generate`.

        `trace`: an optional `trace.TraceRecorder`, given every step's draft log-probs and true acceptance
        probabilities whenever they are measured (`SpecConfig.measure_oracle` or the oracle policy).
        """
        if max_batch_size < 1:
            raise BatchspecError(f"batch size must be at least 1, got {max_batch_size}")
        self.spec = spec or SpecConfig()
        self.spec.validate(max_batch_size)
        if self.spec.policy != "ar" and draft is None:
            raise BatchspecError(f"policy {self.spec.policy!r} needs a draft model (--draft)")
        if draft is not None:
            check_draft_compatible(target, draft)
        if target.transformer.precision == "int4":
            raise BatchspecError("int4 weights are a draft's option (--draft-dtype int4); the target's must stay "
                                 "batch-invariant: use float32, bfloat16 or int8")
        self.target = target
        self.draft = draft
        for model in (target, draft) if draft is not None else (target,):
            model.transformer.pack_weights()  # oneDNN's layout now, not on the first request
        if draft is not None and draft is not target:
            # The draft only proposes: its rounding may depend on the batch (faster bfloat16 kernels), the
            # target's may not (`Transformer.batch_invariant`).
            draft.transformer.batch_invariant = False
        self.max_batch_size = max_batch_size
        self.prefill_tokens = prefill_tokens
        self.seed = seed
        self.stats = RunStats()
        self.last_requests: list[Request] = []  # of the last `generate`, for metrics()
        self.acceptance = AcceptanceEMA()  # dsd's running acceptance estimate
        self.step_time = step_time
        self.trace = trace
        self.record_windows = True  # keep every step's windows in stats.window_history (off in a long-lived server)
        self.verifier = None  # SPRINTER's learned verifier (sprinter policy, or Tetris scored by it)
        if self.spec.verifier is not None and self.speculative:
            from batchspec.sprinter import load_verifier

            self.verifier = load_verifier(self.spec.verifier, draft)  # refuses one trained for another draft

    @classmethod
    def from_pretrained(cls, target: str = "default", draft: str | None = None, draft_dtype: str = "auto",
                        target_dtype: str = DEFAULT_TARGET_DTYPE, **kwargs) -> Engine:
        """Load both models by name or path, each in its dtype (`precision.PRECISIONS`; the draft also `auto`)."""
        configure_threads()
        return cls(load_model(target, dtype=target_dtype), load_model(draft, dtype=draft_dtype) if draft else None,
                   **kwargs)

    # --- prompts -> requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool) -> list[int]:
        tokenizer = self.target.tokenizer
        if isinstance(prompt, list):
            return tokenizer.encode(tokenizer.apply_chat_template(prompt))
        return tokenizer.encode_user_message(prompt) if chat else tokenizer.encode(prompt)

    @property
    def context_length(self) -> int:
        """Longest prompt + output either model can take."""
        context = self.target.config.max_position_embeddings
        if self.draft is not None:
            context = min(context, self.draft.config.max_position_embeddings)
        return context

    def _encode_all(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                    chat: bool) -> list[tuple[list[int], SamplingParams]]:
        """(prompt ids, params) per prompt, every prompt checked before any work starts."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise BatchspecError(f"got {len(params)} sampling parameter sets for {len(prompts)} prompts")
        context = self.context_length
        encoded = []
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
            encoded.append((ids, p))
        return encoded

    # --- the step loop -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False, progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt; outputs come back in prompt order. Counters end up in `self.stats`."""
        if not prompts:
            raise BatchspecError("no prompts given")
        encoded = self._encode_all(prompts, params or SamplingParams(), chat)
        # Room for the longest request plus one step's speculative overshoot (rolled back afterwards).
        longest = max(len(ids) + p.max_tokens for ids, p in encoded) + self.max_draft_length() + 2
        scheduler = self.new_scheduler(min(self.max_batch_size, len(encoded)), longest)
        self.stats = RunStats()
        requests = [scheduler.request(scheduler.add_request(ids, p)) for ids, p in encoded]  # ids 0..n-1
        bar = _progress_bar(len(requests), progress)
        start = time.perf_counter()
        while scheduler.has_work():
            bar.update(sum(out.finish_reason is not None for out in scheduler.step()))
        self.stats.wall_s = time.perf_counter() - start - self.stats.measure_s
        bar.close()
        self.last_requests = requests
        return [self.output(r) for r in requests]

    def new_scheduler(self, num_slots: int, max_len: int) -> Scheduler:
        """A continuous-batching scheduler over fresh KV caches (profiles dsd's step time on first use)."""
        if self.spec.policy == "dsd" and self.step_time is None:
            self.step_time = self._profile_step_time()
        return Scheduler(self, num_slots, max_len)

    def run_step(self, target_cache: KVCache, draft_cache: KVCache | None, admitted: list[Request],
                 active: list[Request]) -> None:
        """One scheduler step: prefill the newly admitted requests, or else advance every active one."""
        if admitted:
            self._prefill(target_cache, draft_cache, admitted)
        elif self.speculative:
            speculative_step.run(self, target_cache, draft_cache, active)
        else:
            self.decode_step(target_cache, active)

    def metrics(self) -> dict:
        """DESIGN.md section 6 metrics of the last `generate` call.

        Per-request latencies are wall-clock and so still include `--measure-oracle`'s untimed passes.
        """
        outputs = [self.output(r) for r in self.last_requests]
        return summarize(self.stats, [o.latency_s for o in outputs], [o.ttft_s for o in outputs])

    @property
    def speculative(self) -> bool:
        return self.spec.policy != "ar"

    def max_draft_length(self) -> int:
        """Most draft tokens one step may write past a request's committed length (cache head-room)."""
        if not self.speculative:
            return 0
        if self.spec.policy == "sprinter":
            return self.spec.block_cap
        return max(self.spec.k + self.spec.extra, self.spec.k_max if self.spec.policy == "dsd" else 0)

    def _run_target(self, cache: KVCache, slots: torch.Tensor, num_new: torch.Tensor, tokens: torch.Tensor,
                    logit_rows: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = self.target.transformer.forward(cache, slots, num_new, tokens, logit_rows=logit_rows)
        self.count_target(time.perf_counter() - started, int(tokens.numel()))
        return out.logits

    def count_target(self, seconds: float, tokens: int) -> None:
        self.stats.target_s += seconds
        self.stats.target_calls += 1
        self.stats.target_tokens += tokens

    def _prefill(self, cache: KVCache, draft_cache: KVCache | None, admitted: list[Request]) -> None:
        """Run the prompts of newly admitted requests, packed, in chunks of about `prefill_tokens` tokens."""
        group: list[Request] = []
        for request in admitted + [None]:
            if request is not None and (not group or sum(len(r.prompt_ids) for r in group) + len(
                    request.prompt_ids) <= self.prefill_tokens):
                group.append(request)
                continue
            num_new, tokens, last_rows = speculative.ragged_inputs([r.prompt_ids for r in group])
            slots = torch.tensor([r.slot for r in group])
            logits = self._run_target(cache, slots, num_new, tokens, last_rows)
            if draft_cache is not None:
                started = time.perf_counter()
                draft_cache.lengths[slots] = 0  # the draft cache mirrors the target's slot numbers; start empty
                self.draft.transformer.forward(draft_cache, slots, num_new, tokens, all_logits=False)
                self.stats.draft_s += time.perf_counter() - started
            self._sample_and_commit(group, logits)
            for r in group:
                r.draft_pending = r.output_ids[-1:]
            group = [request] if request is not None else []

    def decode_step(self, cache: KVCache, active: list[Request]) -> None:
        slots = torch.tensor([r.slot for r in active])
        tokens = torch.tensor([r.output_ids[-1] for r in active])
        ones = torch.ones(len(active), dtype=torch.int64)
        logits = self._run_target(cache, slots, ones, tokens, torch.arange(len(active)))
        before = self.stats.emitted_tokens
        self._sample_and_commit(active, logits)
        for request in active:
            request.target_steps += 1
        self.stats.steps += 1
        self.stats.request_steps += len(active)
        self.stats.step_emitted += self.stats.emitted_tokens - before

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
            self.commit(request, [token], now)

    def _profile_step_time(self) -> StepTimeModel:
        """Fit dsd's step-time model T(B, k) from timed target and draft forwards on scratch caches."""
        from batchspec.profiling import cached_step_time

        return cached_step_time(self.target.transformer, self.draft.transformer, self.max_batch_size,
                                 self.spec.k_max)

    # --- finishing ------------------------------------------------------------------------------------------------

    def commit(self, request: Request, tokens: list[int], now: float) -> None:
        """Append emitted tokens to a request and decide whether it is finished."""
        self.stats.emitted_tokens += commit_tokens(request, tokens, now, self.target.eos_token_ids,
                                                   self.target.tokenizer)

    def output(self, request: Request) -> GenerationOutput:
        return output_of(request, self.target.eos_token_ids, self.target.tokenizer)


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, leave=False)
