"""When a policy that chose not to draft drafts again, to see whether drafting pays.

A step that drafts nothing verifies nothing, so it teaches a policy's acceptance estimate nothing: a policy whose
estimate says "do not draft" would keep that estimate, and its choice, for the rest of the run however well the
draft agrees. `Exploration` counts the steps in a row planned to draft nothing and turns one of them into an
exploration (one draft per request, verified) after a wait. While explorations keep finding that drafting does not
pay, the wait doubles up to `most`, so a pair where speculation never pays spends little on them; once drafting has
paid for `after` steps in a row, or where one draft per request is predicted near paying (`near`), the wait is back
to `after`. dsd explores at a fixed wait (`most == after`), goodput Tetris with the doubling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Exploration:
    after: int  # the shortest wait: the after-th step in a row planned to draft nothing explores
    most: int  # the longest wait (== after: the wait never grows)
    wait: int = field(init=False)
    plain: int = field(default=0, init=False)  # steps in a row planned to draft nothing
    drafting: int = field(default=0, init=False)  # steps in a row planned to draft

    def __post_init__(self) -> None:
        if not 1 <= self.after <= self.most:
            raise ValueError(f"an exploration's wait needs 1 <= after <= most (got {self.after}, {self.most})")
        self.wait = self.after

    def drafted(self) -> None:
        """A step planned to draft. The wait is back to its shortest once drafting has paid for `after` steps in a
        row, not after an exploration whose one accepted draft buys a step or two of drafting before it stops again."""
        self.plain, self.drafting = 0, self.drafting + 1
        if self.drafting >= self.after:
            self.wait = self.after

    def explores(self, near: Callable[[], bool] | None = None) -> bool:
        """A step planned to draft nothing: whether it explores instead. `near()` (asked only when it does): whether
        one draft per request is predicted close to paying, where exploring costs little and the wait stays short."""
        self.plain, self.drafting = self.plain + 1, 0
        if self.plain < self.wait:
            return False
        self.plain = 0
        self.wait = self.after if near is not None and near() else min(2 * self.wait, self.most)
        return True
