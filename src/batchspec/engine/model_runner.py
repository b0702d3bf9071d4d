"""The model work of a step: both models, their KV caches, and the passes the engine asks for.

One slot per admitted request, the same slot number in both caches. Prefill runs packed prompt chunks through the
target: whole prompts, which the draft then runs with its first draft pass as pending input; or, with chunked
prefill, pieces of prompts, which the draft runs in the same step (a whole prompt pending would stall the first
speculative step as long as an unchunked prefill). A decoding step runs the target on one token per request; a
speculative step hands the models and caches to `spec.step.run`. Sampling and appending tokens to requests are the
engine's.
"""

from __future__ import annotations

import time

import torch

from batchspec.engine.request import Request
from batchspec.engine.scheduler import PrefillChunk
from batchspec.runtime.sampling import params_tensors
from batchspec.spec import step as spec_step
from batchspec.spec.policies import Plan, Policy
from batchspec.spec.proposal import ragged_inputs
from batchspec.spec.stats import RunStats
from batchspec.weights.loading import LoadedModel


class ModelRunner:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, num_slots: int, max_len: int) -> None:
        self.target = target
        self.draft = draft
        self.target_cache = target.transformer.new_cache(num_slots, max_len)
        self.draft_cache = draft.transformer.new_cache(num_slots, max_len) if draft is not None else None

    @property
    def max_len(self) -> int:
        return self.target_cache.max_len

    def _run_target(self, slots: torch.Tensor, num_new: torch.Tensor, tokens: torch.Tensor,
                    logit_rows: torch.Tensor | None, stats: RunStats, alone: bool = False) -> torch.Tensor | None:
        started = time.perf_counter()
        out = self.target.transformer.forward(self.target_cache, slots, num_new, tokens, logit_rows=logit_rows,
                                              all_logits=False, batch_invariant=False if alone else None)
        stats.count_target(time.perf_counter() - started, int(tokens.numel()))
        return out.logits

    @property
    def prefills_alone(self) -> bool:
        """Whole prompts go through the target one per forward, on its full-width kernels: a forward that holds
        one whole prompt is the same whatever else runs, so it needs no batch invariance, which costs a bfloat16
        target 2.1× in prefill (1.5B: 360 ms for a 170-token prompt instead of 754). Chunked prefill keeps the
        invariant kernels (a chunk's neighbours depend on the schedule), so in bfloat16 the two prefill modes are
        two computations of the target; within either, every lossless policy reproduces `ar`."""
        return self.target.transformer.invariance_costs

    def prefill(self, chunks: list[PrefillChunk], stats: RunStats, with_draft: bool = False,
                alone: bool = False) -> torch.Tensor | None:
        """Append prompt chunks, packed as one ragged forward, to their requests' target caches. Returns (F, V)
        logits of the last position of the F chunks that complete their prompts (None if none does). `alone`: the
        chunk is one whole prompt, run on the full-width kernels (`prefills_alone`).

        Without `with_draft` the draft's cache starts empty: the prompt is its pending input, run with the first
        draft pass — so a policy that decides not to draft (goodput Tetris, dsd's k = 0) never pays for it. With it
        (chunked prefill), the draft runs the same chunks now and ends the prompt level with the target.
        """
        if alone and not (len(chunks) == 1 and chunks[0].start == 0 and chunks[0].completes):
            raise ValueError("a prefill alone takes one whole prompt")
        num_new, tokens, last_rows = ragged_inputs([c.request.prompt_ids[c.start:c.end] for c in chunks])
        slots = torch.tensor([c.request.slot for c in chunks])
        first = slots[torch.tensor([c.start == 0 for c in chunks])]
        self.target_cache.lengths[first] = 0  # a slot handed out again starts empty
        if self.draft_cache is not None:
            self.draft_cache.lengths[first] = 0
        completes = torch.tensor([c.completes for c in chunks])
        # Logits only where a prompt ends; chunks that end mid-prompt leave nothing but their cache entries.
        logits = self._run_target(slots, num_new, tokens, last_rows[completes] if bool(completes.any()) else None,
                                  stats, alone=alone)
        if with_draft and self.draft_cache is not None:
            started = time.perf_counter()
            self.draft.transformer.forward(self.draft_cache, slots, num_new, tokens, all_logits=False)
            stats.draft_s += time.perf_counter() - started
        return logits

    def draft_length(self, request: Request) -> int:
        """Tokens of the request in the draft's cache (0 without a draft)."""
        return 0 if self.draft_cache is None else int(self.draft_cache.lengths[request.slot])

    def decode(self, active: list[Request], stats: RunStats) -> torch.Tensor:
        """The target on each request's last token. Returns (B, V) logits."""
        slots = torch.tensor([r.slot for r in active])
        tokens = torch.tensor([r.output_ids[-1] for r in active])
        ones = torch.ones(len(active), dtype=torch.int64)
        return self._run_target(slots, ones, tokens, torch.arange(len(active)), stats)

    def room(self, active: list[Request]) -> int:
        """Most drafts a step may write for these requests without running past either cache."""
        slots = torch.tensor([r.slot for r in active])
        return min(self.draft_cache.max_len - int(self.draft_cache.lengths[slots].max()) - 2,
                   self.target_cache.max_len - int(self.target_cache.lengths[slots].max()) - 1)

    def speculate(self, active: list[Request], policy: Policy, plan: Plan, stats: RunStats, measure: bool = False,
                  on_measured: spec_step.Measured | None = None) -> spec_step.StepResult:
        """One speculative step of `plan` (K' >= 1) for every active request; the target's cache is rolled back to
        each request's accepted prefix (the draft's waits for `resync_draft`, once the tokens are committed)."""
        params = [r.params for r in active]
        greedy_all = all(p.greedy for p in params)
        # Each request's randomness for this step from its own generator: K' draft draws, K' accept tests, 1 next.
        draws = None if greedy_all else torch.stack([r.uniform(2 * plan.k_prime + 1) for r in active])  # (B, 2K'+1)
        inputs = spec_step.StepInputs(
            slots=torch.tensor([r.slot for r in active]), last=torch.tensor([r.output_ids[-1] for r in active]),
            draft_pending=[r.draft_pending for r in active], sampling=None if greedy_all else params_tensors(params),
            draws=draws)
        models = spec_step.SpecModels(self.target.transformer, self.draft.transformer, self.target_cache,
                                      self.draft_cache)
        return spec_step.run(policy, plan, models, inputs, stats, measure=measure, on_measured=on_measured)

    def resync_draft(self, active: list[Request]) -> None:
        """Roll the draft back to the committed prefix it holds; what it lacks becomes its pending input."""
        for request in active:
            if request.finish_reason is not None:
                continue
            keep = min(int(self.draft_cache.lengths[request.slot]), request.num_tokens - 1)
            self.draft_cache.truncate(request.slot, keep)
            request.draft_pending = request.tokens_from(keep)
