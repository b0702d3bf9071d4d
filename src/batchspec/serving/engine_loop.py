"""The server's engine thread: the one place the engine runs, fed by HTTP handlers through thread-safe queues.

HTTP handlers (asyncio, the server's event loop) call `submit`, which returns a `RequestStream`; the engine thread
admits the request between two steps, and after every step pushes the request's new text into its stream with
`loop.call_soon_threadsafe`. `abort` (a client that went away) takes the request out before the next step, which
frees its KV slot. Nothing but this thread touches the engine, its scheduler or its caches.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from batchspec.engine.request import Request, spec_metrics, visible_ids, visible_text
from batchspec.errors import BatchspecError
from batchspec.runtime.sampling import SamplingParams

log = logging.getLogger("batchspec.server")


class QueueFull(Exception):
    """More requests in flight than the batch plus the waiting queue may hold."""


class ShuttingDown(Exception):
    """The engine loop no longer takes requests."""


@dataclass
class Delta:
    """New output of one request after one step. The last one has `finish_reason` (or `error`) set."""

    text: str  # text not yet sent: concatenating every delta's text gives the whole output
    finish_reason: str | None = None  # "stop" | "length"
    usage: dict | None = None  # on the last delta: prompt_tokens, completion_tokens, total_tokens, spec
    error: str | None = None  # the request failed: why
    error_status: int = 500  # its HTTP status: 400 refused by the scheduler, 500 engine error, 503 shutdown
    error_code: str | None = None


class RequestStream:
    """The HTTP side of one request: deltas from the engine thread arrive in an asyncio queue of the server loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False  # the last delta was received (set on the event loop)
        self.scheduler_id: int | None = None  # set by the engine thread once admitted to the scheduler

    def push(self, delta: Delta) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def next(self) -> Delta:
        delta = await self._queue.get()
        if delta.finish_reason is not None or delta.error is not None:
            self.done = True
        return delta

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        return await self.next()


CANCELLED = Delta("", error="the server is shutting down; the request was cancelled", error_status=503,
                  error_code="cancelled")


@dataclass
class _Tracked:
    stream: RequestStream
    sent: str = ""  # text already pushed


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "cancel" (every request in flight) | "stop"
    stream: RequestStream | None = None
    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None


class EngineLoop:
    def __init__(self, engine, max_model_len: int, max_queue: int, metrics=None) -> None:
        """engine: an `Engine`; slots = its max_batch_size; at most `max_queue` requests wait for a slot."""
        self.engine = engine
        self.max_model_len = max_model_len
        self.max_queue = max_queue
        self.metrics = metrics  # a `serving.metrics.ServerMetrics`, or None
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted, not yet finished or aborted
        self._accepting = False
        self._thread = threading.Thread(target=self._run, name="batchspec-engine", daemon=True)
        self._tracked: dict[int, _Tracked] = {}  # engine thread only: scheduler id -> stream
        self.num_running = 0  # snapshots for /health and the queue-depth gauge, written by the engine thread
        self.num_waiting = 0

    # --- called from the HTTP side ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._open()
        self._accepting = True
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._accepting and self._thread.is_alive()

    @property
    def capacity(self) -> int:
        return self.engine.max_batch_size + self.max_queue

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (prompt already checked against the context). Raises QueueFull or ShuttingDown."""
        stream = RequestStream(asyncio.get_running_loop())
        with self._lock:
            if not self.alive:
                raise ShuttingDown("the server is shutting down" if not self._accepting else "the engine stopped")
            if self._in_flight >= self.capacity:
                raise QueueFull(f"the server is at capacity: {self.engine.max_batch_size} requests running and "
                                f"{self.max_queue} waiting; retry later")
            self._in_flight += 1
            # Inside the lock: once `stop` has refused new requests, no add can arrive after its stop command.
            self._inbox.put(_Command("add", stream, list(prompt_ids), params))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Drop a request whose client went away; its slot is freed before the next step."""
        if not stream.done:
            self._inbox.put(_Command("abort", stream))

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet answered (finished, failed, cancelled or aborted)."""
        return self._in_flight

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def refuse_new(self) -> None:
        """From now on `submit` raises ShuttingDown (503); requests in flight go on."""
        with self._lock:
            self._accepting = False

    def cancel_all(self) -> None:
        """End every request in flight with a 503 error delta, after the engine's current step."""
        self._inbox.put(_Command("cancel"))

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `drain_timeout_s`, cancel the rest, join."""
        self.refuse_new()
        deadline = time.monotonic() + drain_timeout_s
        while self._in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        if self._thread.is_alive():
            self._inbox.put(_Command("stop"))
            self._thread.join()

    # --- the engine thread -----------------------------------------------------------------------------------------

    def _open(self) -> None:
        """A fresh run of the engine: empty caches of room for the longest request plus one step's speculative
        overshoot (rolled back after the step). A server runs for days: it keeps counters, not every step's
        windows."""
        self.engine.open(self.engine.max_batch_size, self.max_model_len + self.engine.max_draft_length() + 2,
                         keep_windows=False)

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_work()):
                if self.engine.has_work():
                    self._step()
        except BaseException:
            log.exception("engine loop crashed")
            with self._lock:
                self._accepting = False
        finally:
            self._fail_all(CANCELLED, "cancelled")

    def _handle_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle). False once told to stop."""
        try:
            command = self._inbox.get(block=block)
            while True:
                if command.kind == "stop":
                    return False
                if command.kind == "cancel":
                    self._fail_all(CANCELLED, "cancelled")
                else:
                    self._apply(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, command: _Command) -> None:
        stream = command.stream
        if command.kind == "add":
            try:
                stream.scheduler_id = self.engine.add_request(command.prompt_ids, command.params)
            except BatchspecError as err:
                self._finish(stream, Delta("", error=str(err), error_status=400, error_code="invalid_request"),
                             "error")
                return
            self._tracked[stream.scheduler_id] = _Tracked(stream)
        elif command.kind == "abort" and stream.scheduler_id in self._tracked:
            self.engine.abort(stream.scheduler_id)
            del self._tracked[stream.scheduler_id]
            self._release("abort")
        self._snapshot()

    def _step(self) -> None:
        stats = self.engine.stats
        before = (stats.verified, stats.accepted, stats.request_steps, stats.step_emitted)
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as err:  # a bug or an exhausted resource: fail what is in flight, keep serving
            log.exception("engine step failed")
            self._fail_all(Delta("", error=f"internal error in the engine step: {err}", error_code="internal_error"),
                           "error")
            self._open()
            return
        elapsed = time.perf_counter() - started
        step = self.engine.last_step  # None when there was nothing to run
        if self.metrics is not None and step is not None:
            after = (stats.verified, stats.accepted, stats.request_steps, stats.step_emitted)
            # A prefill step's batch is the prompts it ran (whole or a chunk each), a decode step's the running ones.
            phase, batch = ("prefill", len(step.chunks)) if step.prefill else ("decode", len(step.running))
            self.metrics.observe_step(elapsed, phase, batch, *(a - b for a, b in zip(after, before)))
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is not None:
                self._deliver(tracked, out.request)
        self._snapshot()

    def _deliver(self, tracked: _Tracked, request: Request) -> None:
        target = self.engine.target
        text = visible_text(request, target.eos_token_ids, target.tokenizer)
        if not request.finished:
            text = _settled(text, request.params.stop)
        new = text[len(tracked.sent):] if len(text) > len(tracked.sent) else ""
        tracked.sent += new
        if not request.finished:
            if new:
                tracked.stream.push(Delta(new))
            return
        completion_tokens = len(visible_ids(request, target.eos_token_ids))
        usage = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(request.prompt_ids) + completion_tokens,
                 "spec": {"policy": self.engine.spec.policy, **spec_metrics(request)}}
        del self._tracked[request.index]
        if self.metrics is not None:
            self.metrics.observe_finished(request, completion_tokens)
        self._finish(tracked.stream, Delta(new, request.finish_reason, usage), request.finish_reason)

    def _finish(self, stream: RequestStream, delta: Delta, reason: str) -> None:
        stream.push(delta)
        self._release(reason)

    def _release(self, reason: str) -> None:
        """One request fewer in flight; reason: stop | length | abort | error | cancelled."""
        with self._lock:
            self._in_flight -= 1
        if self.metrics is not None:
            self.metrics.requests_finished.labels(reason).inc()

    def _fail_all(self, failure: Delta, reason: str) -> None:
        """End every request in flight with the same error delta."""
        for scheduler_id, tracked in list(self._tracked.items()):
            self.engine.abort(scheduler_id)
            self._finish(tracked.stream, failure, reason)
        self._tracked.clear()
        stop_requested = False
        while True:  # requests submitted but never admitted
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command.kind == "add":
                self._finish(command.stream, failure, reason)
            stop_requested |= command.kind == "stop"
        if stop_requested:  # after a failed step the loop goes on: it must still see the stop
            self._inbox.put(_Command("stop"))
        self._snapshot()

    def _snapshot(self) -> None:
        self.num_running, self.num_waiting = self.engine.scheduler.num_active, self.engine.scheduler.num_waiting
        if self.metrics is not None:
            self.metrics.set_load(self.num_running, self.num_waiting)


def _settled(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running request's text that can be sent already.

    Holds back a trailing replacement character (a multi-byte character whose remaining bytes come with the next
    token) and any tail that may be the start of a stop string (which must never be sent).
    """
    text = text.rstrip("\ufffd")
    keep = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep]
