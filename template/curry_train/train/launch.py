"""Launchers: torchrun for the tools (the real distributed engine), a forkserver for fast tests.

    python -c "from curry_train.train.launch import run_torchrun; ..."      # see run_job() for the whole path

`start_torchrun` starts `python -m torch.distributed.run ... -m curry_train.train.rank_main <spec.json>` in its own
session (process group), stdout/stderr captured to a log file, never inherited - so an MCP server's stdio stays
pure. `Job.wait` enforces a deadline and `Job.kill` takes down the whole group (torchrun and every rank).
Multi-node is the same command with --nnodes/--rdzv-endpoint; it is out of scope for the local tools.

`launch_forkserver` runs a module-level `fn(rank, world, *args)` on gloo ranks forked from a server that has
torch preloaded (~0.3 s a launch instead of ~5 s): tests batch many checks into one launch with it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any


class LaunchError(RuntimeError):
    """A distributed job failed, timed out or was cancelled; the message carries the failing rank's error."""


def free_port() -> int:
    """A port free now. Whoever binds it must do so at once: any socket on the machine may take it meanwhile (for
    torchrun use `local_torchrun`, whose agent binds its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_torchrun(nproc: int) -> list[str]:
    """The torchrun command for `nproc` ranks on this machine alone, up to the module it runs: the agent's
    rendezvous store binds a port the OS picks (c10d at port 0) and the ranks connect to it. A port chosen here and
    passed as --master-port is bound by the agent only after its cold start, seconds later, and another job's
    socket can take it meanwhile (EADDRINUSE in the agent: docs/CPU-DISTRIBUTED.md, quirk 10)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4().hex}", f"--nproc-per-node={nproc}",
            "--max-restarts=0"]


# ------------------------------------------------------------------------------------------ process tree


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) from /proc, or None if the process is gone (Linux only)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()  # the name may contain spaces and parentheses
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every process below `pid`: {pid: start time}, for a later kill that cannot hit a recycled pid."""
    if not Path("/proc").is_dir():
        return {}
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
                starts[int(entry)] = st[1]
    out: dict[int, int] = {}
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out[child] = starts[child]
                stack.append(child)
    return out


def alive(procs: dict[int, int]) -> list[int]:
    """Which of these (pid, start time) still exist and are not zombies."""
    out = []
    for pid, start in procs.items():
        st = _proc_stat(pid)
        if st is None or st[1] != start:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


@dataclass
class Job:
    """A running torchrun job: its process (group leader), log file and results folder."""

    proc: subprocess.Popen
    run_dir: Path
    log_path: Path
    nproc: int

    def kill(self) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after 3 s, then SIGKILL every rank.

        torchrun starts each rank in a session of its own, so its group is torchrun alone: the ranks stop only if
        torchrun stops them. A rank that ignores SIGTERM (training code whose preemption handler checkpoints and
        never returns) made torchrun wait 30 s, we SIGKILLed torchrun after 3, and the rank lived on, orphaned
        (tests/reliability/test_faults.py, fault "stubborn"). So the ranks are listed from /proc first and killed
        by pid (with their start time, so a recycled pid is never hit).
        """
        tree = descendants(self.proc.pid)
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                tree.update(descendants(self.proc.pid))  # before the SIGKILL re-parents them
                continue
            # the leader is gone; make sure no rank outlived it
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        for pid in alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while alive(tree) and time.monotonic() < deadline:  # SIGKILL is asynchronous; return once they are gone
            time.sleep(0.02)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float, cancel: threading.Event | None = None) -> list[dict[str, Any]]:
        """Wait until the job ends, the deadline passes or `cancel` is set; returns each rank's result dict."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if cancel is not None and cancel.is_set():
                self.kill()
                raise LaunchError("cancelled; every rank was killed")
            if time.monotonic() > deadline:
                self.kill()
                raise LaunchError(f"timed out after {timeout:.0f}s; every rank was killed. Log tail:\n{self.tail()}")
            time.sleep(0.05)
        return self.results()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]
        except OSError:
            return ""

    def results(self) -> list[dict[str, Any]]:
        by_rank = {}
        for r in range(self.nproc):
            path = self.run_dir / f"rank{r}.json"
            if path.exists():
                by_rank[r] = json.loads(path.read_text(encoding="utf-8"))
        failed = [(r, res) for r, res in by_rank.items() if not res.get("ok")]
        if failed:
            r, res = failed[0]
            raise LaunchError(f"rank {r}: {res['error']}\n{res.get('traceback', '')}")
        missing = [r for r in range(self.nproc) if r not in by_rank]
        if missing:
            raise LaunchError(f"ranks {missing} wrote no result (exit code {self.proc.returncode}){_killed_by(self)}. "
                              f"Log tail:\n{self.tail()}")
        return [by_rank[r]["value"] for r in range(self.nproc)]


# torchrun's failure summary: "Root Cause ... rank : 0 (local_rank: 0) / exitcode : -9 (pid: N) (SIGKILL)"
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*-?\d+[^\n]*?\((SIG[A-Z]+)\)", re.DOTALL)


def _killed_by(job: Job) -> str:
    """'; rank R was killed by SIGX' when a rank died of a signal (it had no chance to report an error)."""
    m = _ROOT_CAUSE.search(job.tail(20_000))
    if m is None:
        return ""
    hint = " (a SIGKILL nobody sent is usually the kernel's out-of-memory killer: check `dmesg`)" \
        if m[2] == "SIGKILL" else ""
    return f"; rank {m[1]} was killed by {m[2]}{hint}"


def start_torchrun(spec: dict[str, Any], nproc: int, run_dir: Path, *, env: dict[str, str] | None = None) -> Job:
    """Start torchrun for a job spec (see rank_main) with `nproc` local ranks, in a new session."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("rank*.json"):
        stale.unlink()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out_dir": str(run_dir)}), encoding="utf-8")
    log_path = run_dir / "ranks.log"
    cmd = [*local_torchrun(nproc), "-m", "curry_train.train.rank_main", str(spec_path)]
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **comm_env(spec, run_dir),
                 **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True)
    return Job(proc=proc, run_dir=run_dir, log_path=log_path, nproc=nproc)


def comm_env(spec: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """torch's NCCL knobs for the ranks of a job whose config runs on CUDA (train/comm_init.py); {} on CPU or for
    a job without a config (the launcher self-test)."""
    if spec.get("config") is None:
        return {}
    from curry_train.config import from_dict
    from curry_train.mesh import device_type
    from curry_train.train.comm_init import rank_env

    cfg = from_dict(spec["config"], validate=False)
    return rank_env(cfg, device_type(cfg), run_dir)


def run_torchrun(spec: dict[str, Any], nproc: int, run_dir: Path, *, timeout: float = 600.0,
                 cancel: threading.Event | None = None) -> list[dict[str, Any]]:
    job = start_torchrun(spec, nproc, run_dir)
    try:
        return job.wait(timeout, cancel)
    finally:
        if job.poll() is None:
            job.kill()


# ---------------------------------------------------------------- forkserver launcher (tests, benchmarks)

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "curry_train.train.loop", "curry_train.train.jobs"]
_preloaded = False
_TEARDOWN_GRACE_S = 10.0  # a rank that has reported and is still in destroy_process_group after this is killed


def _fork_worker(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str,
                 env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    # The forkserver's environment is the one it started with: pass variables explicitly (quirk 8).
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.set_debug_level_from_env()
    faulthandler.enable(all_threads=True)  # a native crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    torch.set_num_threads(1)  # mp does not set OMP_NUM_THREADS=1 the way torchrun does (quirk 5)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = {"ok": True, "value": fn(rank, world, *args)}
    except Exception as e:  # top level of a worker: report, never hang the peers silently
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    path = os.path.join(outdir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:  # whole or absent: the launcher may kill this rank at any moment
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    if not result["ok"]:
        os._exit(1)  # peers may be blocked in a collective: exit now so the launcher kills them at once
    from curry_train.train.comm_init import end_rank

    end_rank()  # every peer has reported, then the cached groups, DDP's cycles (quirk 1) and the world


def launch_forkserver(fn: Callable, world: int, *args: Any, timeout: float = 180.0,
                      env: dict[str, str] | None = None) -> list[Any]:
    """Run module-level `fn(rank, world, *args)` on `world` gloo ranks; returns the per-rank values."""
    import torch.multiprocessing as mp

    global _preloaded
    if not _preloaded:
        mp.set_forkserver_preload(PRELOAD + [fn.__module__])
        _preloaded = True
    outdir = tempfile.mkdtemp(prefix="curry_ranks_")
    try:
        ctx = mp.start_processes(_fork_worker, args=(world, free_port(), fn, args, outdir, env or {}),
                                 nprocs=world, join=False, start_method="forkserver")
        try:
            died = _await_ranks(ctx.processes, outdir, time.monotonic() + timeout,
                                f"{fn.__name__} exceeded {timeout}s on {world} ranks")
        finally:
            for p in ctx.processes:  # only our own children, by PID
                if p.is_alive():
                    p.kill()
                p.join()
        results = {r: _result(outdir, r) for r in range(world) if os.path.exists(_result_path(outdir, r))}
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    for r, res in sorted(results.items()):
        if not res["ok"]:
            raise LaunchError(f"rank {r}: {res['error']}\n{res['traceback']}")
    if len(results) < world:
        raise LaunchError(died or f"ranks {sorted(set(range(world)) - set(results))} wrote no result")
    return [results[r]["value"] for r in range(world)]


def _result_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.pkl")


def _result(outdir: str, rank: int) -> dict[str, Any]:
    with open(_result_path(outdir, rank), "rb") as f:
        return pickle.load(f)


def _await_ranks(procs: list[Any], outdir: str, deadline: float, timed_out: str) -> str:
    """Wait until every rank has written its result or one has failed -> why the job ended early ("" if not).

    The ranks are watched here rather than by torch's ProcessContext.join, which terminates every peer as soon as
    one process exits non-zero: a rank that dies in teardown *after* writing its result (gloo / DDP teardown
    aborts, docs/CPU-DISTRIBUTED.md quirk 1) would then kill a slower peer - rank 0, which merges the white-box's
    gathered tensors - before it writes, and fail a job that computed everything. A rank that exits non-zero
    without a result (a native crash) or with an error result fails the job at once: its peers may be blocked
    in a collective. Once every rank has reported, stragglers get a short grace to finish their teardown."""
    from multiprocessing.connection import wait

    while True:
        codes = [p.exitcode for p in procs]  # before the results: a rank writes its result before it exits
        reported = {r for r in range(len(procs)) if os.path.exists(_result_path(outdir, r))}
        for r, code in enumerate(codes):
            if code in (None, 0):
                continue
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if r not in reported:
                return f"a rank died: rank {r} ended with {how} before writing its result"
            if not _result(outdir, r)["ok"]:
                return ""  # its error is the job's error
        running = [p.sentinel for p, code in zip(procs, codes, strict=True) if code is None]
        if not running or len(reported) == len(procs):
            grace = time.monotonic() + _TEARDOWN_GRACE_S
            while running and time.monotonic() < grace:  # wait() returns when any one of them ends
                wait(running, timeout=grace - time.monotonic())
                running = [p.sentinel for p in procs if p.exitcode is None]
            return ""
        if time.monotonic() > deadline:
            raise LaunchError(timed_out)
        wait(running, timeout=0.2)
