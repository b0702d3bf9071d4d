"""The engine's step API (`open`, `add_request`, `abort`, `step`): requests join between steps, aborts free slots,
outputs match `generate`."""

from __future__ import annotations

import pytest

from batchspec import Engine, SamplingParams
from batchspec.engine.request import spec_metrics
from batchspec.errors import BatchspecError
from batchspec.weights.loading import load_model


def test_add_abort_step_and_slot_reuse(tiny_model_factory):
    engine = Engine(load_model(tiny_model_factory()), max_batch_size=2)
    prompts = [engine.encode_prompt(p, chat=False) for p in ("def f(x):", "Hello there", "import os")]
    engine.open(num_slots=2, max_len=64)
    scheduler = engine.scheduler
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True))
    second = engine.add_request(prompts[1], SamplingParams(max_tokens=40, ignore_eos=True))
    third = engine.add_request(prompts[2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert (first, second, third) == (0, 1, 2)

    streamed: dict[int, list[int]] = {first: [], second: [], third: []}
    finished = {}

    def step():
        outputs = engine.step()
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = out.request
        return outputs

    outputs = step()  # two slots: the first two are admitted and prefilled, the third waits
    assert [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in outputs] == [(0, 1, None), (1, 1, None)]
    assert scheduler.num_waiting == 1 and scheduler.num_free_slots == 0

    assert engine.abort(second) and not engine.abort(second) and not engine.abort(99)
    outputs = step()  # the aborted request's slot is freed first, so the third one is admitted
    assert [o.request_id for o in outputs] == [third] and scheduler.num_waiting == 0
    while engine.has_work():
        step()
    assert set(finished) == {first, third} and scheduler.num_free_slots == 2
    assert len(streamed[second]) == 1  # its prefill token, nothing after the abort
    alone = engine.generate(["def f(x):"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert streamed[first] == finished[first].output_ids == alone.token_ids
    metrics = spec_metrics(finished[first])
    assert metrics["target_steps"] == 5 and metrics["mean_accepted_length"] == 1.0
    assert metrics["acceptance_rate"] is None and metrics["drafted_tokens"] == 0


def test_abort_waiting_request_and_refuse_overlong(tiny_model_factory):
    engine = Engine(load_model(tiny_model_factory()), max_batch_size=1)
    engine.open(num_slots=1, max_len=32)
    scheduler = engine.scheduler
    ids = engine.encode_prompt("Hello", chat=False)
    kept = scheduler.add_request(ids, SamplingParams(max_tokens=3))
    dropped = scheduler.add_request(ids, SamplingParams(max_tokens=3))
    assert scheduler.abort(dropped) and scheduler.num_waiting == 1
    while engine.has_work():
        assert all(o.request_id == kept for o in engine.step())
    with pytest.raises(BatchspecError, match="exceeds the context window of 32"):
        scheduler.add_request(ids, SamplingParams(max_tokens=40))
    with pytest.raises(BatchspecError, match="empty"):
        scheduler.add_request([], SamplingParams())
