"""Faults: a rank that raises, hangs in a collective, dies by a signal or runs out of memory, and a server killed
mid-bench. Each time: a clear error within the deadline plus a few seconds, no process left, a consistent ledger,
and a next call that works.

    .venv/bin/pytest tests/reliability/test_faults.py -q -s      # -s prints time-to-error and process counts

The rank faults go through the path every long tool takes (server._long -> worker -> torchrun -> 2 gloo ranks ->
ledger), with the worker's "selftest" task (jobs.selftest_job, one all-reduce then the injected fault) instead of
a model. Processes are counted from /proc: everything that ever appeared below this test process (or below the
stdio server) while the call ran must be gone when it returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from curry_train.measure.bench import DeviceLock
from curry_train.store.runs import Ledger
from curry_train_mcp import server as server_mod
from mcp import Client
from mcp.server.mcpserver.exceptions import ToolError
from rel_support import RawServer, text_of, tree, wait_gone

pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.torchrun]  # torchrun's tree, killed

FIGURES: list[str] = []


@pytest.fixture(autouse=True)
def _root(project, monkeypatch):
    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))


@pytest.fixture(scope="module", autouse=True)
def _figures():
    yield
    if FIGURES:
        print("\nfault figures:\n  " + "\n  ".join(FIGURES))


async def _watched(fn, *, root_pid: int) -> tuple[object, float, dict[int, int]]:
    """Run fn() while recording every process that appears below root_pid; (outcome, seconds, processes seen)."""
    before = set(tree(root_pid))
    seen: dict[int, int] = {}
    outcome: dict[str, object] = {}

    async def watch() -> None:
        while True:
            seen.update({p: s for p, s in tree(root_pid).items() if p not in before})
            await anyio.sleep(0.1)

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            outcome["value"] = await fn()
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcome["value"] = e
        tg.cancel_scope.cancel()
    return outcome["value"], time.monotonic() - t0, seen


def _ledger_is_consistent(project: Path) -> list:
    """Every row parses, none is left 'running', each has its folder and resolved config."""
    rows = Ledger(project).list(1000)
    for r in rows:
        assert r.status in ("ok", "failed", "cancelled"), (r.run_id, r.status)
        assert (project / "runs" / r.run_id / "config.yaml").is_file(), r.run_id
        if r.status != "ok":
            assert r.error, r.run_id
    return rows


FAULTS = [  # fault, rank, deadline_s, what the error must say
    ("raise", 1, 120.0, "rank 1: RuntimeError: selftest: injected failure"),
    ("exit", 0, 120.0, "rank 0 was killed by SIGKILL"),
    ("oom", 1, 120.0, "rank 1: OutOfMemoryError"),
    ("hang", 0, 15.0, "timed out after 15s"),
    ("stubborn", 1, 15.0, "timed out after 15s"),  # ignores SIGTERM: only a SIGKILL of the rank itself stops it
]


@pytest.mark.anyio
@pytest.mark.parametrize("fault,rank,deadline,expect", FAULTS, ids=[f[0] for f in FAULTS])
async def test_a_failing_rank_gives_a_clear_error_in_time_and_leaves_no_process(project, fault, rank, deadline,
                                                                               expect):
    args = {"config": "tiny", "nproc": 2, "fault": fault, "fault_rank": rank}
    err, took, seen = await _watched(
        lambda: server_mod._long("selftest", args, None, deadline_s=deadline, label="selftest"), root_pid=os.getpid())
    assert isinstance(err, ToolError), f"expected a ToolError, got {err!r}"
    text = str(err)
    assert expect in text and any(h in text for h in ("Retry", "Read the failing rank", "recommend_next")), text[:1500]
    assert len(seen) >= 4, f"worker, torchrun and 2 ranks should have run: {seen}"  # the fault happened in a rank
    limit = deadline + 8.0 if fault in ("hang", "stubborn") else deadline
    assert took < limit, f"{fault}: error after {took:.1f}s (limit {limit:.0f}s)"
    gone, survivors = wait_gone(seen, 5.0)
    assert not survivors, f"{fault}: processes survived the call: {survivors}"
    rows = _ledger_is_consistent(project)
    assert [(r.kind, r.status) for r in rows] == [("selftest", "failed")]
    assert DeviceLock(project).try_acquire(), "the device lock outlived the failed job"
    FIGURES.append(f"{fault:6s} on rank {rank}: clear error after {took:5.1f}s (deadline {deadline:.0f}s), "
                   f"{len(seen)} processes started, {len(survivors)} left {gone:.1f}s after the error")


@pytest.mark.anyio
async def test_after_the_faults_a_clean_multirank_job_still_runs(project):
    """The next call works: nothing a failed job left (lock, ledger, ports) stops a clean one."""
    out, took, seen = await _watched(
        lambda: server_mod._long("selftest", {"config": "tiny", "nproc": 2}, None, deadline_s=120.0,
                                 label="selftest"), root_pid=os.getpid())
    assert isinstance(out, dict), out
    assert out["status"] == "ok" and [r["sum"] for r in out["metrics"]["ranks"]] == [2.0, 2.0]  # both ranks answered
    assert not wait_gone(seen, 5.0)[1]
    FIGURES.append(f"clean 2-rank job after the faults: ok in {took:.1f}s")


@pytest.mark.anyio
async def test_a_bench_over_its_memory_budget_reports_oom_instead_of_failing(project):
    """Simulated OOM on CPU: hardware.gpu_memory_gib far below the measured peak -> oom=True with the numbers."""
    async def call():
        async with Client(server_mod.mcp, raise_exceptions=True) as c:
            return await c.call_tool("bench", {"config": "tiny", "steps": 1, "warmup": 0,
                                               "overrides": {"hardware.gpu_memory_gib": 1e-6}, "timeout_s": 120})
    r, took, seen = await _watched(call, root_pid=os.getpid())
    assert not r.is_error, text_of(r)
    out = r.structured_content
    assert out["oom"] and "budget" in out["oom_detail"] and out["peak_memory_bytes"] > out["memory_budget_bytes"]
    assert not wait_gone(seen, 5.0)[1]
    assert Ledger(project).get(out["run_id"]).metrics["oom"] is True
    FIGURES.append(f"bench over budget (simulated OOM): oom=True after {took:.1f}s, {len(seen)} processes, 0 left")


def test_killing_the_server_mid_bench_takes_every_process_down_and_the_next_server_works(project, tmp_path):
    server = RawServer(project, tmp_path / "server.log")
    try:
        server.send("tools/call", {"name": "bench", "arguments": {"config": "tiny", "steps": 1000, "warmup": 0,
                                                                  "overrides": {"parallel.dp": 2}},
                                   "_meta": {"progressToken": "p"}})
        seen: dict[int, int] = {}
        deadline = time.monotonic() + 120
        while not any(m.startswith("bench: step") for m in server.progress):  # the ranks are training
            assert time.monotonic() < deadline, f"the bench never started: {server.progress[-3:]}"
            seen.update(tree(server.proc.pid))
            server.read()
        seen.update(tree(server.proc.pid))
        assert len(seen) >= 4, seen  # worker, torchrun, 2 ranks
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        gone, survivors = wait_gone(seen, 20.0)
        assert not survivors, f"processes outlived the killed server: {survivors}"
    finally:
        server.close()
    deadline = time.monotonic() + 10
    while Ledger(project).list(1)[0].status == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    rows = _ledger_is_consistent(project)
    assert [(r.kind, r.status) for r in rows] == [("bench", "cancelled")]
    assert DeviceLock(project).try_acquire()
    FIGURES.append(f"server SIGKILLed mid-bench: {len(seen)} processes below it, all gone {gone:.1f}s later; "
                   f"ledger: {rows[0].status}")
    again = RawServer(project, tmp_path / "server2.log")
    try:
        r = again.call("estimate_memory", {"config": "tiny"})
        assert not r.get("isError") and r["structuredContent"]["memory"]["total"] > 0
        index = json.loads(again.request("resources/read", {"uri": "run://index"})["result"]["contents"][0]["text"])
        assert [(x["run_id"], x["status"]) for x in index] == [(rows[0].run_id, "cancelled")]
    finally:
        again.close()
    FIGURES.append(f"a new server answered {time.monotonic() - t0:.1f}s after the kill")


def test_a_worker_whose_server_is_already_gone_cancels_without_launching(project):
    """The race the watchdog used to lose: the server dies before the worker starts, so getppid() is already init."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    request = {"task": "selftest", "args": {"config": "tiny", "nproc": 2, "timeout": 60}, "root": str(project),
               "server_pid": dead.pid}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "curry_train_mcp.worker", json.dumps(request)], capture_output=True,
                          text=True, timeout=120, check=False)
    took = time.monotonic() - t0
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines and lines[-1]["error"]["kind"] == "cancelled", proc.stdout + proc.stderr[-2000:]
    assert not Ledger(project).list(10), "a run started for a server that is gone"
    FIGURES.append(f"worker started after its server died: cancelled in {took:.1f}s, nothing launched")

