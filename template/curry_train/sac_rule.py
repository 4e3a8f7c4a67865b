"""Which of a block's matmuls selective recompute saves: the one home of this rule.

The template's SAC policy (parallel/recompute.py) and the estimator's selective-recompute terms (estimator/acts.py
bytes, estimator/layout.py FLOPs) both ask `saved_matmuls`, so what runs and what is priced cannot drift. Pure
arithmetic: no torch, importable by the torch-free estimator.

The rule (docs/ARCHITECTURE.md#recompute), op-level SAC as torchtitan runs it: counting a block's matmuls
(aten.mm / addmm / _grouped_mm) in forward order, the 1st, 3rd, 5th, ... outputs are saved and the others are
recomputed in backward: half the projections' bytes kept for half their FLOPs replayed. The count starts over in
every checkpointed block call.
"""

from __future__ import annotations

SAVE_EVERY = 2  # a block's k-th matmul (k = 0, 1, ... in forward order) is saved when k % SAVE_EVERY == 0


def is_saved_matmul(k: int) -> bool:
    """Whether the selective policy keeps the output of a block's k-th matmul (0-based, forward order)."""
    return k % SAVE_EVERY == 0


def saved_matmuls(count: int) -> list[bool]:
    """For a block running `count` matmuls: which outputs the selective policy keeps, in forward order."""
    return [is_saved_matmul(k) for k in range(count)]
