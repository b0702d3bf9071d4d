"""Bad input gives one clear line on stderr and exit status 2 — never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from batchspec.cli.main import main


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()  # drop what fixtures printed (e.g. transformers' save progress bars)
    try:
        code = main(list(argv))
    except SystemExit as stop:  # argparse usage errors
        code = stop.code
    err = capsys.readouterr().err.strip()
    return code, err


def assert_clear_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def test_missing_model_path(capsys, tmp_path):
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--target", str(tmp_path / "nope"))
    assert_clear_error(code, err, "model path not found")


def test_directory_without_config(capsys, tmp_path):
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--target", str(tmp_path))
    assert_clear_error(code, err, "no config.json")


def test_corrupt_gguf_file(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--target", str(bad))
    assert_clear_error(code, err, "cannot read GGUF file")


def test_corrupt_safetensors(capsys, tiny_model_factory):
    model_dir = tiny_model_factory()
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--target", str(model_dir))
    assert_clear_error(code, err, "cannot read weights")


def test_unsupported_architecture(capsys, tiny_model_factory):
    model_dir = tiny_model_factory()
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--target", str(model_dir))
    assert_clear_error(code, err, "unsupported architecture 'gpt2'")


def test_empty_prompt(capsys, default_model_dir):
    code, err = run_cli(capsys, "generate", "--prompt", "   ")
    assert_clear_error(code, err, "prompt 0 is empty")


def test_no_prompt(capsys):
    code, err = run_cli(capsys, "generate")
    assert_clear_error(code, err, "no prompts")


def test_prompt_longer_than_context(capsys, tiny_model_factory):
    model_dir = tiny_model_factory(max_position_embeddings=64)
    code, err = run_cli(capsys, "generate", "--prompt", "word " * 100, "--target", str(model_dir))
    assert_clear_error(code, err, "exceeds the context window of 64")


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_bad_max_tokens(capsys, value):
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--max-tokens", value)
    assert_clear_error(code, err, "--max-tokens", "positive integer")


@pytest.mark.parametrize("flag,value,needle", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                                ("--top-k", "-2", "top_k")])
def test_bad_sampling_values(capsys, flag, value, needle):
    code, err = run_cli(capsys, "generate", "--prompt", "hi", flag, value)
    assert_clear_error(code, err, needle)


def test_malformed_prompts_file(capsys, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    code, err = run_cli(capsys, "generate", "--prompts-file", str(bad))
    assert_clear_error(code, err, "prompts.jsonl:2", "invalid JSON")


def test_tokenizer_files_missing(capsys, tiny_model_factory):
    model_dir = tiny_model_factory()
    (model_dir / "tokenizer.json").unlink()
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--target", str(model_dir))
    assert_clear_error(code, err, "tokenizer not found")
