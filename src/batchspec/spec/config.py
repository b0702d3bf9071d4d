"""Speculation settings of a run, as the CLI, bench and server take them; each policy reads and checks its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    """The knobs of every policy in one flat record (what `--policy ... -k ... --tau ...` sets, what a bench sweep
    varies). A policy object (`spec.policies.make_policy`) reads the fields that are its own and validates them
    (`Policy.validate`); the others are ignored."""

    policy: str = "ar"
    k: int = 4
    extra: int = 2
    capacity: int | str | None = None  # None: k * B; a number: fixed C; "auto": chosen per step (tetris)
    turn_on_batch_size: int = 1  # Tetris acts as sd below this many active requests
    k_max: int = 8  # dsd's largest window
    # tetris --capacity auto: the most drafts a request gets in a step, K' (None: twice dsd's k_max; k + extra when
    # larger). Twice: at batch 1 a cap of 8 bound nearly every window (the Qwen pair on a Xeon, bfloat16 target:
    # 0.93-0.96x dsd with 8, 1.10-1.11x with 16; dsd's own k_max 16 gained nothing). At batch 8 it had lost (0.88-0.95x
    # dsd, windows of 11-16 for all eight requests) while an engine's later runs started from the end of its earlier
    # ones (`StepCost.refresh`, `Goodput._own_rows`); since, 16 and 8 measure alike there and on the SmolLM2 pair.
    max_draft: int | None = None
    measure_oracle: bool = False  # untimed extra target pass over all K' drafts: true a, oracle_fraction
    verifier: str | None = None  # SPRINTER verifier directory: needed by `sprinter` and by tetris_scores="verifier"
    tau: float | None = None  # sprinter: accept a draft without the target iff verifier prob >= tau (None: its own)
    block_cap: int = 20  # sprinter: L, the most tokens a request drafts before the target is called
    tetris_scores: str = "q"  # tetris ranks by cumulative draft probability ("q"), by survival on acceptance calibrated
    # from earlier steps ("calibrated"; what --capacity auto ranks by) or by the SPRINTER verifier ("verifier")
    prune_drafts: bool = True  # tetris: a request stops drafting once none of its later drafts could be verified

    @property
    def draft_cap(self) -> int:
        """tetris --capacity auto's cap on K' as set: `max_draft`, or twice k_max by default."""
        return 2 * self.k_max if self.max_draft is None else self.max_draft

    def capacity_for(self, batch_size: int) -> int:
        """C = k * B (the verification cost of sd with window k: the Tetris paper's default), or the fixed C.

        With "auto" Tetris chooses C per step; k * B is then only the reference budget of sd."""
        return self.k * batch_size if self.capacity is None or self.capacity == "auto" else self.capacity
