"""The generation engine: requests in, texts out, over a batch that requests join and leave independently.

`Engine.generate(prompts, SamplingParams)` is the library API the CLI is a thin layer over. The engine owns a run's
scheduler (`scheduler.py`: admission into free cache slots, retiring finished requests), its model runner
(`model_runner.py`: both models and their caches) and its policy (`spec.policies`: how much to draft, which drafts
the target verifies). A step is schedule -> model work -> postprocess, as nano-vllm's `LLMEngine.step`; the server's
engine thread drives the same `open` / `add_request` / `step` API while requests arrive and leave at any time:

    engine.open(num_slots=16, max_len=2048)
    request_id = engine.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for out in engine.step():
            ...  # out.request_id, out.new_token_ids, out.finish_reason

Prefill: `prefill_chunk=None` runs each admitted prompt whole, in the step that admits it (packed in groups of about
`prefill_tokens` tokens), and the running requests wait for that step. `prefill_chunk=N` (chunked prefill) runs at
most N prompt tokens per prefill step, as one ragged forward of the target (and of the draft, for a speculative
policy, so that its first draft pass has no prompt left to run), alternating with decoding / speculative steps
while requests are running; the step that completes a prompt samples the request's first token. Greedy and seeded
outputs are the same either way for a float32 target; a bfloat16 one prefills whole prompts one per forward on
its full-width kernels (`ModelRunner.prefills_alone`), chunks on its batch-invariant ones, so there the two modes
are two computations of the target (each lossless policy reproduces `ar` within either). See `scheduler.py` for the
plan of each step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from batchspec.engine.model_runner import ModelRunner
from batchspec.engine.request import GenerationOutput, Request, commit_tokens, output_of
from batchspec.engine.scheduler import PrefillChunk, ScheduledStep, Scheduler, StepOutput
from batchspec.errors import BatchspecError
from batchspec.runtime.allocator import keep_freed_memory
from batchspec.runtime.precision import DEFAULT_TARGET_DTYPE
from batchspec.runtime.sampling import SamplingParams, greedy_tokens, params_tensors, sample_with_uniforms, token_probs
from batchspec.runtime.threads import configure_threads
from batchspec.spec.config import SpecConfig
from batchspec.spec.policies import Policy, StepTime, make_policy, policy_class
from batchspec.spec.policies.goodput import pass_rows
from batchspec.spec.stats import RunStats, StepOutcome, summarize
from batchspec.spec.step_time import step_cost
from batchspec.weights.loading import LoadedModel, check_draft_compatible, load_model

Prompt = str | list[dict[str, str]]  # plain text, or chat messages [{"role": ..., "content": ...}]


def draft_pass_rows(drafted: list[int], catch_up: list[int]) -> list[int]:
    """Rows of each draft pass of a step (`goodput.pass_rows`), the first one also over each drafting request's
    catch-up (the tokens its draft cache lacked)."""
    rows = pass_rows(np.asarray(drafted, dtype=np.int64)).tolist()
    if rows:
        rows[0] += sum(lag for lag, made in zip(catch_up, drafted) if made)
    return rows


class Engine:
    """Batched generation with the target alone (`ar`), speculatively with a draft (sd, dsd, tetris, oracle; all
    lossless), or with SPRINTER's learned verifier (`sprinter`, approximate)."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, spec: SpecConfig | None = None,
                 max_batch_size: int = 16, prefill_tokens: int = 2048, seed: int = 0,
                 step_time: StepTime | None = None, prefill_chunk: int | None = None) -> None:
        """`step_time`: the step-cost model (dsd's T(B, k); a `StepCost` for tetris --capacity auto), used as given;
        None profiles this machine when a run that needs it first opens, and the engine's copy then keeps learning
        from the forwards it times (`StepCost.learn`). `prefill_chunk`: prompt tokens per prefill step (chunked
        prefill), None for whole prompts (see the module docstring)."""
        if max_batch_size < 1:
            raise BatchspecError(f"batch size must be at least 1, got {max_batch_size}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise BatchspecError(f"prefill_chunk must be a number of tokens >= 1 (or None: whole prompts), "
                                 f"got {prefill_chunk!r}")
        self.spec = spec or SpecConfig()
        policy = policy_class(self.spec.policy)
        policy.validate(self.spec, max_batch_size)
        speculative = policy.speculative
        if speculative and draft is None:
            raise BatchspecError(f"policy {self.spec.policy!r} needs a draft model (--draft)")
        if draft is not None:
            check_draft_compatible(target, draft)
            if draft.transformer.device != target.transformer.device:
                raise BatchspecError(f"the draft is on {draft.transformer.device}, the target on "
                                     f"{target.transformer.device}: load both on one device")
        verifier = None
        if self.spec.verifier is not None and speculative:
            from batchspec.spec.verifier import load_verifier

            verifier = load_verifier(self.spec.verifier, draft)  # refuses one trained for another draft
        # SPRINTER's learned verifier goes to the policy that uses it (sprinter, or Tetris scored by it).
        self.policy: Policy = make_policy(self.spec, verifier, max_batch_size)
        if target.transformer.precision == "int4":
            raise BatchspecError("int4 weights are a draft's option (--draft-dtype int4); the target's must stay "
                                 "batch-invariant: use float32, bfloat16 or int8")
        self.target = target
        self.draft = draft
        if draft is not None and draft is not target:
            # The draft only proposes: its rounding may depend on the batch (faster bfloat16 kernels), the
            # target's may not (`Transformer.batch_invariant`).
            draft.transformer.batch_invariant = False
        for model in (target, draft) if draft is not None else (target,):
            model.transformer.pack_weights()  # oneDNN's layout now, not on the first request
        keep_freed_memory()  # the forwards' buffers stay mapped from call to call (after loading's temporaries went)
        self.max_batch_size = max_batch_size
        self.prefill_tokens = prefill_tokens
        self.prefill_chunk = prefill_chunk
        self.seed = seed
        self.step_time = step_time
        self._learns_costs = False  # whether `step_time` is this engine's own profile, kept current
        self.stats = RunStats()  # counters of the last `generate` (or, in a server, since the engine started)
        self.last_requests: list[Request] = []  # of the last `generate`, for metrics()
        self.scheduler: Scheduler | None = None  # of the open run
        self.runner: ModelRunner | None = None
        self.last_step: ScheduledStep | None = None  # what the last `step` ran (a server's step metrics read it)
        self._trace = None
        self._keep_windows = True
        self._run = 0  # runs opened (`open`)

    @classmethod
    def from_pretrained(cls, target: str = "default", draft: str | None = None, draft_dtype: str = "auto",
                        target_dtype: str = DEFAULT_TARGET_DTYPE, device: str = "cpu", **kwargs) -> Engine:
        """Load both models by name or path, each in its dtype (`precision.PRECISIONS`; the draft also `auto`), on
        `device` (`cpu`, `cuda`: `runtime.device`)."""
        configure_threads()
        spec = kwargs.get("spec")
        # The draft's shipped head vocabulary, except under a SPRINTER verifier (it reads log q and entropy over the
        # full head).
        shipped_head = spec is None or spec.verifier is None
        return cls(load_model(target, dtype=target_dtype, device=device),
                   load_model(draft, dtype=draft_dtype, device=device, shipped_head=shipped_head) if draft else None,
                   **kwargs)

    # --- prompts -> requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool) -> list[int]:
        tokenizer = self.target.tokenizer
        # User text never yields control tokens: a chat's special tokens come from its template, and a plain prompt
        # is all text (who needs control tokens sends token ids).
        if isinstance(prompt, list):
            return tokenizer.encode_chat(prompt)
        return tokenizer.encode_user_message(prompt) if chat else tokenizer.encode_text(prompt)

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

    # --- a run: open, add requests, step -----------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False, progress: bool = False, trace=None) -> list[GenerationOutput]:
        """Generate for every prompt; outputs come back in prompt order. Counters end up in `self.stats`.

        `trace`: an optional `engine.trace.TraceRecorder`, given every step's draft log-probs and true acceptance
        probabilities whenever they are measured (`SpecConfig.measure_oracle` or the oracle policy).
        """
        if not prompts:
            raise BatchspecError("no prompts given")
        encoded = self._encode_all(prompts, params or SamplingParams(), chat)
        # Room for the longest request plus one step's speculative overshoot (rolled back afterwards).
        longest = max(len(ids) + p.max_tokens for ids, p in encoded) + self.max_draft_length() + 2
        self.open(min(self.max_batch_size, len(encoded)), longest, trace=trace)
        self.stats = RunStats()
        requests = [self.scheduler.request(self.add_request(ids, p)) for ids, p in encoded]  # ids 0..n-1
        bar = _progress_bar(len(requests), progress)
        start = time.perf_counter()
        while self.has_work():
            bar.update(sum(out.finish_reason is not None for out in self.step()))
        self.stats.wall_s = time.perf_counter() - start - self.stats.measure_s
        bar.close()
        self.close()
        self.last_requests = requests
        return [self.output(r) for r in requests]

    def open(self, num_slots: int, max_len: int, trace=None, keep_windows: bool = True) -> None:
        """Start a run: a fresh scheduler and fresh caches of `num_slots` requests of up to `max_len` tokens (profiles
        dsd's step time on first use). `keep_windows`: keep every step's windows in `stats.window_history` (off in a
        long-lived server); `trace`: as in `generate`."""
        if self.policy.needs_step_time and self.step_time is None:  # timed forwards, cached on disk
            self.step_time = step_cost(self.target.transformer, self.draft.transformer, self.max_batch_size,
                                       self.spec.k_max, self.policy.max_draft_length() if self.policy.needs_row_times
                                       else None)
            self._learns_costs = True
        if self._learns_costs and hasattr(self.step_time, "refresh"):
            self.step_time.refresh(self.target.transformer, self.draft.transformer, num_slots)
        self.close()  # the previous run's caches go before the new ones are allocated
        self.runner = ModelRunner(self.target, self.draft if self.policy.speculative else None, num_slots, max_len)
        # Longest prompt + output a request may have: the cache, less one step's speculative overshoot.
        self.scheduler = Scheduler(num_slots, min(self.context_length, self.runner.max_len), self.seed,
                                   self.prefill_chunk)
        self._trace, self._keep_windows = trace, keep_windows
        self._run += 1  # request ids restart at 0 in each run: the policy tells requests apart by (run, id)

    def close(self) -> None:
        """End the open run: its scheduler and its caches are released."""
        self.scheduler = self.runner = None

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a request of the open run; returns its id (0, 1, 2, ...)."""
        return self.scheduler.add_request(prompt_ids, params)

    def abort(self, request_id: int) -> bool:
        """Stop a request of the open run (see `Scheduler.abort`)."""
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Schedule -> model work -> postprocess: run the scheduled prompt chunks, or else advance every running
        request by a decoding or speculative step."""
        scheduled = self.last_step = self.scheduler.schedule()
        if scheduled is None:
            return []
        if scheduled.prefill:
            self._prefill(scheduled.chunks)
        elif self.policy.speculative:
            self._speculate(scheduled.running)
        else:
            self._decode(scheduled.running)
        return self.scheduler.postprocess(scheduled)

    def metrics(self) -> dict:
        """DESIGN.md section 6 metrics of the last `generate` call.

        Per-request latencies are wall-clock and so still include `--measure-oracle`'s untimed passes.
        """
        outputs = [self.output(r) for r in self.last_requests]
        return summarize(self.stats, [o.latency_s for o in outputs], [o.ttft_s for o in outputs])

    def max_draft_length(self) -> int:
        """Most draft tokens one step may write past a request's committed length (cache head-room)."""
        return self.policy.max_draft_length()

    # --- the model work of a step ---------------------------------------------------------------------------------

    def _prefill(self, chunks: list[PrefillChunk]) -> None:
        """Run prompt chunks, packed in groups of about `prefill_tokens` tokens (a single group when chunked with a
        budget of at most that; one whole prompt per group for a bfloat16 target, `ModelRunner.prefills_alone`);
        sample the first token of each request whose prompt a chunk completes."""
        alone = self.prefill_chunk is None and self.runner.prefills_alone  # one whole prompt per forward
        group: list[PrefillChunk] = []
        for chunk in chunks + [None]:
            if chunk is not None and (not group or not alone
                                      and sum(c.length for c in group) + chunk.length <= self.prefill_tokens):
                group.append(chunk)
                continue
            logits = self.runner.prefill(group, self.stats, with_draft=self.prefill_chunk is not None, alone=alone)
            completed = [c.request for c in group if c.completes]
            if completed:
                self._sample_and_commit(completed, logits)
            for request in completed:
                # What the draft's cache lacks: the whole sequence (its first draft pass runs the prompt) or, when
                # it ran the chunks too, the first token only.
                request.draft_pending = request.tokens_from(self.runner.draft_length(request))
            group = [chunk] if chunk is not None else []

    def _decode(self, active: list[Request]) -> None:
        logits = self.runner.decode(active, self.stats)
        before = self.stats.emitted_tokens
        self._sample_and_commit(active, logits)
        for request in active:
            request.target_steps += 1
        self.stats.record_step(len(active), StepOutcome(self.stats.emitted_tokens - before))

    def _speculate(self, active: list[Request]) -> None:
        """One speculative step: 1 + accepted tokens per request, both caches rolled back to what was committed."""
        catch_up = [len(r.draft_pending) - 1 for r in active]  # what each request's draft cache lacks
        plan = self.policy.plan(len(active), self.step_time, [(self._run, r.index) for r in active],
                                catch_up=catch_up, remaining=[r.params.max_tokens - len(r.output_ids) for r in active])
        plan = plan.clamped(self.runner.room(active), len(active))
        target_s, draft_s = self.stats.target_s, self.stats.draft_s
        if plan.k_prime == 0:
            self._decode(active)
            self._learn_costs(len(active), [], [], self.stats.target_s - target_s, 0.0)
            self.runner.resync_draft(active)
            return
        on_measured = None
        if self._trace is not None:
            def on_measured(logprobs, accept_probs):  # mid-step, as `trace.fit_from_trace` expects
                self._trace.record(active, logprobs, accept_probs, self.stats)
        result = self.runner.speculate(active, self.policy, plan, self.stats, measure=self._measures,
                                       on_measured=on_measured)
        if not self._measures:  # a measured step's target time includes the oracle's pass
            self._learn_costs(len(active), result.windows, draft_pass_rows(result.drafted, catch_up),
                              self.stats.target_s - target_s, self.stats.draft_s - draft_s)
        before = self.stats.emitted_tokens
        now = time.perf_counter()
        for row, request in enumerate(active):
            self.commit(request, result.emitted(row), now)
            request.target_steps += 1
            request.drafted_tokens += result.drafted[row]
            request.verified_tokens += result.windows[row]
            request.accepted_tokens += result.accepted[row]
            if self._keep_windows:
                request.windows.append(result.windows[row])
        self.runner.resync_draft(active)
        outcome = StepOutcome(self.stats.emitted_tokens - before, result.windows, result.accepted, result.expected)
        self.stats.record_step(len(active), outcome, keep_windows=self._keep_windows)

    def _learn_costs(self, batch: int, windows: list[int], pass_rows: list[int], target_s: float,
                     draft_s: float) -> None:
        """Keep the step-cost model's tables current with what this step's forwards took (`StepCost.learn`)."""
        learn = getattr(self.step_time, "learn", None) if self._learns_costs else None
        if learn is not None:
            rows = batch + sum(windows)
            learn(rows, batch * (max(windows, default=0) + 1) - rows, target_s, pass_rows, draft_s)

    @property
    def _measures(self) -> bool:
        """The untimed oracle pass (`--measure-oracle`); an approximate policy has no oracle to compare with."""
        return self.spec.measure_oracle and self.policy.lossless

    def _sample_and_commit(self, requests: list[Request], logits: torch.Tensor) -> None:
        """logits (N, V), one row per request: sample the next token and append it."""
        params = [r.params for r in requests]
        if all(p.greedy for p in params):
            tokens = greedy_tokens(logits)
        else:
            probs = token_probs(logits.cpu(), *params_tensors(params))  # the draws are the host's
            uniforms = torch.cat([r.uniform() for r in requests])
            tokens = sample_with_uniforms(probs, uniforms)
        now = time.perf_counter()
        for request, token in zip(requests, tokens.tolist()):
            self.commit(request, [token], now)

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
