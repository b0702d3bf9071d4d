"""`batchspec bench` plumbing on tiny random models: dataset loaders, results schema, files written."""

from __future__ import annotations

import csv
import json

import pytest

from batchspec.bench import BenchConfig, format_table, load_dataset, run_bench, write_results
from batchspec.errors import BatchspecError
from batchspec.loading import load_model
from batchspec.speculative import SpecConfig

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
    write_results(results, out)
    assert json.loads((out / "results.json").read_text())["runs"][0]["policy"] == "ar"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["policy"] for r in rows] == ["ar", "sd", "tetris", "oracle"]
    table = format_table(results)
    assert "tetris" in table and "tokens_per_s ratios" in table
