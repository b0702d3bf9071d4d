"""What a speculative step costs on this machine: dsd's fitted T(B, k), the target's time by rows scored, profiling.

Profiles are cached as JSON under `<cache>/profiles/`, keyed by both models' configurations and a fingerprint of
their weights, the grid, the torch version, thread count, CPU and the runtime's own code (`runtime_code_version`: a
change of kernels changes what a forward costs): a second run on the same machine reuses the fit instead of spending
~10-30 s re-timing forwards. Delete the directory (or set BATCHSPEC_CACHE) to re-profile.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from batchspec.errors import BatchspecError
from batchspec.runtime.device import device_description
from batchspec.runtime.machine import machine_description
from batchspec.runtime.model import Transformer

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"  # the package whose code sets what a forward costs
LEARN_RATE = 0.3  # how far one measured forward moves a row-time table (`RowTimeTable.learn`)
# How far each learned forward also moves every point of a row-time table toward the profile's shape at the
# machine's present speed (`RowTimeTable.learn`), and how fast that speed follows the forwards.
RELAX_RATE = 0.05
LEVEL_RATE = 0.1


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per speculative step: T(B, k) = c_fixed + c_draft_step*k + c_draft_token*B*k + c_target_token*B*(k+1).

    Why this form: the target runs once over B*(k+1) positions (a launch/weight-read cost `c_fixed` plus a per-token
    cost); the draft runs k *sequential* steps, each paying a per-step overhead independent of B plus a per-token
    cost for its B rows. Linear in the coefficients, so it is fitted by least squares on profiled (B, k, seconds).
    """

    c_fixed: float
    c_draft_step: float
    c_draft_token: float
    c_target_token: float

    @staticmethod
    def features(batch_size: int, k: int) -> tuple[float, float, float, float]:
        return (1.0, float(k), float(batch_size * k), float(batch_size * (k + 1)))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> StepTimeModel:
        """Least-squares fit on (batch_size, k, seconds) samples.

        Samples that do not vary both B and k leave the system rank-deficient; the minimum-norm solution (gelsd)
        still predicts well inside the profiled range.
        """
        if len(samples) < 4:
            raise BatchspecError(
                f"need at least 4 (batch_size, k, seconds) samples to fit the step-time model, got {len(samples)}"
            )
        design = torch.tensor([cls.features(b, k) for b, k, _ in samples], dtype=torch.float64)  # (N, 4)
        seconds = torch.tensor([[t] for _, _, t in samples], dtype=torch.float64)  # (N, 1)
        coef = torch.linalg.lstsq(design, seconds, driver="gelsd").solution[:, 0]  # (4,)
        return cls(*(float(c) for c in coef))

    def __call__(self, batch_size: int, k: int) -> float:
        f = self.features(batch_size, k)
        return self.c_fixed * f[0] + self.c_draft_step * f[1] + self.c_draft_token * f[2] + self.c_target_token * f[3]


@dataclass(frozen=True)
class RowTimeTable:
    """Seconds of one target forward by the number of positions (rows) it scores, as profiled.

    A table, not a line: on CPUs whose kernels work on blocks of rows (batch-invariant bfloat16: 16-row blocks) the
    time is a staircase in the rows, and a verified draft is nearly free until the next step up. Its fields are the
    profile as taken (what the cache stores and equality compares); what it predicts follows `learn`.
    """

    rows: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]
    # Seconds per attention query row padded: a forward whose requests append different numbers of tokens pads each
    # to the most (`runtime.attention`), and the rows above are timed with at most one padded query row per request
    # (where the rows are not a multiple of the requests). 0: not profiled.
    pad_s: float = 0.0

    def __post_init__(self) -> None:  # arrays once: the table is read at every step (selection overhead)
        x, y = np.asarray(self.rows, dtype=np.float64), np.array(self.seconds, dtype=np.float64)
        object.__setattr__(self, "_table", (x, y, self._slope(x, y)))
        object.__setattr__(self, "version", 0)  # forwards learned from (`learn`)
        object.__setattr__(self, "level", 1.0)  # the machine's speed now over the profile's (`learn`, `rescale`)
        object.__setattr__(self, "_profile", (y.copy(), self._slope(x, y)))  # the profile's seconds, kept as taken

    @staticmethod
    def _slope(x: np.ndarray, y: np.ndarray) -> float:
        return float((y[-1] - y[-2]) / (x[-1] - x[-2])) if len(x) > 1 else 0.0

    def __call__(self, rows):
        """Interpolated seconds at `rows` (int or array); beyond the table, the last segment's slope."""
        return self._interpolate(*self._table, rows)

    @staticmethod
    def _interpolate(x: np.ndarray, y: np.ndarray, slope: float, rows):
        rows = np.asarray(rows, dtype=np.float64)
        return np.where(rows > x[-1], y[-1] + slope * (rows - x[-1]), np.interp(rows, x, y))

    def learn(self, rows: int, seconds: float, rate: float = LEARN_RATE) -> None:
        """Move the table toward a forward over `rows` that took `seconds`: the points the interpolation at `rows`
        reads, each by its weight, `rate` of the way (the error capped at half the prediction, so one forward slowed
        by another process moves the table little), kept non-decreasing in the rows: a point raised raises the ones
        after it, a point lowered lowers the ones before it (a batch that always runs 16 rows must be able to learn
        that 16 rows got cheaper, whatever the 15-row point, never timed again, says).

        A profile is taken once per machine and cached; a shared machine's speed drifts (measured on the AVX2 EPYC
        within one afternoon: the SmolLM2 target's forward over 16 / 32 / 48 rows 113 / 138 / 169 ms when profiled,
        89 / 132 / 197 ms three hours later, so a verified row cost twice what the table said), and goodput plans
        priced on the old table speculate where it no longer pays. The profile stays on disk as it was taken; the
        engine's copy follows what its forwards measure.

        Every point also moves `RELAX_RATE` of the way toward the profile's point times `level`, the ratio of what
        forwards take to what the profile says, followed at `LEVEL_RATE` from every forward whatever its rows: a
        point only the forwards a plan avoids would correct does not keep what a slow moment taught it. Measured
        on the Xeon (the SmolLM2 target in bfloat16, batch 1): a few passes slowed by another process had raised the
        5-row point to 90 ms against 61 at 1 row (the profile: 45 and 42), every later point with it, and a plan
        priced so drafted ~2 tokens a step where fixed k = 4 ran faster; nothing ever timed 5 rows again."""
        x, y, _ = self._table
        predicted = float(self(rows))
        if predicted <= 0.0:
            return
        profiled = float(self._interpolate(x, *self._profile, rows))  # the profile's own seconds at `rows`
        if profiled > 0.0 and seconds > 0.0:
            ratio = min(max(seconds / profiled, 0.5 * self.level), 2.0 * self.level)
            object.__setattr__(self, "level", self.level + LEVEL_RATE * (ratio - self.level))
        error = rate * min(max(seconds - predicted, -0.5 * predicted), 0.5 * predicted)
        upper = int(np.searchsorted(x, rows))  # the first point at or past `rows`
        if upper >= len(x):  # past the table (extrapolated on its last slope): its last point, by the same ratio
            y[-1] += y[-1] * error / predicted
        elif upper == 0 or x[upper] == rows:
            y[upper] += error
        else:
            weight = (rows - x[upper - 1]) / (x[upper] - x[upper - 1])
            y[upper - 1] += (1.0 - weight) * error
            y[upper] += weight * error
        np.maximum(y, 0.0, out=y)
        if error > 0.0:  # what was raised raises the points after it
            np.maximum.accumulate(y, out=y)
        else:  # what was lowered lowers the points before it (fewer rows never cost more)
            y[:] = np.minimum.accumulate(y[::-1])[::-1]
        y += RELAX_RATE * (self.level * self._profile[0] - y)  # both non-decreasing: so is the result
        self._learned(x, y)

    def rescale(self, rows: int, seconds: float, most: float = 2.0) -> None:
        """Scale every point by `seconds` over the prediction at `rows` (at most `most` times either way): the
        machine's speed moved, the table's shape (what a row more costs against a plain step) is the profile's."""
        x, y, _ = self._table
        predicted = float(self(rows))
        if predicted <= 0.0 or seconds <= 0.0:
            return
        factor = min(max(seconds / predicted, 1.0 / most), most)
        y *= factor
        object.__setattr__(self, "level", self.level * factor)
        self._learned(x, y)

    def _learned(self, x: np.ndarray, y: np.ndarray) -> None:
        """The table now predicts from seconds `y` (changed in place): its last slope follows, its version counts."""
        object.__setattr__(self, "_table", (x, y, self._slope(x, y)))
        object.__setattr__(self, "version", self.version + 1)


@dataclass(frozen=True)
class StepCost:
    """A step's time by its parts: K' draft passes over B rows and one target pass over the verified rows, each from
    its own profiled table (`needs_row_times`), and T(B, k) as a whole (from the tables, else dsd's fitted line)."""

    model: StepTimeModel
    target: RowTimeTable | None = None  # the target's forward by rows scored
    draft: RowTimeTable | None = None  # the draft's forward by requests (one token each)
    # Whether the draft's table also timed a request catching up (`CATCH_UP_ROWS`): what `catch_up_s` prices.
    catch_up: bool = False

    @property
    def pad_s(self) -> float:
        """The target's seconds per padded attention query row (`RowTimeTable.pad_s`)."""
        return self.target.pad_s if self.target is not None else 0.0

    def draft_s(self, batch_size: int, k: int) -> float:
        # A table, not the fit's draft terms: a least-squares fit over few points may give them any sign.
        return k * float(self.draft(batch_size)) if k else 0.0

    def target_s(self, rows):
        return self.target(rows)

    @property
    def version(self) -> tuple[int, int]:
        """How many forwards each table has learned from (`learn`): a plan's costs computed at another are stale."""
        return (getattr(self.target, "version", 0), getattr(self.draft, "version", 0))

    def learn(self, target_rows: int, padded: int, target_s: float, pass_rows: Sequence[int], draft_s: float) -> None:
        """Learn from a step as it ran: the target's pass over `target_rows` rows (`padded` attention rows besides,
        priced at `pad_s`) took `target_s`; the draft's passes over `pass_rows` rows each took `draft_s` together,
        shared among them as the table predicts them (`RowTimeTable.learn`), where none runs past the table."""
        if self.target is not None and target_rows:
            self.target.learn(target_rows, max(0.0, target_s - self.pad_s * padded))
        # Passes past the draft's table (a first pass running whole prompts) are left out: shared by prediction, an
        # error in the extrapolation would move the points every pass reads.
        if self.draft is not None and pass_rows and max(pass_rows) <= self.draft.rows[-1]:
            predicted = [float(self.draft(rows)) for rows in pass_rows]
            total = sum(predicted)
            if total > 0.0:
                for rows, seconds in zip(pass_rows, predicted):
                    self.draft.learn(rows, seconds * draft_s / total)

    def refresh(self, target: Transformer, draft: Transformer, batch: int) -> None:
        """Time again the forwards a step of `batch` requests always runs, the target's over `batch` rows (a plain
        step) and one draft pass over them, and scale each table by what it measured there (`RowTimeTable.rescale`):
        a cached profile is the machine as it was when profiled, and the first steps of a run choose whether to pay
        for the draft's catch-up of every prompt. Untimed: about two seconds on the Qwen pair (eight forwards of each).

        Moving the `batch`-row point alone (as `learn`) priced verification against a plain step of another speed:
        on the SmolLM2 pair at batch 16 (Xeon) the profile's 88 ms at 16 rows was re-timed at 72 while 32 rows stayed
        at the profile's 108, so a verified row cost 2.3 ms where it had cost 1.25, and the second run of an engine
        planned no drafting at its start (a full run later: 1,046 drafts in 216 target calls against 2,194 in 160).

        Each model is timed twice, the two models in turn, and the faster figure counts: a shared machine slows down
        for a second or two now and then, and one such moment would price a whole run. Measured on the Xeon (the
        Qwen pair, 8 rows, twelve refreshes in a row): the target 167-175 ms, the draft 47-48 ms in nine and 78-79 ms
        in three consecutive ones: a run's draft passes priced 1.65x."""
        timed = [(table, model) for table, model in ((self.target, target), (self.draft, draft)) if table is not None]
        rounds = [[_time_ragged(model, [1] * batch, repeats=3) for _, model in timed] for _ in range(2)]
        for (table, _), seconds in zip(timed, map(min, zip(*rounds))):
            table.rescale(batch, seconds)

    def catch_up_s(self, drafting: int, tokens: np.ndarray) -> np.ndarray | None:
        """(B,) seconds each request's `tokens` of catch-up add to a first draft pass over `drafting` requests (the
        tokens its draft cache lacks beyond the one every pass runs: a whole prompt before it first drafts); None
        where the draft's table has no catch-up point (a cost model of the simulator's)."""
        if not self.catch_up or self.draft is None:
            return None
        return self.draft(drafting + tokens) - float(self.draft(drafting))

    def __call__(self, batch_size: int, k: int) -> float:
        """T(B, k): k draft passes over B requests and a target pass over B * (k + 1) rows, from the profiled tables
        where there are (a line fitted across the target's staircase of row blocks may even give verified rows a
        negative cost), else dsd's fitted model."""
        if self.target is None or self.draft is None:
            return self.model(batch_size, k)
        return self.draft_s(batch_size, k) + float(self.target_s(batch_size * (k + 1)))


# 2: row times re-timed where a busy machine slowed them, and non-decreasing (`profile_row_times`); 3: the target's
# padded attention rows (`profile_pad_time`); 4: each grid point timed at exactly its rows (`profile_row_times`);
# 5: the grid ends at the most rows a step can verify (`row_grid`).
PROFILE_VERSION = 5

# Forwards are timed after this many tokens of context: a chat prompt and part of its answer (HumanEval's chat prompts
# run 100-250 tokens, answers 128-256), where attention's share of a step is what a served request sees.
PROFILE_CONTEXT = 256


def _time_forward(model: Transformer, batch: int, tokens_each: int, repeats: int = 2) -> float:
    """Median seconds of one forward of `batch` requests appending `tokens_each` tokens after `PROFILE_CONTEXT`
    tokens of context. The context is the cache's zeros, never computed: attention's cost depends on how many keys
    it reads, not on their values, and a prefill per profiled point would cost more than the profile."""
    return _time_ragged(model, [tokens_each] * batch, repeats)


def _time_ragged(model: Transformer, appends: list[int], repeats: int = 2) -> float:
    """`_time_forward` with request i appending appends[i] tokens."""
    longest, batch = max(appends), len(appends)
    context_len = max(0, min(PROFILE_CONTEXT, model.config.max_position_embeddings - longest - 1))
    cache = model.new_cache(batch, context_len + longest + 1)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    times = []
    for _ in range(repeats + 1):  # the first call warms up and is dropped
        cache.lengths[slots] = context_len
        num_new = torch.tensor(appends, dtype=torch.int64)
        tokens = torch.randint(0, model.config.vocab_size, (sum(appends),))
        started = time.perf_counter()
        model.forward(cache, slots, num_new, tokens)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


@cache
def runtime_code_version() -> str:
    """sha256 (16 hex digits) of the runtime package's sources: profiles taken with other kernels are not reused."""
    digest = hashlib.sha256()
    for path in sorted(RUNTIME_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _profile_key(target: Transformer, draft: Transformer, max_batch: int, k_max: int) -> str:
    def model_id(model: Transformer) -> dict:
        weights = model.embed.float()
        head = None if model.head_ids is None else hashlib.sha256(
            model.head_ids.cpu().numpy().tobytes()).hexdigest()[:16]  # a restricted LM head: a cheaper forward
        return {"config": model.config.as_dict(), "embed": [float(weights[:64].sum()), float(weights[-64:].sum())],
                "dtype": model.precision, "linear": model.linear_backend, "device": str(model.device),
                "accelerator": device_description(model.device), "head": head}

    key = {"target": model_id(target), "draft": model_id(draft), "max_batch": max_batch, "k_max": k_max,
           "torch": torch.__version__, "cpu": machine_description(), "runtime": runtime_code_version(),
           "context": PROFILE_CONTEXT, "profile": PROFILE_VERSION,
           "machine": platform.machine(), "node": platform.node()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _cached(name: str, profile, read):
    """`profile()`, remembered as JSON under `<cache>/profiles/<name>.json` (`read` rebuilds it from the JSON)."""
    from batchspec.weights.known_models import cache_root

    path = cache_root() / "profiles" / f"{name}.json"
    try:
        return read(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        pass  # absent or unreadable: profile again
    result = profile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(asdict(result)))
        path.with_suffix(".tmp").rename(path)
    except OSError:
        pass  # a read-only cache only costs the re-profiling
    return result


def cached_step_time(target: Transformer, draft: Transformer, max_batch: int, k_max: int) -> StepTimeModel:
    """`profile_step_time`, remembered on disk for this machine and model pair."""
    return _cached(f"step-time-{_profile_key(target, draft, max_batch, k_max)}",
                   lambda: profile_step_time(target, draft, max_batch, k_max), lambda data: StepTimeModel(**data))


def profile_step_time(target: Transformer, draft: Transformer, max_batch: int, k_max: int) -> StepTimeModel:
    """Samples T(B, k) = k draft steps of B tokens + one target pass over B*(k+1) tokens, on a small grid; fit."""
    batches = sorted({1, max(1, max_batch // 2), max_batch})
    windows = sorted({0, 1, max(1, k_max // 2), k_max})
    draft_time = {b: _time_forward(draft, b, 1) for b in batches}
    samples = []
    for b in batches:
        for k in windows:
            samples.append((b, k, k * draft_time[b] + _time_forward(target, b, k + 1)))
    return StepTimeModel.fit(samples)


def row_grid(max_rows: int) -> list[int]:
    """Rows to profile: every few rows at first, then at and between multiples of 16 (where blocked kernels step), and
    `max_rows` itself, so that no row count a step can verify is priced beyond the table.

    Without the last point a table ended at the grid's last point below `max_rows` and the rows past it were priced
    on the slope of its last segment: the Qwen 1.5B target at batch 4 with K' = 6 (28 rows at most) was timed up to
    17 rows, the step from 16 (219 ms) to 17 (248: one padded query row more per request) extrapolated at 29 ms a row,
    so 28 rows were priced 563 ms where they take ~294.

    Every row count up to 9, and 12: a draft's kernels change there (the int4 kernel works in blocks of 4 rows, so
    its cost steps at 5 and 9 and its third block ends at 12; `Int4Weight.WIDE_ROWS` = 5 and `Float32Wide.ROWS` = 9
    hand calls to its int8 or float32 copy). On an AVX2 EPYC the 0.5B int4 draft took 64 ms at 4 rows and 136 at 6
    and 8, so 5 rows interpolated between 4 and 6 were priced 100."""
    grid = {*range(1, 10), 12, max(max_rows, 1)}
    grid |= {r for m in range(16, max_rows + 16, 16) for r in (m - 1, m, m + 1)}
    return sorted(r for r in grid if r <= max(max_rows, 1))


def profile_pad_time(model: Transformer, max_batch: int) -> float:
    """Seconds per padded attention query row: B (up to 8) requests appending 2 tokens each, against one appending
    B + 1 and the others 1 each (the same 2B rows, padded to B * (B + 1) query rows). Measured
    on the Qwen 1.5B target in bfloat16 (attention in float64 for batch invariance), 300 tokens of context: 32 rows
    as windows of 6, 0, 6, 5, 0, 0, 6, 1 took 234 ms, as windows of 3 each 214-220."""
    requests = min(max_batch, 8)
    if requests < 2:
        return 0.0
    uniform = _time_ragged(model, [2] * requests, repeats=3)
    ragged = _time_ragged(model, [requests + 1] + [1] * (requests - 1), repeats=3)
    return max(0.0, (ragged - uniform) / (requests * (requests + 1) - 2 * requests))


def profile_row_times(target: Transformer, max_batch: int, max_rows: int, pad: bool = False,
                      catch_up: bool = False) -> RowTimeTable:
    """The target's forward time at each `row_grid` point: min(rows, max_batch) requests sharing the rows (with
    `pad`, also `profile_pad_time`; with `catch_up`, a draft's table, also max_batch requests of which one catches
    up `CATCH_UP_ROWS` tokens, at max_batch + CATCH_UP_ROWS rows: what `StepCost.catch_up_s` reads).

    A forward over fewer rows never costs more than one over more (the kernels pad rows into blocks), so a point
    timed above a later one by more than noise was slowed by something else on the machine: it is timed again (a
    profile taken while another benchmark ran once priced a 1-row target pass at 1.6 s and a 16-row one at 0.42 s, and
    every goodput choice of that cache's later runs followed it), and the table kept is non-decreasing.

    Each point is timed at exactly its rows, spread as evenly as they go over the requests: rounded up to a multiple
    of the requests, the point just past a block boundary was lost and the table interpolated across the step up
    (the Qwen 1.5B target at batch 4: 33 rows timed as 36, so 33 was priced 252 ms where it takes 372, 32 taking 214).
    """
    def time_rows(rows: int) -> tuple[int, float]:
        requests = min(rows, max_batch)
        appends = [rows // requests + (i < rows % requests) for i in range(requests)]
        return rows, _time_ragged(target, appends)

    points = dict(time_rows(rows) for rows in row_grid(max_rows))
    if catch_up:
        points[max_batch + CATCH_UP_ROWS] = _time_ragged(target, [1 + CATCH_UP_ROWS] + [1] * (max_batch - 1))
    for _ in range(RETIMES):
        slowed = [rows for rows, seconds in points.items()
                  if seconds > SLOWED * min(s for r, s in points.items() if r >= rows)]
        if not slowed:
            break
        for rows in slowed:
            points[rows] = min(points[rows], time_rows(rows)[1])
    ordered = sorted(points)
    seconds = np.minimum.accumulate([points[r] for r in reversed(ordered)])[::-1]  # non-decreasing in the rows
    return RowTimeTable(tuple(ordered), tuple(float(s) for s in seconds),
                        profile_pad_time(target, max_batch) if pad else 0.0)


SLOWED = 1.25  # a point this much above a point with more rows was timed on a busy machine
RETIMES = 3  # rounds of timing such points again
CATCH_UP_ROWS = 128  # a request's catch-up the draft's table times (a chat prompt's worth of tokens)


def cached_row_times(model: Transformer, max_batch: int, max_rows: int, pad: bool = False,
                     catch_up: bool = False) -> RowTimeTable:
    """`profile_row_times`, remembered on disk for this machine and model."""
    suffix = ("-pad" if pad else "") + ("-catch-up" if catch_up else "")
    return _cached(f"row-times-{_profile_key(model, model, max_batch, max_rows)}{suffix}",
                   lambda: profile_row_times(model, max_batch, max_rows, pad, catch_up),
                   lambda data: RowTimeTable(tuple(data["rows"]), tuple(data["seconds"]), float(data["pad_s"])))


def step_cost(target: Transformer, draft: Transformer, max_batch: int, k_max: int,
              max_draft: int | None = None) -> StepCost:
    """This machine's step costs (each part cached on disk): dsd's T(B, k) and, with `max_draft` (a policy choosing
    its draft length and capacity), both models' time by rows."""
    model = cached_step_time(target, draft, max_batch, k_max)
    if max_draft is None:
        return StepCost(model)
    # The draft's table to 2B rows: a step's first pass runs each request's last draft and the target's token when
    # every draft was accepted (`goodput_plan`'s lag); extrapolated past B on the slope up to the catch-up point it had
    # priced the Qwen draft's 16 rows at 0.195 s where they took ~0.24.
    return StepCost(model, cached_row_times(target, max_batch, max_batch * (max_draft + 1), pad=True),
                    cached_row_times(draft, max_batch, 2 * max_batch, catch_up=True), catch_up=True)
