"""End to end on the real default model: batching and chunked prefill do not change greedy output; seeds reproduce;
stops work."""

from __future__ import annotations

import json

import pytest

from batchspec import Engine, SamplingParams
from batchspec.cli.main import main
from batchspec.datasets.prompts import humaneval_chat_prompt, humaneval_prompts

pytestmark = pytest.mark.slow  # real models end to end: left out of `pytest -m "not slow"`

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
]


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(default_model, max_batch_size=8)


def test_batched_greedy_equals_one_at_a_time(engine):
    prompts = PROMPTS[1:] + [humaneval_chat_prompt(p) for p in humaneval_prompts()[:2]]
    params = SamplingParams(max_tokens=32)
    batched = engine.generate(prompts, params, chat=True)
    for prompt, together in zip(prompts, batched):
        alone = engine.generate([prompt], params, chat=True)[0]
        assert alone.token_ids == together.token_ids, prompt


def test_requests_finish_independently(engine):
    params = [SamplingParams(max_tokens=n) for n in (3, 12, 1, 7)]
    outs = engine.generate(PROMPTS, params, chat=True)
    for p, out in zip(params, outs):
        assert out.finish_reason in ("stop", "length")
        assert len(out.token_ids) <= p.max_tokens
    assert [o.index for o in outs] == [0, 1, 2, 3]


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine.generate([PROMPTS[2]], params, chat=True)[0]
    mixed = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], params, chat=True)[1]
    assert alone.token_ids == mixed.token_ids
    other = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12, temperature=0.9, seed=99), chat=True)[0]
    assert other.token_ids != alone.token_ids


def test_stop_string_cuts_the_text(engine):
    free = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16), chat=True)[0]
    assert "def " in free.text
    cut = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16, stop=("def ",)), chat=True)[0]
    assert cut.finish_reason == "stop" and "def " not in cut.text
    assert free.text.startswith(cut.text)


def test_cli_generate_json_mentions_paris(capsys, default_model_dir):
    code = main(["generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "24", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert "Paris" in result["outputs"][0]["text"]
    assert result["stats"]["emitted_tokens"] >= 1


def test_chunked_prefill_equals_whole_prompts(default_model, engine):
    # The real target, greedy, prompts of ~15 to ~200 tokens prefilled 16 tokens a step at batch 3 (requests join
    # while others run); then the real default pair (tetris), the draft fed the same chunks.
    from batchspec.spec.config import SpecConfig
    from batchspec.weights.known_models import default_draft_dir
    from batchspec.weights.loading import load_model

    prompts = PROMPTS[1:] + [humaneval_chat_prompt(p) for p in humaneval_prompts()[:2]]
    params = SamplingParams(max_tokens=24)
    whole = [o.token_ids for o in engine.generate(prompts, params, chat=True)]
    chunked = Engine(default_model, max_batch_size=3, prefill_chunk=16).generate(prompts, params, chat=True)
    assert [o.token_ids for o in chunked] == whole
    pair = Engine(default_model, load_model(default_draft_dir()), SpecConfig(policy="tetris", k=3, extra=2),
                  max_batch_size=3, prefill_chunk=16)
    assert [o.token_ids for o in pair.generate(prompts, params, chat=True)] == whole
    assert pair.metrics()["vsr"] > 0.1


def test_draft_pass_rows_count_the_requests_still_drafting_and_the_first_pass_catch_up():
    from batchspec.engine.engine import draft_pass_rows

    assert draft_pass_rows([3, 1, 0], [5, 0, 7]) == [2 + 5, 1, 1]  # the third request drafted nothing: no catch-up
    assert draft_pass_rows([0, 0], [4, 4]) == []
