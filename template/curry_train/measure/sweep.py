"""Measured capacity sweep: advice/sweep.py's search, each fit decided by a real run on this machine.

    curry-train sweep --config tiny --measured --json            # binary search with real runs (memory jobs)

advice/sweep.py decides (the ladder's rungs, the model family, where to search); this module runs what it asks
for: `Measurer.peak(cfg)` launches `measure.memory.memory_job` on the ranks `cfg` needs (forkserver gloo ranks,
or torchrun) and returns the worst per-rank peak, None when a rank ran out of memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from curry_train.advice.sweep import DEPTHS, WIDTHS, SweepResult
from curry_train.advice.sweep import capacity_sweep as _search
from curry_train.config import Config
from curry_train.measure.memory import memory_spec

__all__ = ["Measurer", "capacity_sweep"]


class Measurer:
    """Runs `measure_memory` on the ranks a config needs (forkserver gloo ranks, or torchrun) and says whether
    its worst per-rank peak fits the usable budget."""

    def __init__(self, launcher: str = "forkserver", timeout: float = 600.0, cancel: threading.Event | None = None,
                 progress: Callable[[str], None] | None = None):
        self.launcher, self.timeout, self.cancel = launcher, timeout, cancel
        self.say = progress or (lambda msg: None)

    def peak(self, cfg: Config) -> int | None:
        """Worst per-rank peak in bytes, None when the run fails (a CUDA OOM, a crash)."""
        from curry_train.train.launch import LaunchError

        if self.cancel is not None and self.cancel.is_set():
            raise RuntimeError("capacity sweep cancelled")
        spec = memory_spec(cfg, steps=2)
        self.say(f"measuring {cfg.parallel.model_dump()} micro_batch={cfg.train.micro_batch} "
                 f"d_model={cfg.model.d_model} n_layers={cfg.model.n_layers}")
        try:
            if self.launcher == "torchrun":
                import tempfile

                from curry_train.train.launch import run_torchrun

                values = run_torchrun(spec, cfg.world_size, Path(tempfile.mkdtemp(prefix="curry_sweep_")),
                                      timeout=self.timeout, cancel=self.cancel)
            else:
                from curry_train.train.jobs import rank_job
                from curry_train.train.launch import launch_forkserver

                values = launch_forkserver(rank_job, cfg.world_size, spec, timeout=self.timeout)
        except LaunchError as e:
            if "out of memory" in str(e).lower() or "OutOfMemoryError" in str(e):
                return None
            raise
        return max(max(int(v.get("peak") or 0), int(v.get("cuda_max_allocated") or 0)) for v in values)




def capacity_sweep(config: str | Path | dict[str, Any] | Config, overrides: dict[str, Any] | None = None, *,
                   measured: bool = False, rungs: list[str] | None = None, max_micro_batch: int = 4096,
                   widths: tuple[float, ...] = WIDTHS, depths: tuple[float, ...] = DEPTHS,
                   launcher: str = "forkserver", timeout: float = 600.0, max_runs_per_rung: int = 8,
                   cancel: threading.Event | None = None, progress: Callable[[str], None] | None = None,
                   root: str | Path | None = None) -> SweepResult:
    """advice.sweep.capacity_sweep, measured with real runs when `measured` (launcher "forkserver" or "torchrun",
    each run within `timeout` s; `cancel` stops the sweep before its next run, `progress` hears each run)."""
    meas = Measurer(launcher, timeout, cancel, progress) if measured else None
    return _search(config, overrides, rungs=rungs, max_micro_batch=max_micro_batch, widths=widths, depths=depths,
                   max_runs_per_rung=max_runs_per_rung, measure=meas.peak if meas else None, root=root)
