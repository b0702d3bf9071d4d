"""Load test of `batchspec serve`: N concurrent streaming clients for T seconds, per policy, in one run.

    python benchmarks/serve_load.py [--clients 64] [--duration 60] [--policies ar,tetris] [--max-tokens 64]
                                    [--target default] [--draft default] [--max-batch-size 16] [--out FILE]

For each policy it starts its own server (`python -m batchspec.cli serve` on a free loopback port), waits for
/health, sends two untimed warm-up requests, then runs the clients: each sends a streaming chat request (HumanEval
prompts, greedy, round robin), reads the SSE stream to the end and sends the next, until the time is up (requests
in flight then may finish). It reports requests/s, output tokens/s, TTFT and latency p50/p99, the server's VSR and
mean accepted length, and the tetris/ar throughput ratio.

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


# --- one streaming request over a raw connection (so that the SSE framing itself is checked) --------------------------


async def stream_chat(port: int, model: str, prompt: str, index: int, max_tokens: int) -> Answer:
    answer, started = Answer(index), time.perf_counter()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
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
    buffer, state = b"", {"id": None, "finished": False, "done": False, "parts": []}
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
    if not state["finished"] or not state["done"]:
        answer.problem = "lost: stream ended without " + ("finish_reason" if not state["finished"] else "[DONE]")
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
    if chunk.get("object") != "chat.completion.chunk" or len(chunk.get("choices", [])) != 1:
        return f"not a chat.completion.chunk: {data[:120]!r}"
    if state["id"] not in (None, chunk["id"]):
        return "the chunk id changed"
    state["id"] = chunk["id"]
    choice = chunk["choices"][0]
    content = choice["delta"].get("content")
    if content:
        if state["finished"]:
            return "text after finish_reason"
        answer.ttft_s = answer.ttft_s or time.perf_counter() - started
        state["parts"].append(content)
    if choice["finish_reason"] is not None:
        state["finished"] = True
        usage = chunk.get("usage") or {}
        if "spec" not in usage or usage.get("completion_tokens", 0) < (1 if state["parts"] else 0):
            return f"bad usage on the last chunk: {usage}"
        answer.completion_tokens, answer.spec = usage["completion_tokens"], usage["spec"]
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


def start_server(args: argparse.Namespace, policy: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "batchspec.cli", "serve", "--target", args.target, "--policy", policy,
               "-k", str(args.k), "--extra", str(args.extra), "--max-batch-size", str(args.max_batch_size),
               "--max-queue", str(max(args.clients, 1)), "--port", str(port), "--served-model-name", "bench",
               "--log-level", "warning", "--shutdown-timeout", "5"]
    if policy != "ar":
        command += ["--draft", args.draft]
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


def measure(args: argparse.Namespace, policy: str, prompts: list[str], references: dict[int, str]) -> dict:
    port = free_port()
    server = start_server(args, policy, port)
    try:
        asyncio.run(warm_up(port, prompts[:2]))
        answers, wall_s = asyncio.run(run_load(port, "bench", prompts, args.clients, args.duration, args.max_tokens))
        return summarize(policy, answers, wall_s, references, server_metrics(port))
    finally:
        server.send_signal(2)  # SIGINT: graceful shutdown
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def format_row(r: dict) -> str:
    def number(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    return (f"{r['policy']:<8} {r['completed']:>5}/{r['requests']:<5} {r['requests_per_s']:>7.2f} "
            f"{r['tokens_per_s']:>8.1f} {number(r['ttft_p50_s']):>7} {number(r['ttft_p99_s']):>7} "
            f"{number(r['latency_p50_s']):>7} {number(r['latency_p99_s']):>7} {number(r.get('vsr'), 3):>6} "
            f"{number(r.get('mean_accepted_length'), 3):>6} {r['lost']:>4} {r['garbled']:>7}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per policy")
    parser.add_argument("--policies", default="ar,tetris")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default")
    parser.add_argument("-k", "--k", type=int, default=4)
    parser.add_argument("--extra", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=164, help="HumanEval prompts to cycle through")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args()
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")

    prompts = [humaneval_chat_prompt(p) for p in humaneval_prompts()[:args.num_prompts]]
    references: dict[int, str] = {}
    runs = [measure(args, policy.strip(), prompts, references) for policy in args.policies.split(",")]
    print(f"{args.clients} streaming clients, {args.duration:.0f} s per policy, max_tokens {args.max_tokens}, "
          f"batch {args.max_batch_size}, greedy, HumanEval chat prompts; machine: {machine_description()}")
    print("policy    done/sent   req/s    tok/s  ttft50  ttft99   lat50   lat99    vsr accept lost garbled")
    for run in runs:
        print(format_row(run))
        for problem in run["problems"]:
            print(f"  {run['policy']}: {problem}")
    by_policy = {r["policy"]: r for r in runs}
    if "ar" in by_policy and "tetris" in by_policy and by_policy["ar"]["tokens_per_s"]:
        print(f"tokens/s ratio tetris/ar: {by_policy['tetris']['tokens_per_s'] / by_policy['ar']['tokens_per_s']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "runs": runs}, f, indent=2)
    return 0 if all(r["lost"] == 0 and r["garbled"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
