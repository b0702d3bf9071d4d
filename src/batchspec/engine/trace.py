"""Acceptance traces: what a real speculative run saw, step by step, for `batchspec sim` to replay.

Per speculative step and per active request a trace keeps the K' draft log-probs (the selection input of sd, dsd and
Tetris) and the true acceptance probabilities a[i,j] = min(1, p/q) of all K' drafts (the oracle measurement pass, so a
trace needs `--measure-oracle`), with the request index and output position, so the simulator can bootstrap whole
requests. It also keeps the engine's cumulative time counters at every step, from which `cost_model.fit_from_trace`
derives per-forward step times of this machine, and the run's measured metrics, for validation.

File: one safetensors file (no pickle): a[i,j] in float16 (3 significant digits; exactly 0 or 1 at temperature 0),
log q in float32 (Tetris ranks sums of log q, and float16 rounding would reorder near-ties, so a replay of the
recorded run would drift from it), integer arrays for the bookkeeping, and a JSON header entry `batchspec_trace`
with the run's metadata. About 6 bytes per draft: a 164-prompt HumanEval run at K' = 6 is under 1 MB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchspec.errors import BatchspecError

FORMAT = "batchspec-trace/1"
# Cumulative engine counters snapshotted at every recorded step (RunStats field names).
COUNTERS = ("target_s", "target_calls", "target_tokens", "draft_s", "draft_tokens", "select_s")
_ROW_ARRAYS = ("logprobs", "accept", "width", "request", "position", "slot", "step")
_REQUEST_ARRAYS = ("prompt_len", "output_len")
_STEP_ARRAYS = ("step_batch", "step_width", "step_counters")


@dataclass
class Trace:
    """A loaded trace. N rows (request-steps), R requests, S steps, W = widest K'."""

    meta: dict  # target, draft, policy, k, extra, batch_size, temperature, ..., "run": measured metrics
    logprobs: np.ndarray  # (N, W) float32 draft log q of each draft; -inf past the row's width
    accept: np.ndarray  # (N, W) float32 true acceptance a[i,j]; 0 past the row's width
    width: np.ndarray  # (N,) K' of the row's step
    request: np.ndarray  # (N,) request index, in [0, R)
    position: np.ndarray  # (N,) output tokens the request had when the step began (>= 1: prefill emits one)
    slot: np.ndarray  # (N,) KV-cache slot of the request
    step: np.ndarray  # (N,) step number, in [0, S)
    prompt_len: np.ndarray  # (R,) prompt tokens per request
    output_len: np.ndarray  # (R,) output tokens per request at the end of the run
    step_batch: np.ndarray  # (S,) active requests in the step
    step_width: np.ndarray  # (S,) K' of the step
    step_counters: np.ndarray  # (S, len(COUNTERS)) float64 cumulative counters when the step's drafts were measured

    @property
    def num_requests(self) -> int:
        return len(self.prompt_len)

    @property
    def max_width(self) -> int:
        return int(self.logprobs.shape[1])

    @property
    def greedy(self) -> bool:
        return float(self.meta.get("temperature", 0.0)) == 0.0


class TraceRecorder:
    """Collects one run's steps; the engine calls `record` once per speculative step that measured the true a."""

    def __init__(self) -> None:
        self._rows: list[tuple[np.ndarray, np.ndarray, list[int], list[int], list[int]]] = []
        self._steps: list[tuple[int, int, tuple[float, ...]]] = []

    def record(self, requests, logprobs, accept_probs, stats) -> None:
        """requests: the step's active `engine.Request`s (B); logprobs, accept_probs: (B, K') tensors; stats: RunStats.

        Copies only; called inside the step, so it is kept cheap (no float16 conversion until `save`).
        """
        batch, width = logprobs.shape
        if tuple(accept_probs.shape) != (batch, width) or len(requests) != batch:
            raise BatchspecError(f"trace record: expected {batch} requests and ({batch}, {width}) acceptance "
                                 f"probabilities, got {len(requests)} and {tuple(accept_probs.shape)}")
        self._rows.append((logprobs.detach().float().numpy().copy(), accept_probs.detach().float().numpy().copy(),
                           [r.index for r in requests], [len(r.output_ids) for r in requests],
                           [-1 if r.slot is None else r.slot for r in requests]))
        self._steps.append((batch, width, tuple(float(getattr(stats, name)) for name in COUNTERS)))

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def to_trace(self, requests, meta: dict) -> Trace:
        """Assemble a Trace; `requests` are the run's requests at the end (their final output lengths)."""
        if not self._rows:
            raise BatchspecError("nothing to save in the trace: no speculative step measured acceptance "
                                 "(record needs --measure-oracle or the oracle policy, and a non-ar policy)")
        width = max(w for _, w, _ in self._steps)
        logprobs = np.full((sum(b for b, _, _ in self._steps), width), -np.inf, dtype=np.float32)  # (N, W)
        accept = np.zeros_like(logprobs)  # (N, W)
        start = 0
        for lp, acc, *_ in self._rows:
            logprobs[start:start + len(lp), :lp.shape[1]] = lp
            accept[start:start + len(acc), :acc.shape[1]] = acc
            start += len(lp)
        count = 1 + max(r.index for r in requests)
        prompt_len, output_len = np.zeros(count, np.int32), np.zeros(count, np.int32)
        for r in requests:
            prompt_len[r.index], output_len[r.index] = len(r.prompt_ids), len(r.output_ids)

        def column(i: int) -> np.ndarray:
            return np.array([v for row in self._rows for v in row[i]], dtype=np.int32)

        step_rows = [b for b, _, _ in self._steps]
        return Trace(
            meta={"format": FORMAT, **meta}, logprobs=logprobs, accept=accept,
            width=np.repeat([w for _, w, _ in self._steps], step_rows).astype(np.int32),
            request=column(2), position=column(3), slot=column(4),
            step=np.repeat(np.arange(len(self._steps)), step_rows).astype(np.int32),
            prompt_len=prompt_len, output_len=output_len,
            step_batch=np.array(step_rows, np.int32), step_width=np.array([w for _, w, _ in self._steps], np.int32),
            step_counters=np.array([c for _, _, c in self._steps], np.float64).reshape(-1, len(COUNTERS)),
        )


def save_trace(trace: Trace, path: str | Path) -> Path:
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(getattr(trace, name)) for name in _ROW_ARRAYS + _REQUEST_ARRAYS + _STEP_ARRAYS}
    arrays["logprobs"] = arrays["logprobs"].astype(np.float32)
    arrays["accept"] = arrays["accept"].astype(np.float16)
    save_file(arrays, str(path), metadata={"batchspec_trace": json.dumps(trace.meta)})
    return path


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace file; any problem is a BatchspecError naming the file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise BatchspecError(f"trace file not found: {path}")
    try:
        with safe_open(str(path), framework="np") as f:
            header = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error type for corrupt headers and data
        raise BatchspecError(f"{path} is not a batchspec trace (unreadable safetensors file: {err})") from None
    try:
        meta = json.loads(header["batchspec_trace"])
    except (KeyError, json.JSONDecodeError):
        raise BatchspecError(f"{path} is not a batchspec trace (no batchspec_trace metadata)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise BatchspecError(f"{path}: unsupported trace format {found!r} (expected {FORMAT})")
    missing = [n for n in _ROW_ARRAYS + _REQUEST_ARRAYS + _STEP_ARRAYS if n not in arrays]
    if missing:
        raise BatchspecError(f"{path}: trace lacks arrays {', '.join(missing)}")
    trace = Trace(meta=meta, **{n: arrays[n] for n in _ROW_ARRAYS + _REQUEST_ARRAYS + _STEP_ARRAYS})
    trace.logprobs = trace.logprobs.astype(np.float32)
    trace.accept = trace.accept.astype(np.float32)
    _check_shapes(trace, path)
    return trace


def _check_shapes(trace: Trace, path: Path) -> None:
    rows = len(trace.request)
    problems = []
    if trace.logprobs.ndim != 2 or trace.accept.shape != trace.logprobs.shape or trace.logprobs.shape[0] != rows:
        problems.append(f"logprobs {trace.logprobs.shape} and accept {trace.accept.shape} must both be ({rows}, W)")
    if any(len(getattr(trace, n)) != rows for n in _ROW_ARRAYS[2:]):
        problems.append("per-row arrays differ in length")
    if len(trace.output_len) != len(trace.prompt_len) or not rows:
        problems.append("no rows, or prompt_len and output_len differ in length")
    elif trace.request.min() < 0 or trace.request.max() >= len(trace.prompt_len):
        problems.append("request index out of range")
    steps = len(trace.step_batch)
    if len(trace.step_width) != steps or trace.step_counters.shape != (steps, len(COUNTERS)):
        problems.append("per-step arrays differ in shape")
    elif rows and (trace.step.min() < 0 or trace.step.max() >= steps):
        problems.append("step index out of range")
    if not problems and (np.isnan(trace.accept).any() or trace.accept.min() < 0 or trace.accept.max() > 1):
        problems.append("acceptance probabilities outside [0, 1]")
    if problems:
        raise BatchspecError(f"{path}: malformed trace: {'; '.join(problems)}")


# ---------------------------------------------------------------------------------------------------------------
# Reading a trace at any output position (what `batchspec sim` replays)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Timelines:
    """Per request and output position: the K' drafts' statistics a step starting there sees. P = sum(output_len)."""

    logprobs: np.ndarray  # (P, W) draft log q, -inf where unknown
    accept: np.ndarray  # (P, W) acceptance a[i,j], 0 where unknown
    offset: np.ndarray  # (R,) row of (request r, position 0); row of position pos is offset[r] + pos
    prompt_len: np.ndarray  # (R,)
    output_len: np.ndarray  # (R,)

    @property
    def width(self) -> int:
        return self.logprobs.shape[1]


def build_timelines(trace: Trace) -> Timelines:
    """For every request and output position, the drafts a step starting there would see.

    Recorded positions give their record. At temperature 0 a skipped position (the recorded run accepted past it) is
    rebuilt exactly: a greedy draft that was right up to `pos` proposes what it proposed in the record before, from
    `pos` on, and then what the next record proposes, aligned on output token positions. At temperature > 0, or where
    that does not hold, the nearest earlier record stands in.
    """
    width = trace.max_width
    output_len = trace.output_len.astype(np.int64)
    offset = np.concatenate([[0], np.cumsum(output_len)[:-1]]).astype(np.int64)  # (R,)
    logprobs = np.full((int(output_len.sum()), width), -np.inf, dtype=np.float32)  # (P, W)
    accept = np.zeros_like(logprobs)  # (P, W)
    order = np.lexsort((trace.position, trace.request))  # rows by request, then position
    starts = np.searchsorted(trace.request[order], np.arange(trace.num_requests + 1))
    for r in range(trace.num_requests):
        rows = order[starts[r]:starts[r + 1]]  # this request's records, by position
        if len(rows) == 0:
            continue  # finished at prefill: never in a speculative step
        positions = trace.position[rows]
        for pos in range(int(output_len[r])):
            lp, acc = _view(trace, rows, positions, pos)
            logprobs[offset[r] + pos, :len(lp)] = lp
            accept[offset[r] + pos, :len(acc)] = acc
    return Timelines(logprobs, accept, offset, trace.prompt_len.astype(np.int64), output_len)


def _view(trace, rows: np.ndarray, positions: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(log q, a) of the drafts from output position `pos`, from the request's records `rows` at `positions`."""
    m = max(int(np.searchsorted(positions, pos, side="right")) - 1, 0)
    row, shift = rows[m], pos - int(positions[m])
    width = int(trace.width[row])
    exact = (trace.logprobs[row, :width], trace.accept[row, :width])
    # A shifted view is exact only at temperature 0 and only if the record's first `shift` drafts were right.
    if shift <= 0 or not trace.greedy or shift > width or trace.accept[row, :shift].min() < 0.5:
        return exact
    lp, acc = [exact[0][shift:]], [exact[1][shift:]]
    if m + 1 < len(rows):  # continue with the next record, aligned on output token positions
        nxt = rows[m + 1]
        start = int(positions[m]) + width - int(positions[m + 1])  # index of the first token record m lacks
        if start >= 0:
            need = trace.max_width - (width - shift)
            lp.append(trace.logprobs[nxt, start:min(int(trace.width[nxt]), start + need)])
            acc.append(trace.accept[nxt, start:min(int(trace.width[nxt]), start + need)])
    return np.concatenate(lp), np.concatenate(acc)
