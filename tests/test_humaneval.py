"""`--quality humaneval`: the programs outputs make, the sandbox that runs them, pass@1 in the bench.

The hostile programs put their attack before a correct solution and its tests, so each would pass if the attack
were a no-op: failing proves the attack was stopped or ended the run, never that the tests were wrong.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from batchspec.bench import sandbox
from batchspec.bench.humaneval import (add_pass_at_1, code_block, humaneval_tasks, pass_at_1_check, program_for,
                                       with_tests, truncate_completion)
from batchspec.bench.report import format_table
from batchspec.bench.run import BenchConfig, run_bench
from batchspec.bench.sandbox import run_untrusted
from batchspec.datasets.prompts import humaneval_chat_prompt
from batchspec.errors import BatchspecError

TASKS = {task["task_id"]: task for task in humaneval_tasks()}
# Plain ones, ones with a helper in the prompt (10, 38), typing/math/hashlib imports (12, 32, 162), and
# datetime-style parsing (124).
CANONICAL = ("HumanEval/0", "HumanEval/10", "HumanEval/12", "HumanEval/32", "HumanEval/38", "HumanEval/53",
             "HumanEval/124", "HumanEval/162")


def solved(task_id: str) -> str:
    """The canonical solution of a task with its tests: a program that passes."""
    task = TASKS[task_id]
    return with_tests(task, task["prompt"] + task["canonical_solution"])


def test_program_for_chat_answers():
    task = TASKS["HumanEval/10"]  # its prompt defines the helper is_palindrome beside make_palindrome
    body = task["canonical_solution"]
    function = task["prompt"].split("def make_palindrome")[0].split("def is_palindrome")[0] + \
        "def make_palindrome(string: str) -> str:\n" + body
    whole = f"Here is the function:\n\n```python\n{function}```\n\nIt appends the reversed prefix.\n```\nx\n```"
    assert program_for(task, whole, chat=True) == task["prompt"] + "\n" + function  # helpers of the prompt kept
    assert program_for(task, f"```python\n{body}```", chat=True) == task["prompt"] + body  # a body continues
    assert program_for(task, textwrap.dedent(body), chat=True) == task["prompt"] + body  # re-indented, no fence
    cut = f"```python\n{function[:-40]}"  # an answer cut by max_tokens: no closing fence
    assert program_for(task, cut, chat=True) == task["prompt"] + "\n" + function[:-40]
    # What instruct models write (Qwen2.5-Coder-0.5B-Instruct): a helper after the function, then demo prints,
    # the last cut off by max_tokens. The demo goes, the helper stays.
    demo = textwrap.dedent("""\
        Here is the completed function:

        ```python
        LIMIT = [
            0,
        ]

        def has_close_elements(numbers, threshold):
            return any(close(a, b, threshold) for i, a in enumerate(numbers) for b in numbers[i + 1:])

        # Helper
        def close(a, b, threshold):
            return abs(a - b) < threshold

        # Test cases
        print(has_close_elements([1.0, 2.0, 3.0], 0.5))  # False
        print(has_close_elements([1.0, 2.8, 3.0""")
    program = program_for(TASKS["HumanEval/0"], demo, chat=True)
    assert "def close" in program and "LIMIT" in program and "print" not in program and "# Test" not in program
    assert run_untrusted(with_tests(TASKS["HumanEval/0"], program)).passed
    assert code_block("```text\nnot this\n```\n```py\nthis\n```") == "this\n"
    assert code_block("```\nfirst\n```\n```\nsecond\n```") == "first\n"
    assert code_block("no fence at all") == "no fence at all"
    for answer in (whole, f"```python\n{body}```", textwrap.dedent(body), function):
        assert run_untrusted(with_tests(task, program_for(task, answer, chat=True))).passed, answer


def test_program_for_raw_completions():
    task = TASKS["HumanEval/0"]
    body = task["canonical_solution"]
    for tail in ("\n\ndef helper():\n    pass\n", "\nclass A:\n    pass", "\nif __name__ == '__main__':\n    x()",
                 "\nprint(has_close_elements([], 1))", "\n# a comment at column 0", ""):
        program = program_for(task, body + tail, chat=False)
        assert program.startswith(task["prompt"]) and program[len(task["prompt"]):].strip() == body.strip(), tail
    assert truncate_completion("    return 1\n    # indented comments stay\n#cut") == \
        "    return 1\n    # indented comments stay"
    assert run_untrusted(with_tests(task, program_for(task, body + "\ndef f(", chat=False))).passed


def test_canonical_solutions_pass_and_wrong_ones_fail():
    durations = []
    for task_id in CANONICAL:
        start = time.perf_counter()
        outcome = run_untrusted(solved(task_id))
        durations.append(time.perf_counter() - start)
        assert outcome.passed and outcome.reason == "passed", (task_id, outcome)
    wrong = run_untrusted(with_tests(TASKS["HumanEval/0"], TASKS["HumanEval/0"]["prompt"] + "    return True\n"))
    assert not wrong.passed and wrong.reason == "failed" and "AssertionError" in wrong.stderr
    broken = run_untrusted(with_tests(TASKS["HumanEval/0"], TASKS["HumanEval/0"]["prompt"] + "    return (\n"))
    assert not broken.passed and broken.reason == "crashed" and "SyntaxError" in broken.stderr
    assert sorted(durations)[len(durations) // 2] < 2.0  # a check is a process start: tens of milliseconds


def hostile_cases(marker: str) -> dict[str, tuple[str, str, str, float]]:
    """name -> (code run before a passing solution, reason, what its stderr says, timeout)."""
    refused = "PermissionError: sandbox:"
    return {
        "infinite loop": ("while True:\n    pass", "timeout", "", 1.0),
        "huge allocation": ("x = bytearray(10**11)", "crashed", "MemoryError", 5.0),
        "list growth": ("x = []\nwhile True:\n    x.append(bytearray(10**6))", "crashed", "MemoryError", 5.0),
        "os.system": (f"import os\nos.system('touch /tmp/pwned_{marker}')", "crashed", refused, 5.0),
        "subprocess": (f"import subprocess\nsubprocess.run(['touch', '/tmp/pwned_{marker}'])", "crashed",
                       "No module named 'subprocess'", 5.0),  # its import of _posixsubprocess is refused
        "_posixsubprocess": ("import _posixsubprocess", "crashed", refused, 5.0),
        "write /tmp": (f"open('/tmp/escape_{marker}', 'w').write('x')", "crashed", refused, 5.0),
        "write home": (f"import os\nopen(os.path.expanduser('~/escape_{marker}'), 'w').write('x')", "crashed",
                       refused, 5.0),
        "os.open dir_fd": (f"import os\nfd = os.open('/', os.O_RDONLY)\n"
                           f"os.open('tmp/escape_{marker}', os.O_WRONLY | os.O_CREAT, dir_fd=fd)", "crashed", refused,
                           5.0),
        "dot-dot": (f"open('../escape_{marker}', 'w').write('x')", "crashed", refused, 5.0),
        "symlink": (f"import os\nos.symlink('/tmp/escape_{marker}', 'link')", "crashed", refused, 5.0),
        "fork bomb": ("import os\nwhile True:\n    os.fork()", "crashed", refused, 2.0),
        "threads": ("import threading\nthreading.Thread(target=print).start()", "crashed", "can't start new thread",
                    2.0),  # RLIMIT_NPROC, the fork bomb's backstop
        # Not os.kill(-1): if it got through as a user other than root, it would take the caller down too.
        "os.kill": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "crashed", refused, 5.0),
        "socket": ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "crashed", refused, 5.0),
        "print 100 MB": ("import sys\nsys.stdout.write('x' * 100_000_000)", "crashed", "File too large", 5.0),
        "sys.exit(0)": ("import sys\nsys.exit(0)", "failed", "", 5.0),
        "raise SystemExit": ("raise SystemExit", "failed", "", 5.0),
        "os._exit(0)": ("import os\nos._exit(0)", "failed", "", 5.0),
        "exit 0 at exit": ("import atexit, os\natexit.register(os._exit, 0)\nraise ValueError", "failed", "ValueError",
                           5.0),
    }


@pytest.mark.parametrize("name", list(hostile_cases("x")))
def test_hostile_code_fails_without_harm(name, monkeypatch):
    marker = uuid.uuid4().hex
    code, reason, says, timeout_s = hostile_cases(marker)[name]
    made = []

    class RecordedDirectory(sandbox.tempfile.TemporaryDirectory):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.name)

    monkeypatch.setattr(sandbox.tempfile, "TemporaryDirectory", RecordedDirectory)
    start = time.perf_counter()
    outcome = run_untrusted(code + "\n" + solved("HumanEval/0"), timeout_s=timeout_s, memory_mb=512)
    elapsed = time.perf_counter() - start
    assert not outcome.passed and outcome.reason == reason and says in outcome.stderr, outcome
    assert elapsed < timeout_s + 3.0  # killed on time, the caller never waits on it
    assert len(outcome.stderr) <= sandbox.STDERR_TAIL
    escapes = [Path(f"/tmp/pwned_{marker}"), Path(f"/tmp/escape_{marker}"), Path.home() / f"escape_{marker}",
               Path(made[0]).parent / f"escape_{marker}"]
    assert not any(p.exists() for p in escapes)
    assert made and not Path(made[0]).exists()  # the throw-away directory is gone
    assert run_untrusted(solved("HumanEval/0")).passed  # and the next check runs as usual


def test_limits_in_force_inside():
    """The backstops behind the audit hook: no new processes or threads (RLIMIT_NPROC), not root, capped memory."""
    probe = textwrap.dedent(f"""\
        import os, resource
        assert os.geteuid() != 0 and os.getuid() != 0
        assert resource.getrlimit(resource.RLIMIT_NPROC) == (0, 0)
        assert resource.getrlimit(resource.RLIMIT_AS)[1] == 256 << 20
        assert os.environ.get("PATH") is None and os.getcwd().startswith({os.path.realpath(tempfile.gettempdir())!r})
        open("scratch.txt", "w").write("its own directory is writable")
    """)
    if os.geteuid() != 0:
        probe = probe.replace("assert os.geteuid() != 0 and os.getuid() != 0\n", "")
    outcome = run_untrusted(probe, memory_mb=256)
    assert outcome.passed, outcome


def test_outcome_reasons():
    assert sandbox.outcome_reason(0, False, True) == "passed"
    assert sandbox.outcome_reason(0, False, False) == "failed"  # exited before the end: no sentinel
    assert sandbox.outcome_reason(sandbox.FAILED_EXIT, False, False) == "failed"
    assert sandbox.outcome_reason(1, False, False) == "crashed"
    assert sandbox.outcome_reason(-9, True, False) == "timeout"
    assert sandbox.outcome_reason(-11, False, False) == "killed"


def test_pass_at_1_cache_and_harness_check(monkeypatch):
    """Lossless runs share ar's programs (checked once); a lossless run with ar's outputs but another pass@1 is
    reported as a broken harness."""
    tasks = [TASKS["HumanEval/0"], TASKS["HumanEval/53"]]
    prompts = [humaneval_chat_prompt(t["prompt"]) for t in tasks]
    right = [f"```python\n{t['canonical_solution']}```" for t in tasks]
    texts = {(0, 0, "ar"): right, (0, 0, "sd"): right, (0, 0, "sprinter"): [right[0], "```python\n    return 0\n```"]}
    runs = [{"point": 0, "trial": 0, "policy": p, "match_ar": 1.0 if p != "sprinter" else 0.5}
            for p in ("ar", "sd", "sprinter")]
    calls = []
    monkeypatch.setattr("batchspec.bench.humaneval.run_untrusted", lambda p, **kw: calls.append(p) or run_untrusted(p))
    lines = []
    check = add_pass_at_1(runs, texts, prompts, log=lines.append)
    assert [r["pass_at_1"] for r in runs] == [1.0, 1.0, 0.5]
    assert runs[2]["passed_tasks"] == ["HumanEval/0"] and runs[2]["check_reasons"] == {"failed": 1, "passed": 1}
    assert len(calls) == 3  # ar's two programs once, sprinter's wrong one
    assert check == {"ok": True, "checked_runs": 1, "mismatches": []} and len(lines) == 3
    runs[1]["pass_at_1"] = 0.5  # what a misaligned harness would produce
    broken = pass_at_1_check(runs)
    assert not broken["ok"] and "sd" in broken["mismatches"][0]
    results = {"config": {}, "runs": runs, "baselines": [], "pass_at_1_check": broken}
    assert "WARNING: pass@1 check failed" in format_table(results)


def test_quality_needs_humaneval():
    with pytest.raises(BatchspecError, match="needs --dataset humaneval"):
        BenchConfig(dataset="truthfulqa", quality="humaneval").validate()
    with pytest.raises(BatchspecError, match="unknown --quality"):
        BenchConfig(quality="mbpp").validate()


def test_bench_reports_pass_at_1(tiny_model_factory):
    from batchspec.spec.config import SpecConfig
    from batchspec.weights.loading import load_model

    target = load_model(tiny_model_factory(name="target", seed=0))
    draft = load_model(tiny_model_factory(name="draft", seed=1, hidden_size=32, intermediate_size=64))
    config = BenchConfig(num_prompts=2, batch_size=2, policies=("ar", "sd", "tetris"), max_tokens=4,
                         spec=SpecConfig(k=2, extra=1), quality="humaneval")
    results = run_bench(config, target, draft)
    assert all(0.0 <= r["pass_at_1"] <= 1.0 and r["match_ar"] == 1.0 for r in results["runs"])
    assert len({r["pass_at_1"] for r in results["runs"]}) == 1  # lossless: ar's outputs, ar's pass@1
    assert results["pass_at_1_check"] == {"ok": True, "checked_runs": 2, "mismatches": []}
    table = format_table(results)
    assert "HumanEval pass@1: ar" in table and "pass@1 check: ok" in table
