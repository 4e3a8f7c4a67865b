"""Run a long tool call as a killable subprocess: progress, deadline, cancellation, nothing left behind.

`run_worker(task, args, ctx=..., deadline_s=...)` starts `python -m curry_train_mcp.worker` in a new session
(stdin closed, stdout a private pipe, stderr the server's log), forwards its progress lines as MCP progress
notifications plus a heartbeat, and returns its result. On cancellation (the client gave up or cancelled) or at
the deadline it SIGTERMs the worker, which kills its torchrun process group and records the run as cancelled;
after a grace period it SIGKILLs the worker's group and every process that was below the worker (torchrun runs
its ranks in a session of its own, so killing one group is not enough). The device lock lives in the worker
(`curry_train.measure.bench.DeviceLock`, an flock the kernel drops if the holder dies), so long jobs serialise across
every server and CLI on the machine while cheap tools run concurrently in the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
from anyio.streams.text import TextReceiveStream
from curry_train.train.launch import alive, descendants  # the /proc process tree (shared with Job.kill)

logger = logging.getLogger(__name__)

WORKER = "curry_train_mcp.worker"  # the module run_worker starts with `python -m` (worker.py)
TERM_GRACE_S = 10.0  # the worker needs ~3 s to SIGTERM-then-SIGKILL torchrun's group; leave room
HEARTBEAT_S = 5.0


class WorkerError(Exception):
    """The job ran and failed, or was refused: `kind` is invalid | failed | cancelled | busy | bug | timeout."""

    def __init__(self, kind: str, message: str, last_progress: str = ""):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.last_progress = last_progress  # the job's last progress line (e.g. its last completed step)


# ------------------------------------------------------------------------------------------ process tree


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_tree(procs: dict[int, int]) -> None:
    for pid in alive(procs):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ the runner


async def _terminate(proc: anyio.abc.Process) -> None:
    """SIGTERM the worker (it cleans up its ranks), then SIGKILL whatever is left of the whole tree."""
    tree = descendants(proc.pid)
    _signal_group(proc.pid, signal.SIGTERM)
    with anyio.move_on_after(TERM_GRACE_S):
        await proc.wait()
    tree.update(descendants(proc.pid))
    _signal_group(proc.pid, signal.SIGKILL)
    _kill_tree(tree)
    await proc.wait()
    deadline = time.monotonic() + 5.0
    while alive(tree) and time.monotonic() < deadline:  # SIGKILL is asynchronous; wait until they are gone
        await anyio.sleep(0.05)


async def run_worker(task: str, args: dict[str, Any], *, ctx: Any = None, deadline_s: float, label: str,
                     root: str | None = None) -> dict[str, Any]:
    """Run one worker task; returns its result dict, raises WorkerError, TimeoutError on the deadline."""
    request = json.dumps({"task": task, "args": {**args, "timeout": deadline_s}, "root": root,
                          "server_pid": os.getpid()})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await anyio.open_process([sys.executable, "-m", WORKER, request],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None,
                                    start_new_session=True, env=env)
    t0 = time.monotonic()
    state = {"n": 0, "last": "starting"}
    outcome: dict[str, Any] = {}

    async def report(message: str) -> None:
        state["n"] += 1
        if ctx is not None:
            await ctx.report_progress(state["n"], None, f"{label}: {message} [{time.monotonic() - t0:.0f}s]")

    async def heartbeat() -> None:
        while True:
            await anyio.sleep(HEARTBEAT_S)
            await report(f"{state['last']} (still running)")

    async def read() -> None:
        assert proc.stdout is not None
        buf = ""
        async for chunk in TextReceiveStream(proc.stdout):
            buf += chunk
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    logger.warning("worker printed a non-protocol line: %r", line[:200])
                    continue
                if "progress" in msg:
                    state["last"] = str(msg["progress"])
                    await report(state["last"])
                else:
                    outcome.update(msg)

    try:
        with anyio.fail_after(deadline_s + TERM_GRACE_S):  # the worker enforces deadline_s on its ranks itself
            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat)
                await report("started")
                await read()
                await proc.wait()
                tg.cancel_scope.cancel()
    except BaseException:  # deadline, or the request was cancelled: take the whole tree down, then re-raise
        with anyio.CancelScope(shield=True):
            await _terminate(proc)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                await _terminate(proc)
    if "result" in outcome:
        return outcome["result"]
    err = outcome.get("error") or {"kind": "bug", "message": f"worker exited with code {proc.returncode} and no "
                                                              "result; see the server log"}
    raise WorkerError(err["kind"], err["message"], "" if state["last"] == "starting" else state["last"])
