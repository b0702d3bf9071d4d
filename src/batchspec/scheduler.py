"""Continuous batching: requests join between steps, every step advances all active requests, finished ones leave.

`Scheduler` owns the KV caches (one slot per active request) and the waiting and active lists; the engine does the
model work of one step (`Engine.run_step`). `Engine.generate` is a loop over this API, and the server's engine thread
drives the same API while requests arrive and leave at any time:

    scheduler = engine.new_scheduler(num_slots=16, max_len=2048)
    request_id = scheduler.add_request(prompt_ids, SamplingParams(max_tokens=32))
    while scheduler.has_work():
        for out in scheduler.step():
            ...  # out.request_id, out.new_token_ids, out.finish_reason

A step either prefills the requests admitted into free slots or, when nobody was admitted, decodes (or runs one
speculative step for) every active request. Finished requests release their slots at the end of the step that
finished them; aborted ones at the start of the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from batchspec.errors import BatchspecError
from batchspec.request import Request
from batchspec.sampling import SamplingParams


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: the tokens it committed and, once finished, why."""

    request_id: int
    new_token_ids: list[int]  # may end with the EOS token, which the request's visible output leaves out
    finish_reason: str | None  # "stop" | "length", None while running
    request: Request  # the request itself (text, timings, speculative counters); read it, do not change it


class Scheduler:
    def __init__(self, engine, num_slots: int, max_len: int) -> None:
        """engine: the `Engine` whose models run the steps; caches hold `num_slots` requests of `max_len` tokens."""
        self.engine = engine
        self.target_cache = engine.target.transformer.new_cache(num_slots, max_len)
        self.draft_cache = engine.draft.transformer.new_cache(num_slots, max_len) if engine.speculative else None
        # Longest prompt + output a request may have: the cache, less one step's speculative overshoot.
        self.max_request_len = min(engine.context_length, self.target_cache.max_len)
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
        seed = params.seed if params.seed is not None else self.engine.seed * 1_000_003 + request_id
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
    def num_active(self) -> int:
        return sum(not r.finished for r in self.active)

    # --- the step ------------------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Admit and prefill, or advance every active request by one (speculative) step."""
        self._retire()  # aborted since the last step
        admitted = self._admit()
        if not admitted and not self.active:
            return []
        self.engine.run_step(self.target_cache, self.draft_cache, admitted, self.active)
        self.active += admitted
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
        while self.waiting and self.target_cache.num_free:
            request = self.waiting.popleft()
            request.slot = self.target_cache.allocate()
            admitted.append(request)
        return admitted

    def _retire(self) -> None:
        """Release the slots of finished and aborted requests (the draft cache mirrors the target's slots)."""
        still = []
        for request in self.active:
            if request.finished:
                self.target_cache.release(request.slot)
                self._requests.pop(request.index, None)
            else:
                still.append(request)
        self.active = still
