"""The model work of a step: both models, their KV caches, and the passes the engine asks for.

One slot per active request, the same slot number in both caches. Prefill runs packed prompts through the target
(the draft runs them with its first draft pass, as pending input); a decoding step runs the target on one token per
request; a speculative step hands the models and caches to `spec.step.run`. Sampling and appending tokens to
requests are the engine's.
"""

from __future__ import annotations

import time

import torch

from batchspec.engine.request import Request
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

    def _run_target(self, slots: torch.Tensor, num_new: torch.Tensor, tokens: torch.Tensor, logit_rows: torch.Tensor,
                    stats: RunStats) -> torch.Tensor:
        started = time.perf_counter()
        out = self.target.transformer.forward(self.target_cache, slots, num_new, tokens, logit_rows=logit_rows)
        stats.count_target(time.perf_counter() - started, int(tokens.numel()))
        return out.logits

    def prefill(self, group: list[Request], stats: RunStats) -> torch.Tensor:
        """Run the prompts of newly admitted requests, packed, through the target. Returns (G, V) logits of each
        prompt's last position. The draft's cache starts empty: the prompt is its pending input, run with the first
        draft pass — so a policy that decides not to draft (goodput Tetris, dsd's k = 0) never pays for it."""
        num_new, tokens, last_rows = ragged_inputs([r.prompt_ids for r in group])
        slots = torch.tensor([r.slot for r in group])
        self.target_cache.lengths[slots] = 0  # a slot handed out again starts empty
        if self.draft_cache is not None:
            self.draft_cache.lengths[slots] = 0
        return self._run_target(slots, num_new, tokens, last_rows, stats)

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
