"""Run a test's in-process 1-rank world in a fresh process.

A gloo world made and destroyed in the pytest process can leave torch's process-group registry holding names that a
later world of the same process reuses (seen under xdist: "Could not resolve the process group registered under the
name 1" from a DeviceMesh built by the next test), so tests that build a real world in-process run it here instead.

The process is forked from multiprocessing's forkserver with torch and the template preloaded
(curry_train.train.launch.PRELOAD, the launcher's own list): it starts with the registry of a process that never
made a group, as a spawned interpreter would, for a fork (~0.5 CPU-s) instead of a cold torch import (~4.5).
`fn` must be a module-level function (it is pickled by name); its return value must be picklable."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any


def _run_in(cwd: str, fn: Callable[..., Any], args: tuple) -> Any:
    os.chdir(cwd)  # the forkserver's working directory is the one it started in: take the test's, as spawn does
    return fn(*args)


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    from curry_train.train.launch import PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # only read when this process's forkserver starts (the launcher's too)
    with ctx.Pool(1) as pool:
        return pool.apply(_run_in, (os.getcwd(), fn, args))
