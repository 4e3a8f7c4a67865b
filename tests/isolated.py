"""Run a test's in-process 1-rank world in a fresh interpreter.

A gloo world made and destroyed in the pytest process can leave torch's process-group registry holding names that a
later world of the same process reuses (seen under xdist: "Could not resolve the process group registered under the
name 1" from a DeviceMesh built by the next test), so tests that build a real world in-process run it here instead.
`fn` must be a module-level function (spawn pickles it by name); its return value must be picklable."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)
