"""The engine's step API (`open`, `add_request`, `abort`, `step`): requests join between steps, aborts free slots,
outputs match `generate`. Chunked prefill: the scheduler's plan of each step (property tests, no model) and, on
tiny models, the same greedy and seeded tokens as whole prompts for `ar` and speculative policies."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec import Engine, SamplingParams
from batchspec.engine.request import Request, commit_tokens, spec_metrics
from batchspec.engine.scheduler import Scheduler, plan_chunks, prefill_turn
from batchspec.errors import BatchspecError
from batchspec.runtime.model import Transformer
from batchspec.spec.config import SpecConfig
from batchspec.spec.step_time import RowTimeTable, StepCost, StepTimeModel
from batchspec.weights.loading import LoadedModel, load_model


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


# --- chunked prefill: the plan of each step, on the scheduler alone (no model) ---------------------------------------

FAST = settings(max_examples=200, derandomize=True, deadline=None)


@FAST
@given(st.lists(st.integers(1, 50), max_size=8), st.one_of(st.none(), st.integers(1, 64)))
def test_plan_chunks_fills_the_budget_in_admission_order(remaining, budget):
    lengths = plan_chunks(remaining, budget)
    if budget is None:
        assert lengths == remaining  # whole prompts
        return
    assert sum(lengths) <= budget and all(n >= 1 for n in lengths)
    assert lengths[:-1] == remaining[:len(lengths) - 1]  # only the last request that runs may be cut
    if lengths:
        assert lengths[-1] <= remaining[len(lengths) - 1]
    if sum(lengths) < budget:
        assert lengths == remaining  # budget left over only when every prompt is done


def test_prefill_turn():
    # Chunked: prompts and running requests take turns; nobody running or nothing to prefill: no turns.
    assert prefill_turn(True, True, last_was_prefill=False, alternate=True)
    assert not prefill_turn(True, True, last_was_prefill=True, alternate=True)
    assert prefill_turn(True, False, last_was_prefill=True, alternate=True)
    assert not prefill_turn(False, True, last_was_prefill=False, alternate=True)
    # Whole prompts: prompts first, as soon as they are admitted.
    assert prefill_turn(True, True, last_was_prefill=True, alternate=False)


def _drive(arrivals, num_slots, chunk, aborts):
    """Run a Scheduler as the engine does, with a fake model that emits token 7, checking every step's plan.

    arrivals: (step, prompt length, max_tokens) per request; aborts: (request, step) pairs. Returns the kinds of the
    steps run ("P" prefill, "D" decode) and each prefill step's chunks as (request, start, length).
    """
    scheduler = Scheduler(num_slots, max_request_len=10_000, prefill_chunk=chunk)
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])  # ids are handed out in arrival order
    requests: dict[int, Request] = {}
    covered: dict[int, list[int]] = {}  # request id -> prompt positions prefilled, in order
    waited: dict[int, int] = {}  # running request id -> steps since it last advanced
    kinds, plans = [], []
    for step in range(10_000):
        for i in order:
            if arrivals[i][0] == step:
                request_id = scheduler.add_request([5] * arrivals[i][1], SamplingParams(max_tokens=arrivals[i][2]))
                requests[request_id] = scheduler.request(request_id)
        for index, at in aborts:
            if at == step and index in requests:
                scheduler.abort(index)
        if not scheduler.has_work() and step > max(a[0] for a in arrivals):
            break
        running_before = [r for r in scheduler.running if not r.finished]
        scheduled = scheduler.schedule()
        if scheduled is None:
            continue
        in_slots = scheduler.prefilling + scheduler.running
        assert len({r.slot for r in in_slots}) == len(in_slots) <= num_slots  # a slot holds one request
        kinds.append("P" if scheduled.prefill else "D")
        if scheduled.prefill:
            assert not scheduled.running
            plans.append([(c.request.index, c.start, c.length) for c in scheduled.chunks])
            assert [c.request for c in scheduled.chunks] == scheduler.prefilling[:len(scheduled.chunks)]
            lengths = [c.length for c in scheduled.chunks]
            remaining = [len(r.prompt_ids) - r.num_prefilled for r in scheduler.prefilling]
            assert lengths == plan_chunks(remaining, chunk)  # the budget, in admission order
            if chunk is None:
                assert all(c.start == 0 and c.completes for c in scheduled.chunks)
                assert len(scheduled.chunks) == len(scheduler.prefilling)
            else:
                assert not (running_before and len(kinds) > 1 and kinds[-2] == "P")  # alternation
            for c in scheduled.chunks:
                covered.setdefault(c.request.index, []).extend(range(c.start, c.end))
                if c.completes:  # the first token comes from the chunk that ends the prompt
                    commit_tokens(c.request, [7], 0.0, (), None)
        else:
            assert scheduled.running == running_before
            for r in scheduled.running:
                commit_tokens(r, [7], 0.0, (), None)
        for r in running_before:
            waited[r.index] = 0 if not scheduled.prefill else waited.get(r.index, 0) + 1
            if chunk is not None:
                assert waited[r.index] <= 1  # every running request advances at least every other step
        outputs = scheduler.postprocess(scheduled)
        assert all(o.request.num_prefilled == len(o.request.prompt_ids) for o in outputs)
    else:
        raise AssertionError("the scheduler never ran out of work")
    assert scheduler.num_free_slots == num_slots and scheduler.num_active == 0
    for request_id, request in requests.items():
        if request.finish_reason == "abort":
            assert covered.get(request_id, []) == list(range(len(covered.get(request_id, []))))
            continue
        assert covered[request_id] == list(range(len(request.prompt_ids)))  # each prompt token once, in order
        assert len(request.output_ids) == request.params.max_tokens
    return "".join(kinds), plans


@FAST
@given(arrivals=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40), st.integers(1, 6)), min_size=1,
                         max_size=8),
       num_slots=st.integers(1, 4), chunk=st.one_of(st.none(), st.integers(1, 20)),
       aborts=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 30)), max_size=3))
def test_chunk_plans_respect_budget_order_coverage_and_alternation(arrivals, num_slots, chunk, aborts):
    _drive(arrivals, num_slots, chunk, aborts)


def test_a_long_prompt_takes_turns_with_the_running_stream():
    # Request 0 (3 prompt tokens, 8 output tokens) runs from step 0; request 1 (10 tokens) arrives at step 1 and is
    # prefilled 4 + 4 + 2 tokens, one chunk every other step, while request 0 decodes in between.
    kinds, plans = _drive([(0, 3, 8), (1, 10, 2)], num_slots=2, chunk=4, aborts=[])
    assert kinds == "P" + "DPDPDP" + "DDDD"
    assert plans == [[(0, 0, 3)], [(1, 0, 4)], [(1, 4, 4)], [(1, 8, 2)]]
    kinds, plans = _drive([(0, 3, 8), (1, 10, 2)], num_slots=2, chunk=None, aborts=[])
    assert kinds == "P" + "P" + "DDDDDDD"  # whole prompts: request 0 waits for the whole prompt, in one step
    assert plans == [[(0, 0, 3)], [(1, 0, 10)]]
    # A third request arriving at step 3 shares the last chunk of the second.
    kinds, plans = _drive([(0, 3, 8), (1, 10, 2), (3, 2, 2)], num_slots=3, chunk=4, aborts=[])
    assert plans == [[(0, 0, 3)], [(1, 0, 4)], [(1, 4, 4)], [(1, 8, 2), (2, 0, 2)]]


def test_abort_while_prefilling_frees_the_slot():
    scheduler = Scheduler(num_slots=1, max_request_len=100, prefill_chunk=4)
    long = scheduler.add_request([5] * 10, SamplingParams(max_tokens=2))
    short = scheduler.add_request([5] * 3, SamplingParams(max_tokens=2))
    scheduled = scheduler.schedule()
    assert [(c.request.index, c.start, c.length) for c in scheduled.chunks] == [(long, 0, 4)]
    assert scheduler.postprocess(scheduled) == [] and scheduler.num_active == 1 and scheduler.num_waiting == 1
    assert scheduler.request(long).num_prefilled == 4
    assert scheduler.abort(long) and scheduler.has_work()
    scheduled = scheduler.schedule()  # the slot is free again: the short request takes it
    assert [(c.request.index, c.start, c.length) for c in scheduled.chunks] == [(short, 0, 3)]
    assert scheduled.admitted[0].slot == 0


# --- chunked prefill end to end on tiny models: the same tokens as whole prompts -------------------------------------

MIXED_PROMPTS = ["def fibonacci(n):", "The capital of France is Paris. " * 8, "import numpy as np\n" * 5, "Once",
                 "x = [1, 2, 3]\nprint(sum(x))\n" * 7, "Hello there"]  # 2 to ~90 tokens
# Drafting looks cheap, so that goodput Tetris (capacity auto) drafts some steps and verifies varying windows.
CHEAP_STEPS = StepCost(StepTimeModel(c_fixed=1.0, c_draft_step=0.0, c_draft_token=0.0, c_target_token=0.001),
                       RowTimeTable((1, 64), (1.0, 1.63)), RowTimeTable((1, 64), (0.01, 0.01)))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, default_model_dir) -> tuple[LoadedModel, LoadedModel]:
    """A tiny target and its copy with a perturbed LM head as the draft (acceptance ~0.5)."""
    target = load_model(make_tiny_model(tmp_path_factory.mktemp("chunked") / "target", default_model_dir))
    base = target.transformer
    noise = 0.02 * torch.randn(base.lm_head.shape, generator=torch.Generator().manual_seed(0))
    draft = Transformer(base.config, base.embed, base.layers, base.final_norm, base.lm_head + noise)
    return target, LoadedModel("noisy", target.model_dir, draft, target.tokenizer)


def _spec_engine(pair, policy: str, **kwargs) -> Engine:
    target, draft = pair
    capacity = "auto" if policy == "tetris-auto" else None
    spec = SpecConfig(policy=policy.split("-")[0], k=3, extra=2, capacity=capacity)
    return Engine(target, None if policy == "ar" else draft, spec, step_time=CHEAP_STEPS, **kwargs)


@pytest.mark.parametrize("policy", ["ar", "sd", "tetris", "tetris-auto"])
def test_chunked_prefill_greedy_equals_whole_prompts(tiny_pair, policy):
    # Batch 3 < 6 prompts of 2 to ~90 tokens: prompts span many chunks, share chunks, and join while others run.
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    whole = [o.token_ids for o in _spec_engine(tiny_pair, "ar", max_batch_size=3).generate(MIXED_PROMPTS, params)]
    for chunk in (3, 7, 16):
        engine = _spec_engine(tiny_pair, policy, max_batch_size=3, prefill_chunk=chunk)
        assert [o.token_ids for o in engine.generate(MIXED_PROMPTS, params)] == whole, chunk
        if policy != "ar":
            assert 0.05 < engine.metrics()["vsr"] < 0.95  # both accept and reject paths ran


@pytest.mark.parametrize("policy", ["ar", "sd", "tetris"])
def test_chunked_prefill_seeded_sampling_equals_whole_prompts(tiny_pair, policy):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    whole = _spec_engine(tiny_pair, policy, max_batch_size=3).generate(MIXED_PROMPTS, params)
    chunked = _spec_engine(tiny_pair, policy, max_batch_size=3, prefill_chunk=7).generate(MIXED_PROMPTS, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_running_stream_advances_while_a_long_prompt_is_prefilled(tiny_pair):
    engine = _spec_engine(tiny_pair, "sd", max_batch_size=2, prefill_chunk=8)
    runner_ids = engine.encode_prompt("def f(x):", chat=False)
    long_ids = engine.encode_prompt(MIXED_PROMPTS[4], chat=False)
    engine.open(num_slots=2, max_len=256)
    short = engine.add_request(runner_ids, SamplingParams(max_tokens=40, ignore_eos=True))
    outputs = engine.step()
    assert [o.request_id for o in outputs] == [short]  # its prompt fits one chunk: its first token
    streamed = {short: outputs[0].new_token_ids}
    long = engine.add_request(long_ids, SamplingParams(max_tokens=6, ignore_eos=True))
    streamed[long] = []
    kinds = ""
    while not streamed[long]:
        outputs = engine.step()
        step = engine.last_step
        kinds += "P" if step.prefill else "D"
        got = {o.request_id for o in outputs}
        if step.prefill:
            assert [c.request.index for c in step.chunks] == [long] and step.chunks[0].length <= 8
            assert short not in got
        else:
            assert got == {short}
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
    assert kinds == "DP" * -(-len(long_ids) // 8)  # ceil(P / 8) chunks, each after a decoding step
    request, runner = engine.scheduler.request(long), engine.runner
    # The draft ran the chunks too: both caches hold the prompt, only the first token is pending for the draft.
    assert int(runner.target_cache.lengths[request.slot]) == int(runner.draft_cache.lengths[request.slot]) == len(
        long_ids)
    assert request.draft_pending == streamed[long] == request.output_ids[:1]
    while engine.has_work():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
    alone = _spec_engine(tiny_pair, "ar", max_batch_size=1).generate(["def f(x):", MIXED_PROMPTS[4]],
                                                                       SamplingParams(max_tokens=40, ignore_eos=True))
    assert streamed[short] == alone[0].token_ids and streamed[long] == alone[1].token_ids[:6]


def test_abort_while_prefilling_frees_the_slot_for_the_next(tiny_pair):
    engine = _spec_engine(tiny_pair, "sd", max_batch_size=1, prefill_chunk=4)
    engine.open(num_slots=1, max_len=256)
    first = engine.add_request(engine.encode_prompt(MIXED_PROMPTS[1], chat=False), SamplingParams(max_tokens=4))
    second = engine.add_request(engine.encode_prompt("Hello there", chat=False),
                                SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.step() == [] and engine.scheduler.num_active == 1 and engine.scheduler.num_waiting == 1
    assert engine.abort(first)
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() if o.request_id == second for t in o.new_token_ids]
    assert engine.scheduler.num_free_slots == 1
    alone = _spec_engine(tiny_pair, "ar", max_batch_size=1).generate(["Hello there"],
                                                                       SamplingParams(max_tokens=8, ignore_eos=True))
    assert tokens == alone[0].token_ids


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_bad_prefill_chunk_is_refused(tiny_pair, chunk):
    with pytest.raises(BatchspecError, match="prefill_chunk must be a number of tokens >= 1"):
        Engine(tiny_pair[0], prefill_chunk=chunk)
