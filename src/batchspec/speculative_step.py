"""The engine's speculative step: propose (draft) -> select (policy) -> verify (target) -> commit, with its counters.

`Engine.run_step` calls `run` for every step of a speculative policy. The stages themselves are in
`speculative.py` (draft and target passes), `selection.py` (dispatch to sd, `dsd.py`, `tetris.py`) and
`verification.py` (rejection sampling); this module wires them to the engine's caches, requests and `RunStats`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from batchspec import speculative
from batchspec.dsd import dsd_choose_k
from batchspec.kv_cache import KVCache
from batchspec.request import Request
from batchspec.sampling import params_tensors
from batchspec.selection import draft_length, select_windows
from batchspec.sprinter import calibrated_log_probs
from batchspec.tetris import expected_accepted, oracle_windows
from batchspec.verification import acceptance_probs, greedy_acceptance_probs, verify, verify_greedy

if TYPE_CHECKING:
    from batchspec.engine import Engine


def run(engine: Engine, target_cache: KVCache, draft_cache: KVCache, active: list[Request]) -> None:
    """Advance every active request by one speculative step: 1 + accepted tokens each, both caches rolled back."""
    spec, stats = engine.spec, engine.stats
    batch = len(active)
    slots = torch.tensor([r.slot for r in active])
    k, k_prime = window_sizes(engine, batch)
    # Never write past either cache (only near the end of the longest request can this bind).
    room = min(draft_cache.max_len - int(draft_cache.lengths[slots].max()) - 2,
               target_cache.max_len - int(target_cache.lengths[slots].max()) - 1)
    k_prime = max(0, min(k_prime, room))
    if k_prime == 0:
        engine.decode_step(target_cache, active)
        resync_draft(draft_cache, active)
        return
    params = [r.params for r in active]
    greedy_all = all(p.greedy for p in params)
    sampling = params_tensors(params)
    # Each request's randomness for this step from its own generator: K' draft draws, K' accept tests, 1 next.
    draws = None if greedy_all else torch.stack([r.uniform(2 * k_prime + 1) for r in active])  # (B, 2K'+1)

    sprinter = spec.policy == "sprinter"
    scored_tetris = spec.policy == "tetris" and spec.tetris_scores == "verifier"  # the only other verifier use
    tau = (spec.tau if spec.tau is not None else engine.verifier.threshold) if sprinter else None
    started = time.perf_counter()
    proposal = speculative.propose(engine.draft.transformer, draft_cache, slots, [r.draft_pending for r in active],
                                   k_prime, sampling, None if greedy_all else draws[:, :k_prime],
                                   verifier=engine.verifier if sprinter or scored_tetris else None, stop_below=tau)
    stats.draft_s += time.perf_counter() - started
    drafted = proposal.blocks.tolist() if sprinter else [k_prime] * batch
    stats.draft_tokens += sum(drafted)

    last = torch.tensor([r.output_ids[-1] for r in active])
    accept_probs = None
    if not sprinter and (spec.policy == "oracle" or spec.measure_oracle):
        accept_probs = measure_acceptance(engine, target_cache, slots, last, proposal, sampling, greedy_all)
        if engine.trace is not None:
            engine.trace.record(active, proposal.logprobs, accept_probs, stats)

    started = time.perf_counter()
    capacity = min(spec.capacity_for(batch), batch * k_prime)
    if sprinter:  # the verifier already chose: each block ends at its first rejected draft (or at L)
        windows = proposal.blocks
    else:
        # Tetris may rank by the verifier's learned P(accept) instead of q (calibrated: class balancing undone):
        # still draft-side only, lossless.
        scores = (calibrated_log_probs(engine.verifier, proposal.verifier_probs) if scored_tetris
                  else proposal.logprobs)
        windows = select_windows(spec.policy, draft_logprobs=scores, k=k, capacity=capacity,
                                 turn_on_batch_size=spec.turn_on_batch_size, accept_probs=accept_probs)
    stats.select_s += time.perf_counter() - started

    before = target_cache.lengths[slots].clone()  # (B,) committed tokens minus the pending one
    started = time.perf_counter()
    scored = speculative.score(engine.target.transformer, target_cache, slots, last, proposal, windows,
                               None if greedy_all else sampling)
    # SPRINTER keeps the drafts its verifier vouched for; the target tests only each block's last one.
    trusted = (windows - 1).clamp(min=0) if sprinter else None
    if greedy_all:
        accepted, next_token = verify_greedy(proposal.tokens, scored.argmax, windows, trusted)
    else:
        accepted, next_token = verify(proposal.tokens, proposal.probs, scored.probs, windows,
                                      draws[:, k_prime:2 * k_prime], next_uniforms=draws[:, -1], trusted=trusted)
    engine.count_target(time.perf_counter() - started, int(windows.sum()) + batch)

    # Commit: roll the target back to the accepted prefix, the draft to what it has of it.
    target_cache.truncate_many(slots, before + 1 + accepted)
    emitted_before = stats.emitted_tokens
    now = time.perf_counter()
    drafts, accepted_list = proposal.tokens.tolist(), accepted.tolist()
    windows_list = windows.tolist()
    for request, row, window, n, token, count in zip(active, drafts, windows_list, accepted_list,
                                                     next_token.tolist(), drafted):
        engine.commit(request, row[:n] + [token], now)
        request.target_steps += 1
        request.drafted_tokens += count
        request.verified_tokens += window
        request.accepted_tokens += n
    resync_draft(draft_cache, active)

    stats.steps += 1
    stats.request_steps += batch
    stats.verified += sum(windows_list)
    stats.accepted += sum(accepted_list)
    stats.step_emitted += stats.emitted_tokens - emitted_before
    stats.record_positions(windows_list, accepted_list)
    if engine.record_windows:
        stats.window_history.append(windows_list)
    if accept_probs is not None:
        stats.policy_expected += expected_accepted(accept_probs, windows)
        stats.oracle_expected += expected_accepted(accept_probs, oracle_windows(accept_probs, capacity))
    if spec.policy == "dsd" and sum(windows_list):
        engine.acceptance = engine.acceptance.update(sum(accepted_list) / sum(windows_list))


def window_sizes(engine: Engine, batch: int) -> tuple[int, int]:
    """(k, K') for this step: the sd window and how many tokens the draft proposes."""
    spec = engine.spec
    if spec.policy == "sprinter":
        return spec.block_cap, spec.block_cap
    k = dsd_choose_k(engine.acceptance.value, batch, spec.k_max, engine.step_time) if spec.policy == "dsd" else spec.k
    return k, draft_length(spec.policy, k, spec.extra, batch, spec.turn_on_batch_size)


def resync_draft(draft_cache: KVCache, active: list[Request]) -> None:
    """Roll the draft back to the committed prefix it holds; what it lacks becomes its pending input."""
    for request in active:
        if request.finish_reason is not None:
            continue
        keep = min(int(draft_cache.lengths[request.slot]), request.num_tokens - 1)
        draft_cache.truncate(request.slot, keep)
        request.draft_pending = request.tokens_from(keep)


def measure_acceptance(engine: Engine, cache: KVCache, slots: torch.Tensor, last: torch.Tensor,
                       proposal: speculative.Proposal, sampling, greedy_all: bool) -> torch.Tensor:
    """Untimed target pass over all K' drafts: the true acceptance a[i,j] (B, K'), then roll the cache back."""
    started = time.perf_counter()
    before = cache.lengths[slots].clone()
    full = torch.full((len(slots),), proposal.tokens.shape[1], dtype=torch.int64)
    scored = speculative.score(engine.target.transformer, cache, slots, last, proposal, full,
                               None if greedy_all else sampling)
    cache.truncate_many(slots, before)
    if greedy_all:
        probs = greedy_acceptance_probs(proposal.tokens, scored.argmax)
    else:
        probs = acceptance_probs(proposal.tokens, proposal.probs, scored.probs)
    engine.stats.measure_s += time.perf_counter() - started
    return probs
