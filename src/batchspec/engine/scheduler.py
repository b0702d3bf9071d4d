"""Continuous batching with chunked prefill: requests join between steps, finished ones leave, long prompts are
prefilled a chunk at a time while the running requests keep decoding.

`Scheduler` is bookkeeping only (no model, no cache tensors, as nano-vllm's): the waiting queue, the requests in
cache slots and the free slots. The engine drives it, one step at a time:

    scheduled = scheduler.schedule()        # admit waiting requests into free slots, decide what this step runs
    ...                                     # the engine's model work: the prefill chunks, or advance `running`
    outputs = scheduler.postprocess(scheduled)  # what each request got; finished ones release their slots

A request admitted into a slot is *prefilling* until its whole prompt is in the target's cache
(`Request.num_prefilled` counts what is), then *running* (decoding, or speculating). A step is either a prefill
step, which runs `chunks` of the prefilling requests' prompts, or a decoding / speculative step of every running
request, never both (the speculative step stays as it is):

- `prefill_chunk=None` (whole prompts): every prefilling request's whole prompt runs in the step that admits it, and
  the running requests wait for that step.
- `prefill_chunk=N`: a prefill step runs at most N prompt tokens in all, taken from the prefilling requests in
  admission order (`plan_chunks`: a long prompt spans several steps, several short ones share one). While some
  requests prefill and others run, the steps alternate (`prefill_turn`), so every running request advances at
  least every other step, however long the prompts that arrive.

Only the chunk that completes a prompt takes logits: the engine samples the request's first token there, and the
request runs from the next step on. Finished requests release their slots at the end of the step that finished
them; aborted ones (prefilling or running) at the start of the next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchspec.engine.request import Request
from batchspec.errors import BatchspecError
from batchspec.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: the tokens it committed and, once finished, why."""

    request_id: int
    new_token_ids: list[int]  # may end with the EOS token, which the request's visible output leaves out
    finish_reason: str | None  # "stop" | "length", None while running
    request: Request  # the request itself (text, timings, speculative counters); read it, do not change it


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, start + length) of one request, appended to its cache slot by a prefill step."""

    request: Request
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def completes(self) -> bool:
        """The chunk ends the prompt: its last position's logits give the request's first token."""
        return self.end == len(self.request.prompt_ids)


@dataclass(frozen=True)
class ScheduledStep:
    """One step's work: run the prefill `chunks`, or else advance every request in `running` by one decoding or
    speculative step. `admitted`: the requests given slots at this step (their prompts may run in later steps)."""

    admitted: list[Request]
    chunks: list[PrefillChunk]
    running: list[Request]

    @property
    def prefill(self) -> bool:
        return bool(self.chunks)


def plan_chunks(remaining: Sequence[int], budget: int | None) -> list[int]:
    """Prompt tokens each prefilling request runs in a prefill step, given what remains of each prompt (admission
    order): the first ones whole while the budget lasts, the next one the rest of the budget. Returns a length
    (>= 1) for each of the first requests that run; None: no budget, every prompt whole."""
    lengths = []
    left = budget
    for tokens in remaining:
        take = tokens if left is None else min(tokens, left)
        if take <= 0:
            break
        lengths.append(take)
        if left is not None:
            left -= take
    return lengths


def prefill_turn(prefilling: bool, running: bool, last_was_prefill: bool, alternate: bool) -> bool:
    """Whether a step prefills (else it advances the running requests). `alternate` (chunked prefill): never two
    prefill steps in a row while requests are running; otherwise prompts go first, as soon as they are admitted."""
    if not prefilling:
        return False
    return not (running and alternate and last_was_prefill)


class Scheduler:
    def __init__(self, num_slots: int, max_request_len: int, seed: int = 0, prefill_chunk: int | None = None) -> None:
        """`num_slots` requests run at once; a request's prompt + output may reach `max_request_len` tokens; unseeded
        requests draw their randomness from `seed` and their id; `prefill_chunk`: prompt tokens per prefill step
        (None: whole prompts, see the module docstring)."""
        self.max_request_len = max_request_len
        self.seed = seed
        self.prefill_chunk = prefill_chunk
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: the lowest free slot is handed out first
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # in slots, prompt not yet all in the cache; admission order
        self.running: list[Request] = []  # in slots, decoding
        self._requests: dict[int, Request] = {}  # waiting or in a slot, by id
        self._next_id = 0
        self._last_was_prefill = False

    # --- between steps -------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; it is admitted at the first step with a free slot. Returns its id (0, 1, 2, ...)."""
        if not prompt_ids:
            raise BatchspecError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_request_len:
            raise BatchspecError(f"the prompt has {len(prompt_ids)} tokens; with max_tokens {params.max_tokens} it "
                                 f"exceeds the context window of {self.max_request_len} tokens")
        request_id = self._next_id
        self._next_id += 1
        # Unseeded requests draw from the engine seed and their id: a rerun of the same workload repeats itself.
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + request_id
        request = Request(request_id, list(prompt_ids), params, torch.Generator().manual_seed(seed),
                          arrival_s=time.perf_counter())
        self.waiting.append(request)
        self._requests[request_id] = request
        return request_id

    def abort(self, request_id: int) -> bool:
        """Stop a request: a waiting one leaves at once, one in a slot (prefilling or running) frees it at the next
        step.

        Returns False if the request is unknown or already finished. No StepOutput is reported for it.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.slot is None:
            self.waiting.remove(request)
        request.finish_reason = "abort"
        request.finish_s = time.perf_counter()
        return True

    def request(self, request_id: int) -> Request:
        """A waiting or admitted request by id."""
        try:
            return self._requests[request_id]
        except KeyError:
            raise BatchspecError(f"no waiting or active request with id {request_id}") from None

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.prefilling + self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_active(self) -> int:
        """Requests holding a slot: prefilling or running."""
        return sum(not r.finished for r in self.prefilling + self.running)

    @property
    def num_prefilling(self) -> int:
        return sum(not r.finished for r in self.prefilling)

    # --- the step ------------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Admit waiting requests into free slots and decide what this step runs; None when there is nothing."""
        self._retire()  # aborted since the last step
        admitted = self._admit()
        if not self.prefilling and not self.running:
            return None
        if prefill_turn(bool(self.prefilling), bool(self.running), self._last_was_prefill,
                        alternate=self.prefill_chunk is not None):
            remaining = [len(r.prompt_ids) - r.num_prefilled for r in self.prefilling]
            lengths = plan_chunks(remaining, self.prefill_chunk)
            chunks = [PrefillChunk(r, r.num_prefilled, n) for r, n in zip(self.prefilling, lengths)]
            scheduled = ScheduledStep(admitted, chunks, [])
        else:
            scheduled = ScheduledStep(admitted, [], list(self.running))
        self._last_was_prefill = scheduled.prefill
        return scheduled

    def postprocess(self, scheduled: ScheduledStep) -> list[StepOutput]:
        """After the model work: count the prefilled tokens, move completed prompts to running, report each running
        request's new tokens, retire the finished ones."""
        for chunk in scheduled.chunks:
            chunk.request.num_prefilled = chunk.end
        self.running += [r for r in self.prefilling if r.num_prefilled == len(r.prompt_ids)]
        self.prefilling = [r for r in self.prefilling if r.num_prefilled < len(r.prompt_ids)]
        outputs = []
        for request in self.running:
            new = request.output_ids[request.num_reported:]
            request.num_reported = len(request.output_ids)
            if new or request.finished:
                outputs.append(StepOutput(request.index, new, request.finish_reason, request))
        self._retire()
        return outputs

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and self._free_slots:
            request = self.waiting.popleft()
            request.slot = self._free_slots.pop()
            admitted.append(request)
        self.prefilling += admitted
        return admitted

    def _retire(self) -> None:
        """Release the slots of finished and aborted requests (both models' caches use the same slot numbers)."""
        for request in self.prefilling + self.running:
            if request.finished:
                self._free_slots.append(request.slot)
                self._requests.pop(request.index, None)
        self._free_slots.sort(reverse=True)
        self.prefilling = [r for r in self.prefilling if not r.finished]
        self.running = [r for r in self.running if not r.finished]
