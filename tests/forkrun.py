"""torchrun swapped for the forkserver, for tests whose subject is what runs inside the ranks, not torchrun: every
multirank test not marked `torchrun` (tests/conftest.py, `_ranks_forked_unless_torchrun`).

A torchrun launch costs three or more cold torch imports (the agent and every rank: 5-10 CPU-seconds on the 2-core
machine); the forkserver forks ranks from a process that imported torch once (docs/CPU-DISTRIBUTED.md, "White-box
checks"). `ForkJob` stands in for `launch.start_torchrun` (and so for `run_torchrun`, which starts then waits):
the same spec and rank entry (train/jobs.py rank_job, which train/rank_main.py calls under torchrun), the same run
folder files (spec.json, the ranks' own outputs), per-rank values through JSON as rank_main writes them, and the
same LaunchError on a failed rank. Cancellation, deadlines with tree kills, SIGTERM-ignoring ranks, OOM markers
and multi-node agents are torchrun's contract and stay on the real thing (tests/reliability/test_faults.py,
tests/test_cli.py, tests/test_multinode.py); here a deadline is the forkserver launch's own timeout.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

FORK_TIMEOUT_S = 900.0  # the launch's own deadline; a caller's shorter one raises LaunchError in wait()


class ForkJob:
    """launch.Job's interface (poll, wait, results, kill, tail, run_dir, log_path, nproc) over one forkserver
    launch running in a thread, so a caller that polls (bench's progress forwarding) sees it running."""

    def __init__(self, spec: dict[str, Any], nproc: int, run_dir: Path, *, env: dict[str, str] | None = None):
        from curry_train.train.launch import comm_env

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.nproc, self.log_path = run_dir, nproc, run_dir / "ranks.log"
        self.log_path.touch()
        full = {**spec, "out_dir": str(run_dir)}
        (run_dir / "spec.json").write_text(json.dumps(full), encoding="utf-8")  # as start_torchrun writes it
        self._out: dict[str, Any] = {}
        env = {**comm_env(spec, run_dir), **(env or {})}
        self._thread = threading.Thread(target=self._run, args=(full, env), daemon=True)
        self._thread.start()

    def _run(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        from curry_train.train import launch
        from curry_train.train.jobs import rank_job

        try:
            values = launch.launch_forkserver(rank_job, self.nproc, spec, timeout=FORK_TIMEOUT_S, env=env)
            self._out["values"] = json.loads(json.dumps(values))  # rank_main's rank<R>.json round trip
        except Exception as e:  # re-raised in the caller's thread by results()
            self._out["error"] = e

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else (1 if "error" in self._out else 0)

    def wait(self, timeout: float, cancel: threading.Event | None = None) -> list[Any]:
        from curry_train.train.launch import LaunchError

        self._thread.join(timeout)
        if self._thread.is_alive():
            raise LaunchError(f"timed out after {timeout:.0f}s (forkserver stand-in: its ranks run on until "
                              f"{FORK_TIMEOUT_S:.0f}s)")
        return self.results()

    def results(self) -> list[Any]:
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["values"]

    def kill(self) -> None:
        """Nothing to kill from here: the forkserver launch kills its own ranks at its deadline."""

    def tail(self, n: int = 4000) -> str:
        return ""
