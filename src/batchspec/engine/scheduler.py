"""Continuous batching: requests join between steps, every step advances all active requests, finished ones leave.

`Scheduler` is bookkeeping only (no model, no cache tensors, as nano-vllm's): the waiting queue, the active list
and the free cache slots. The engine drives it, one step at a time:

    scheduled = scheduler.schedule()        # admit waiting requests into free slots
    ...                                     # the engine's model work: prefill the admitted, or advance the active
    outputs = scheduler.postprocess(scheduled)  # what each request got; finished ones release their slots

A step either prefills the requests admitted into free slots or, when nobody was admitted, decodes (or runs one
speculative step for) every active request. Finished requests release their slots at the end of the step that
finished them; aborted ones at the start of the next step.
"""

from __future__ import annotations

import time
from collections import deque
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
class ScheduledStep:
    """One step's work: prefill `admitted` (just given slots), or else advance every request in `active`."""

    admitted: list[Request]
    active: list[Request]

    @property
    def prefill(self) -> bool:
        return bool(self.admitted)


class Scheduler:
    def __init__(self, num_slots: int, max_request_len: int, seed: int = 0) -> None:
        """`num_slots` requests run at once; a request's prompt + output may reach `max_request_len` tokens; unseeded
        requests draw their randomness from `seed` and their id."""
        self.max_request_len = max_request_len
        self.seed = seed
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: the lowest free slot is handed out first
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self._requests: dict[int, Request] = {}  # waiting or active, by id
        self._next_id = 0

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
        """Stop a request: a waiting one leaves at once, an active one frees its slot at the next step.

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
        """A waiting or active request by id."""
        try:
            return self._requests[request_id]
        except KeyError:
            raise BatchspecError(f"no waiting or active request with id {request_id}") from None

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.active)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_active(self) -> int:
        return sum(not r.finished for r in self.active)

    # --- the step ------------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Admit waiting requests into free slots; None when there is nothing to run."""
        self._retire()  # aborted since the last step
        admitted = self._admit()
        if not admitted and not self.active:
            return None
        return ScheduledStep(admitted, self.active)

    def postprocess(self, scheduled: ScheduledStep) -> list[StepOutput]:
        """After the model work: report each request's new tokens, retire the finished ones."""
        self.active += scheduled.admitted
        outputs = []
        for request in self.active:
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
        return admitted

    def _retire(self) -> None:
        """Release the slots of finished and aborted requests (both models' caches use the same slot numbers)."""
        still = []
        for request in self.active:
            if request.finished:
                self._free_slots.append(request.slot)
                self._free_slots.sort(reverse=True)
                self._requests.pop(request.index, None)
            else:
                still.append(request)
        self.active = still
