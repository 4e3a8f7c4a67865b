"""The bench's clock: a training step timed to the end of its device work.

    python -c "from curry_train.config import Config; from curry_train.train.loop import setup; \
from curry_train.measure.steptime import timed_step; par = setup(Config()); print(timed_step(par, 0).step_time_s)"

`train.loop.train_step` never waits for the device (docs/ARCHITECTURE.md#training-step): on CUDA the host returns
from a step while its kernels still run, so the step's own host time is not its duration. The bench (and
benchmarks/gpu.py) time steps here, the one place a torch.cuda.synchronize meets the loop.
"""

from __future__ import annotations

import time
from typing import Any


def timed_step(par: Any, step: int) -> Any:
    """`train_step(par, step, read=False)`, its step_time_s (and tokens/s) set to the wall time until the device
    finished it. The previous timed step ended the same way, so the clock starts on an idle device."""
    import torch

    from curry_train.train.loop import train_step

    t0 = time.perf_counter()
    r = train_step(par, step, read=False)
    if par.device.type == "cuda":
        torch.cuda.synchronize(par.device)
    r.step_time_s = time.perf_counter() - t0
    r.tokens_per_s = par.cfg.train.global_batch * par.cfg.train.seq_len / r.step_time_s
    return r
