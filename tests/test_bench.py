"""`batchspec bench` plumbing on tiny random models: dataset loaders, results schema, files written."""

from __future__ import annotations

import csv
import json

import pytest

from batchspec.bench.run import BenchConfig, format_table, load_dataset, run_bench, trial_order, write_results
from batchspec.errors import BatchspecError
from batchspec.spec.config import SpecConfig
from batchspec.weights.loading import load_model

SECTION_6 = ("tokens_per_s", "ter_tokens_per_s", "vsr", "mean_accept_len", "system_efficiency", "target_calls",
             "target_tokens", "draft_tokens", "emitted_tokens", "latency_mean_s", "latency_p50_s", "latency_p99_s",
             "ttft_mean_s", "select_us_per_step", "oracle_fraction", "match_ar", "per_position_accept")


def test_dataset_loaders(tmp_path):
    assert len(load_dataset("humaneval", 5)) == 5
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert load_dataset(f"jsonl:{jsonl}", 10) == ["a", "b"]
    share = tmp_path / "s.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                                 {"conversations": [{"from": "gpt", "value": "no human turn"}]}]))
    assert load_dataset(f"sharegpt:{share}", 10) == ["hi"]


@pytest.mark.parametrize("kind,suffix,content,needle", [
    ("jsonl", ".jsonl", '{"prompt": 3}\n', 'string "prompt" field'),
    ("jsonl", ".jsonl", "not json\n", "invalid JSON"),
    ("sharegpt", ".json", "{}", "JSON list"),
    ("sharegpt", ".json", '[{"no": 1}]', "conversations"),
    ("sharegpt", ".json", "[", "invalid JSON"),
])
def test_malformed_prompt_files(tmp_path, kind, suffix, content, needle):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(BatchspecError, match=needle):
        load_dataset(f"{kind}:{path}", 10)


def test_truthfulqa_file_and_interleaving(tmp_path):
    from batchspec.datasets.prompts import interleave, truthfulqa_questions

    path = tmp_path / "tqa.jsonl"
    path.write_text('{"question": "Why is the sky blue?", "answer": ["Rayleigh scattering"]}\n\n{"question": "Q2?"}\n')
    assert truthfulqa_questions(path) == ["Why is the sky blue?", "Q2?"]
    path.write_text('{"prompt": "no question"}\n')
    with pytest.raises(BatchspecError, match='"question" field'):
        truthfulqa_questions(path)
    assert interleave(["c1", "c2", "c3"], ["p1", "p2"]) == [("c1", 0), ("p1", 1), ("c2", 0), ("p2", 1)]


def test_unknown_dataset_and_policy():
    with pytest.raises(BatchspecError, match="unknown dataset"):
        load_dataset("mmlu", 3)
    with pytest.raises(BatchspecError, match="unknown policy"):
        BenchConfig(policies=("ar", "beam")).validate()


def test_results_schema_and_files(tmp_path, tiny_model_factory):
    target = load_model(tiny_model_factory(name="target", seed=0))
    draft = load_model(tiny_model_factory(name="draft", seed=1, hidden_size=32, intermediate_size=64))
    config = BenchConfig(num_prompts=3, batch_size=2, policies=("ar", "sd", "tetris", "oracle"),
                         spec=SpecConfig(k=2, extra=1, measure_oracle=True), max_tokens=6, chat=True)
    results = run_bench(config, target, draft)
    assert results["config"]["policies"] == ["ar", "sd", "tetris", "oracle"]
    assert [r["policy"] for r in results["runs"]] == ["ar", "sd", "tetris", "oracle"]
    for run in results["runs"]:
        for name in SECTION_6:
            assert name in run, name
        assert run["match_ar"] == 1.0  # lossless at temperature 0, even with a random draft
    out = tmp_path / "bench"
    plots = write_results(results, out)
    assert {p.name for p in plots} >= {"throughput.png", "tetris_shape.png", "position_acceptance.png"}
    assert json.loads((out / "results.json").read_text())["runs"][0]["policy"] == "ar"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["policy"] for r in rows] == ["ar", "sd", "tetris", "oracle"]
    table = format_table(results)
    assert "tetris" in table and "tokens_per_s ratios" in table
    assert table.startswith(f"measured on {results['config']['machine']}")  # which CPU: tokens/s depend on it


def test_sweep_baselines_and_skipped_prompts(tmp_path, tiny_model_factory):
    """A batch-size sweep gives one run per point and policy; transformers rows match ar; long prompts skipped."""
    target = load_model(tiny_model_factory(name="target", seed=0))  # context 256 tokens
    draft = load_model(tiny_model_factory(name="draft", seed=1, hidden_size=32, intermediate_size=64))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "word " * 400, "import os"]))
    config = BenchConfig(dataset=f"jsonl:{prompts}", num_prompts=3, policies=("ar", "tetris"), max_tokens=5,
                         spec=SpecConfig(k=2, extra=1), sweep={"batch_size": (1, 2)}, chat=False,
                         baselines=("hf_generate", "hf_assisted_b1"), baseline_prompts=1)
    results = run_bench(config, target, draft)
    assert results["config"]["skipped_prompts"] == 1 and results["config"]["num_prompts"] == 2
    assert [(r["batch_size"], r["policy"]) for r in results["runs"]] == [(1, "ar"), (1, "tetris"), (2, "ar"),
                                                                          (2, "tetris")]
    assert all(r["match_ar"] == 1.0 for r in results["runs"])
    hf = {b["policy"]: b for b in results["baselines"]}
    assert hf["hf_generate"]["num_prompts"] == 2 and hf["hf_assisted_b1"]["num_prompts"] == 1
    assert all(b["match_ar"] == 1.0 and b["library"].startswith("transformers") for b in hf.values())
    table = format_table(results)
    assert "[batch_size=2]" in table and "hf_assisted_b1" in table and "skipped 1 prompt" in table
    plots = write_results(results, tmp_path / "out")
    assert (tmp_path / "out" / "plots" / "sweep_batch_size.png") in plots


def test_baselines_run_in_every_trial(tmp_path, tiny_model_factory):
    """Each trial measures the transformers rows beside the policies; table, ratio and plot use their median."""
    from batchspec.bench.report import baseline_ratios, baseline_rows

    target = load_model(tiny_model_factory(name="target", seed=0))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os"]))
    config = BenchConfig(dataset=f"jsonl:{prompts}", num_prompts=2, batch_size=2, policies=("ar",), max_tokens=4,
                         trials=3, chat=False, baselines=("hf_generate", "hf_generate_b1"))
    results = run_bench(config, target, None)
    assert [(b["policy"], b["trial"]) for b in results["baselines"]] == [
        (name, t) for t in range(3) for name in ("hf_generate", "hf_generate_b1")]
    assert all(b["match_ar"] == 1.0 for b in results["baselines"])
    row, _ = baseline_rows(results)
    speeds = sorted(b["tokens_per_s"] for b in results["baselines"] if b["policy"] == "hf_generate")
    assert row["trials"] == 3 and row["tokens_per_s"] == speeds[1]
    assert (row["min_tokens_per_s"], row["max_tokens_per_s"]) == (speeds[0], speeds[2])
    assert "over 3 trials" in format_table(results)
    ar = sorted(r["tokens_per_s"] for r in results["runs"])[1]
    # Like with like: our batch-2 run against the batch-2 baseline only, never against the batch-1 row.
    assert baseline_ratios(results) == (f"best batchspec policy vs each baseline at the same batch size: "
                                        f"ar/hf_generate = {ar / speeds[1]:.2f}x (batch 2)")
    assert (tmp_path / "out" / "plots" / "throughput.png") in write_results(results, tmp_path / "out")


def test_trials_rotate_the_order_of_the_policies():
    policies = ["ar", "sd", "dsd", "tetris"]
    orders = [trial_order(policies, trial) for trial in range(5)]
    assert orders[0] == policies and orders[1] == ["sd", "dsd", "tetris", "ar"] and orders[4] == policies
    for position in range(4):  # over four trials each policy runs once in every position
        assert sorted(order[position] for order in orders[:4]) == sorted(policies)
    assert trial_order([], 3) == []


def test_llama_cpp_baseline_left_out_with_a_note(tmp_path, tiny_model_factory):
    """llama.cpp needs llama-cpp-python and a GGUF target: without either the row is left out and the table says
    why; the bench's own rows are unaffected."""
    target = load_model(tiny_model_factory(name="target", seed=0))  # an HF directory, not a GGUF file
    assert target.gguf_path is None
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}))
    config = BenchConfig(dataset=f"jsonl:{prompts}", num_prompts=1, batch_size=1, policies=("ar",), max_tokens=3,
                         chat=False, baselines=("llama_cpp_b1",))
    results = run_bench(config, target, None)
    assert results["baselines"] == [] and len(results["runs"]) == 1
    (note,) = results["config"]["baseline_notes"]
    assert note.startswith("llama_cpp_b1 left out: ") and note in format_table(results)
    assert "llama-cpp-python is not installed" in note or "is not a GGUF file" in note


def test_sharegpt_auto_max_tokens_and_bad_sweep(tmp_path, tiny_model_factory):
    from batchspec.bench.run import parse_sweep, prepare_prompts

    target = load_model(tiny_model_factory(name="target", seed=0))
    share = tmp_path / "s.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "hello there, friend"}]}]))
    prompts, limits, _, skipped = prepare_prompts(BenchConfig(dataset=f"sharegpt:{share}", max_tokens=None),
                                               target, None)
    assert prompts == ["hi"] and limits == [len(target.tokenizer.encode("hello there, friend"))] and skipped == 0
    with pytest.raises(BatchspecError, match="auto"):
        BenchConfig(max_tokens=None).validate()
    assert parse_sweep(["k=1..3", "batch_size=2,4"]) == {"k": (1, 2, 3), "batch_size": (2, 4)}
    with pytest.raises(BatchspecError, match="AXIS"):
        parse_sweep(["k=one"])
    with pytest.raises(BatchspecError, match="cannot sweep"):
        BenchConfig(sweep={"temperature": (1,)}).validate()
