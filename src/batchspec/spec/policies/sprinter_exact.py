"""`sprinter-exact`: SPRINTER's blocks, every draft verified by the target (lossless).

The learned verifier decides only where a request's block ends (its first draft scored below tau, or L drafts), as
in `sprinter`; the target then checks the whole block, as sd checks its window, and the request keeps the accepted
prefix plus the target's correction or bonus token. The verifier thus chooses each request's draft length per step
(learned adaptive draft length, the idea of SpecDec++), and verification stays exact.

Why it costs SPRINTER nothing here: the target must run on every token of a block anyway, to write its KV cache, so
its logits at every position come with the same forward pass (one target call per block either way). What changes is
what happens after a draft the target would not have chosen: `sprinter` keeps it (and pays in fidelity), this policy
cuts the block there (and pays in tokens per call).
"""

from __future__ import annotations

from torch import Tensor

from batchspec.spec.policies.sprinter import SprinterPolicy


class SprinterExactPolicy(SprinterPolicy):
    name = "sprinter-exact"
    lossless = True
    description = "SPRINTER's verifier chooses each block's length, the target checks every draft (lossless)"

    def trusted(self, windows: Tensor) -> Tensor | None:
        return None  # the target checks every draft of the block
