"""The white-box's step horizon: how many optimizer steps it compares by default, and what of the lr schedule
(train/optim.py lr_at) those steps reach. Torch-free: the CLI and the MCP server state it without importing torch.
"""

from __future__ import annotations

from curry_train.config import Config

MAX_DEFAULT_STEPS = 8  # a default horizon, not a limit: --steps goes further (see default_steps)


def default_steps(cfg: Config) -> int:
    """Steps compared when none are given: 2 (the second exercises the optimizer state), or up to and including
    the first step after the warm-up (step index train.warmup_steps: the schedule's boundary, where a schedule bug
    starts), at most MAX_DEFAULT_STEPS. Each step is held to the step-0 bounds (re-sync, validation/compare.py),
    so a longer horizon costs time only: about one training step per rank plus a gather and a reference step.
    A longer warm-up is not covered by default (it would make the check as long as a training run);
    `horizon_note` says so in the verdict and names the --steps that covers it."""
    return max(2, min(cfg.train.warmup_steps + 1, MAX_DEFAULT_STEPS))


def horizon_note(cfg: Config, steps: int) -> str:
    """What of the lr schedule (train/optim.py lr_at) the compared steps 0..steps-1 reach."""
    w, t = cfg.train.warmup_steps, cfg.train
    if w == 0:
        covered = "no warm-up"
    elif steps > w:
        covered = f"the warm-up boundary (step {w}, the first at the full lr) is compared"
    else:
        covered = f"the warm-up ends at step {w}, beyond the {steps} step(s) compared: pass --steps {w + 1} to cover it"
    if t.lr_schedule == "cosine":
        covered += f"; cosine decay to lr/10 at step {t.steps} " + ("compared" if steps > t.steps else "not reached")
    return covered
