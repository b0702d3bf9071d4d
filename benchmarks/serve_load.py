"""Load test of `batchspec serve`: N concurrent streaming clients for T seconds, per policy, in one run.

    python benchmarks/serve_load.py [--clients 64] [--duration 60] [--policies ar,tetris] [--max-tokens 64]
                                    [--target default] [--draft default] [--target-dtype float32]
                                    [--draft-dtype auto] [--max-batch-size 16] [--out FILE]
                                    [--workload chat|mixed] [--prefill-chunk 256] [--long-every 10]
                                    [--long-tokens 1900] [--long-max-tokens 16]

For each policy it starts its own server (`python -m batchspec.cli serve` on a free loopback port), waits for
/health, sends two untimed warm-up requests, then runs the clients: each sends a streaming chat request (HumanEval
prompts, greedy, round robin), reads the SSE stream to the end and sends the next, until the time is up (requests
in flight then may finish). It reports requests/s, output tokens/s, TTFT and latency p50/p99, the server's VSR and
mean accepted length, and the tetris/ar throughput ratio. Servers run with `--prefill-chunk` as given.

`--workload mixed` measures chunked prefill: the same short chat clients stream while long prompts (~`--long-tokens`
tokens of this package's own source code, in a chat message) arrive every `--long-every` seconds, open loop. Per
policy it runs the workload twice, one server after the other: whole prompts (`--prefill-chunk 0`) and chunked
(`--prefill-chunk N`). It reports the short streams' inter-token latency p50/p99/max (the gaps between consecutive
streamed chunks of a response: a whole-prompt prefill stalls every running stream for its duration; under a
speculative policy one chunk may carry several tokens), their TTFT, the long prompts' TTFT and the total output
tokens/s, and the chunked/whole ratios.

Every answer is checked: `lost` = no answer (connection error, HTTP error, stream without finish_reason or
`[DONE]`); `garbled` = malformed stream (bad JSON, wrong object or id, text after the finish, usage missing or
disagreeing with the streamed tokens) or, since decoding is greedy and every policy is lossless, text differing
from the first answer any policy gave to the same prompt. The exit status is 1 unless both are 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from batchspec.datasets.prompts import humaneval_chat_prompt, humaneval_prompts
from batchspec.runtime.machine import machine_description


@dataclass
class Answer:
    prompt_index: int
    ok: bool = False  # complete and well-formed
    problem: str = ""  # "lost: ..." or "garbled: ..."
    text: str = ""
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    spec: dict = field(default_factory=dict)
    kind: str = "short"  # "short" (a chat client) or "long" (a long prompt of the mixed workload)
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive content chunks of the stream


# --- one streaming request over a raw connection (so that the SSE framing itself is checked) --------------------------


async def stream_chat(port: int, model: str, prompt: str, index: int, max_tokens: int,
                      kind: str = "short") -> Answer:
    answer, started = Answer(index, kind=kind), time.perf_counter()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = await _headers(reader)
        if status != 200:
            answer.problem = f"lost: HTTP {status}: {(await reader.read())[:200]!r}"
        elif headers.get("transfer-encoding") != "chunked":
            answer.problem = "garbled: stream not chunked"
        else:
            await _read_events(reader, answer, started)
        writer.close()
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as err:
        answer.problem = f"lost: {type(err).__name__}: {err}"
    answer.latency_s = time.perf_counter() - started
    return answer


async def _headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers


async def _read_events(reader: asyncio.StreamReader, answer: Answer, started: float) -> None:
    """Decode the chunked body and check each SSE event as it arrives."""
    buffer, state = b"", {"id": None, "finished": False, "done": False, "usage": False, "parts": [], "last_s": None}
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after the chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            problem = _check_event(event, state, answer, started)
            if problem:
                answer.problem = f"garbled: {problem}"
                return
    answer.text = "".join(state["parts"])
    if not state["finished"] or not state["done"] or not state["usage"]:
        missing = "finish_reason" if not state["finished"] else "[DONE]" if not state["done"] else "usage"
        answer.problem = "lost: stream ended without " + missing
    elif buffer.strip():
        answer.problem = "garbled: bytes after the last event"
    else:
        answer.ok = True


def _check_event(event: bytes, state: dict, answer: Answer, started: float) -> str | None:
    if not event.startswith(b"data: "):
        return f"not an SSE data line: {event[:80]!r}"
    data = event[len(b"data: "):]
    if data == b"[DONE]":
        state["done"] = True
        return None
    if state["done"]:
        return "event after [DONE]"
    chunk = json.loads(data)
    if "error" in chunk:
        return f"error event: {chunk['error']}"
    if chunk.get("object") != "chat.completion.chunk" or len(chunk.get("choices", [])) > 1:
        return f"not a chat.completion.chunk: {data[:120]!r}"
    if state["id"] not in (None, chunk["id"]):
        return "the chunk id changed"
    state["id"] = chunk["id"]
    if chunk.get("usage"):  # stream_options.include_usage: once, after the finish (in its chunk, or one of its own)
        usage = chunk["usage"]
        if state["usage"] or "spec" not in usage or usage.get("completion_tokens", 0) < (1 if state["parts"] else 0):
            return f"bad usage: {usage}"
        answer.completion_tokens, answer.spec, state["usage"] = usage["completion_tokens"], usage["spec"], True
    if not chunk["choices"]:
        return None if state["usage"] and state["finished"] else f"a chunk without choices: {data[:120]!r}"
    choice = chunk["choices"][0]
    content = choice["delta"].get("content")
    if content:
        if state["finished"]:
            return "text after finish_reason"
        now = time.perf_counter()
        if state["last_s"] is None:
            answer.ttft_s = now - started
        else:
            answer.gaps.append(now - state["last_s"])
        state["last_s"] = now
        state["parts"].append(content)
    if choice["finish_reason"] is not None:
        state["finished"] = True
    return None


# --- the load ---------------------------------------------------------------------------------------------------------


async def run_load(port: int, model: str, prompts: list[str], clients: int, duration: float,
                   max_tokens: int) -> tuple[list[Answer], float]:
    deadline = time.perf_counter() + duration
    counter = iter(range(10**9))
    answers: list[Answer] = []

    async def client() -> None:
        while time.perf_counter() < deadline:
            index = next(counter) % len(prompts)
            answers.append(await stream_chat(port, model, prompts[index], index, max_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return answers, time.perf_counter() - started


async def run_mixed_load(port: int, prompts: list[str], long_prompts: list[str],
                         args: argparse.Namespace) -> tuple[list[Answer], float]:
    """The chat clients of `run_load`, plus a long prompt every `args.long_every` seconds (the first after half a
    period, once the short streams run), each sent whether or not the earlier ones are done."""
    started = time.perf_counter()
    deadline = started + args.duration
    answers: list[Answer] = []
    counter = iter(range(10**9))

    async def client() -> None:
        while time.perf_counter() < deadline:
            index = next(counter) % len(prompts)
            answers.append(await stream_chat(port, "bench", prompts[index], index, args.max_tokens))

    async def long_arrivals() -> None:
        sent = []
        for j in range(10**9):
            arrival = started + (j + 0.5) * args.long_every
            if arrival >= deadline:
                break
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            index = j % len(long_prompts)
            sent.append(asyncio.create_task(stream_chat(port, "bench", long_prompts[index], LONG_INDEX + index,
                                                        args.long_max_tokens, kind="long")))
        answers.extend(await asyncio.gather(*sent))

    await asyncio.gather(*(client() for _ in range(args.clients)), long_arrivals())
    return answers, time.perf_counter() - started


LONG_INDEX = 1_000_000  # long prompts' indices in the greedy references, apart from the chat prompts'


def long_prompts(target: str, tokens: int, count: int = 3) -> list[str]:
    """`count` chat prompts of about `tokens` tokens (counted in the target's chat template): a request to explain
    a stretch of this package's own source code, each from another offset."""
    from pathlib import Path

    import batchspec
    from batchspec.runtime.tokenizer import Tokenizer
    from batchspec.weights.loading import resolve_model_dir

    tokenizer = Tokenizer(resolve_model_dir(target))
    source = "\n".join(p.read_text() for p in sorted(Path(batchspec.__file__).parent.rglob("*.py")))
    ids = tokenizer.encode(source)
    prompts = []
    for offset in range(0, count * 997, 997):
        length = tokens
        for _ in range(8):  # re-encoding the decoded text changes the count a little: converge from above
            prompt = "Explain what this code does:\n\n" + tokenizer.decode(ids[offset:offset + length])
            counted = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])))
            if counted <= tokens:
                break
            length -= counted - tokens
        prompts.append(prompt)
    return prompts


async def warm_up(port: int, prompts: list[str]) -> None:
    """Untimed requests first: the server's first steps allocate memory and warm caches."""
    answers = await asyncio.gather(*(stream_chat(port, "bench", p, i, 8) for i, p in enumerate(prompts)))
    if not all(a.ok for a in answers):
        raise SystemExit(f"warm-up request failed: {[a.problem for a in answers if not a.ok]}")


def summarize(policy: str, answers: list[Answer], wall_s: float, references: dict[int, str],
              server_metrics: dict) -> dict:
    for answer in answers:
        if answer.ok:
            reference = references.setdefault(answer.prompt_index, answer.text)
            if answer.text != reference:
                answer.ok, answer.problem = False, "garbled: text differs from the greedy reference"
    done = [a for a in answers if a.ok]
    ttfts = [a.ttft_s for a in done if a.ttft_s is not None]
    latencies = [a.latency_s for a in done]
    problems = sorted({a.problem for a in answers if not a.ok})
    return {
        "policy": policy, "requests": len(answers), "completed": len(done),
        "lost": sum(a.problem.startswith("lost") for a in answers),
        "garbled": sum(a.problem.startswith("garbled") for a in answers),
        "requests_per_s": len(done) / wall_s, "tokens_per_s": sum(a.completion_tokens for a in done) / wall_s,
        "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p99_s": _quantile(ttfts, 0.99),
        "latency_p50_s": _quantile(latencies, 0.5), "latency_p99_s": _quantile(latencies, 0.99),
        "wall_s": wall_s, **server_metrics, "problems": problems[:5],
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --- the server -------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, policy: str, port: int, prefill_chunk: int) -> subprocess.Popen:
    """`batchspec serve` with `--prefill-chunk prefill_chunk` (0: whole prompts)."""
    command = [sys.executable, "-m", "batchspec.cli", "serve", "--target", args.target, "--policy", policy,
               "-k", str(args.k), "--extra", str(args.extra), "--max-batch-size", str(args.max_batch_size),
               "--max-queue", str(max(args.clients, 1) + 64), "--port", str(port), "--served-model-name", "bench",
               "--prefill-chunk", str(prefill_chunk), "--log-level", "warning", "--shutdown-timeout", "5",
               "--target-dtype", args.target_dtype]
    if policy != "ar":
        command += ["--draft", args.draft, "--draft-dtype", args.draft_dtype]
    server = subprocess.Popen(command)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the {policy} server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the {policy} server did not answer /health within {args.startup_timeout} s")


def server_metrics(port: int) -> dict:
    """VSR and mean accepted length over the server's lifetime, from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = dict(line.partition(" ")[::2] for line in text.splitlines() if line.startswith("batchspec_"))
    verified = float(samples.get("batchspec_draft_tokens_verified_total", 0))
    return {"vsr": float(samples["batchspec_vsr"]) if verified else None,  # no drafts verified (ar): no VSR
            "mean_accepted_length": float(samples.get("batchspec_mean_accepted_length", 0)) or None}


def measure(args: argparse.Namespace, policy: str, prefill_chunk: int, prompts: list[str],
            references: dict[int, str], long: list[str] | None = None) -> dict:
    """One server, one load: the chat clients, plus the `long` prompts for the mixed workload."""
    port = free_port()
    server = start_server(args, policy, port, prefill_chunk)
    try:
        asyncio.run(warm_up(port, prompts[:2]))
        if long is None:
            answers, wall_s = asyncio.run(run_load(port, "bench", prompts, args.clients, args.duration,
                                                   args.max_tokens))
        else:
            answers, wall_s = asyncio.run(run_mixed_load(port, prompts, long, args))
        result = summarize(policy, answers, wall_s, references, server_metrics(port))
        return {**result, "prefill_chunk": prefill_chunk, **(mixed_metrics(answers, wall_s) if long else {})}
    finally:
        server.send_signal(2)  # SIGINT: graceful shutdown
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def mixed_metrics(answers: list[Answer], wall_s: float) -> dict:
    """The short streams' inter-chunk gaps and TTFT, the long prompts' TTFT (answers already checked)."""
    short = [a for a in answers if a.ok and a.kind == "short"]
    long = [a for a in answers if a.ok and a.kind == "long"]
    gaps = [g for a in short for g in a.gaps]
    return {
        "itl_p50_s": _quantile(gaps, 0.5), "itl_p99_s": _quantile(gaps, 0.99), "itl_max_s": max(gaps, default=None),
        "short_ttft_p50_s": _quantile([a.ttft_s for a in short if a.ttft_s is not None], 0.5),
        "short_ttft_p99_s": _quantile([a.ttft_s for a in short if a.ttft_s is not None], 0.99),
        "short_tokens_per_s": sum(a.completion_tokens for a in short) / wall_s,
        "long_sent": sum(a.kind == "long" for a in answers), "long_completed": len(long),
        "long_ttft_p50_s": _quantile([a.ttft_s for a in long if a.ttft_s is not None], 0.5),
    }


def number(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_row(r: dict) -> str:
    return (f"{r['policy']:<8} {r['completed']:>5}/{r['requests']:<5} {r['requests_per_s']:>7.2f} "
            f"{r['tokens_per_s']:>8.1f} {number(r['ttft_p50_s']):>7} {number(r['ttft_p99_s']):>7} "
            f"{number(r['latency_p50_s']):>7} {number(r['latency_p99_s']):>7} {number(r.get('vsr'), 3):>6} "
            f"{number(r.get('mean_accepted_length'), 3):>6} {r['lost']:>4} {r['garbled']:>7}")


MIXED_HEADER = ("policy   prefill  done/sent    tok/s  itl50  itl99 itlmax  ttft50  ttft99  long/sent long-ttft50 "
                "lost garbled")


def format_mixed_row(r: dict) -> str:
    chunk = str(r["prefill_chunk"]) if r["prefill_chunk"] else "whole"
    return (f"{r['policy']:<8} {chunk:>7} {r['completed']:>5}/{r['requests']:<5} {r['tokens_per_s']:>8.1f} "
            f"{number(r['itl_p50_s'], 3):>6} {number(r['itl_p99_s'], 3):>6} {number(r['itl_max_s'], 2):>6} "
            f"{number(r['short_ttft_p50_s']):>7} {number(r['short_ttft_p99_s']):>7} "
            f"{r['long_completed']:>5}/{r['long_sent']:<4} {number(r['long_ttft_p50_s']):>11} {r['lost']:>4} "
            f"{r['garbled']:>7}")


def chunked_ratios(runs: list[dict]) -> list[str]:
    """Per policy: chunked / whole-prompt ITL p50 and p99 and output tokens/s (< 1 for ITL: chunking helps)."""
    lines = []
    for policy in dict.fromkeys(r["policy"] for r in runs):
        whole, chunked = ([r for r in runs if r["policy"] == policy and bool(r["prefill_chunk"]) == c] for c in
                          (False, True))
        if not whole or not chunked:
            continue
        parts = [f"{name} {chunked[0][key] / whole[0][key]:.3f}" for name, key in
                 (("ITL p50", "itl_p50_s"), ("ITL p99", "itl_p99_s"), ("tokens/s", "tokens_per_s"))
                 if chunked[0][key] and whole[0][key]]
        lines.append(f"{policy}: chunked ({chunked[0]['prefill_chunk']}) / whole prompts: " + ", ".join(parts))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per policy (and prefill mode)")
    parser.add_argument("--policies", default="ar,tetris")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default")
    parser.add_argument("--target-dtype", default="float32", help="the target's weights (as serve's --target-dtype)")
    parser.add_argument("--draft-dtype", default="auto", help="the draft's weights (as serve's --draft-dtype)")
    parser.add_argument("-k", "--k", type=int, default=4)
    parser.add_argument("--extra", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=164, help="HumanEval prompts to cycle through")
    parser.add_argument("--workload", choices=("chat", "mixed"), default="chat",
                        help="chat: the clients alone; mixed: long prompts arrive too, whole vs chunked prefill")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="the servers' --prefill-chunk (0: whole prompts); mixed: the chunked run's")
    parser.add_argument("--long-every", type=float, default=10.0, help="mixed: seconds between long prompts")
    parser.add_argument("--long-tokens", type=int, default=1900, help="mixed: tokens of each long prompt")
    parser.add_argument("--long-max-tokens", type=int, default=16, help="mixed: max_tokens of the long prompts")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args()
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")
    if args.prefill_chunk < 0 or (args.workload == "mixed" and args.prefill_chunk == 0):
        parser.error("--prefill-chunk must be >= 0 (>= 1 for the mixed workload: it is the chunked run's)")
    if args.workload == "mixed" and (args.long_every <= 0 or args.long_tokens < 1):
        parser.error("--long-every must be > 0 and --long-tokens >= 1")

    prompts = [humaneval_chat_prompt(p) for p in humaneval_prompts()[:args.num_prompts]]
    references: dict[int, str] = {}  # greedy and lossless: every run must give every prompt the same text
    policies = [policy.strip() for policy in args.policies.split(",")]
    if args.workload == "mixed":
        long = long_prompts(args.target, args.long_tokens)
        runs = [measure(args, policy, chunk, prompts, references, long) for policy in policies
                for chunk in (0, args.prefill_chunk)]
        print(f"{args.clients} streaming chat clients (max_tokens {args.max_tokens}) + a {args.long_tokens}-token "
              f"prompt every {args.long_every:g} s (max_tokens {args.long_max_tokens}), {args.duration:.0f} s per "
              f"run, batch {args.max_batch_size}, greedy; itl = gaps between a short stream's chunks, s; "
              f"machine: {machine_description()}")
        print(MIXED_HEADER)
        for run in runs:
            print(format_mixed_row(run))
            for problem in run["problems"]:
                print(f"  {run['policy']}: {problem}")
        for line in chunked_ratios(runs):
            print(line)
    else:
        runs = [measure(args, policy, args.prefill_chunk, prompts, references) for policy in policies]
        print(f"{args.clients} streaming clients, {args.duration:.0f} s per policy, max_tokens {args.max_tokens}, "
              f"batch {args.max_batch_size}, prefill chunk {args.prefill_chunk or 'whole prompts'}, greedy, "
              f"HumanEval chat prompts; machine: {machine_description()}")
        print("policy    done/sent   req/s    tok/s  ttft50  ttft99   lat50   lat99    vsr accept lost garbled")
        for run in runs:
            print(format_row(run))
            for problem in run["problems"]:
                print(f"  {run['policy']}: {problem}")
        by_policy = {r["policy"]: r for r in runs}
        if "ar" in by_policy and "tetris" in by_policy and by_policy["ar"]["tokens_per_s"]:
            print(f"tokens/s ratio tetris/ar: "
                  f"{by_policy['tetris']['tokens_per_s'] / by_policy['ar']['tokens_per_s']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "runs": runs}, f, indent=2)
    return 0 if all(r["lost"] == 0 and r["garbled"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
