"""Kill a writer at any point: update_config never leaves half a YAML or loses a version, the ledger never loses a
run record.

    .venv/bin/pytest tests/reliability/test_atomicity.py -q -s

A helper process imports curry_train once and forks one writer per iteration; the writer loops update_config (or
ledger start/finish) and reports each completed write on stdout; the test SIGKILLs it. Half the kills come from a
timer at a random moment (seeded, so CI replays them); the other half from inside the writer, at the k-th
filesystem step of atomic_write_text (mkstemp, fchmod, fsync, replace), k swept so that every step of the history
copy and of the new file is hit. After every kill: the config parses and validates, holds the last reported
version or the one in flight, every version ever reported is still there (current or history), and every ledger
run reported started or finished is there with its folder; the database passes its integrity check.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from curry_train.config import load_config
from curry_train.store.configs import history, update_config
from curry_train.store.runs import Ledger

pytestmark = pytest.mark.slow

HELPER = r"""
import json, os, signal, sys, tempfile
from curry_train.config import load_config
from curry_train.store.configs import update_config
from curry_train.store.runs import Ledger

root = sys.argv[1]

def say(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())

def arm(kill_at):
    # SIGKILL this writer at the kill_at-th filesystem step of atomic_write_text
    count = [0]
    def wrap(fn):
        def inner(*a, **k):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return inner
    os.replace, os.fsync, os.fchmod = wrap(os.replace), wrap(os.fsync), wrap(os.fchmod)
    tempfile.mkstemp = wrap(tempfile.mkstemp)

def writer(cmd):
    if cmd.get("kill_at"):
        arm(cmd["kill_at"])
    if cmd["mode"] == "config":
        i = cmd["start"]
        while True:
            update_config("shared", {"train.seed": i}, root=root)
            say({"done": i})
            i += 1
    ledger = Ledger(root)
    cfg = load_config(os.path.join(root, "configs", "tiny.yaml"))
    i = cmd["start"]
    while True:
        rec = ledger.start("bench", cfg, "tiny")
        say({"started": rec.run_id})
        ledger.finish(rec.run_id, status="ok", metrics={"i": i})
        say({"finished": rec.run_id, "i": i})
        i += 1

for line in sys.stdin:
    cmd = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            writer(cmd)
        finally:
            os._exit(0)
    say({"child": pid})
    _, status = os.waitpid(pid, 0)
    say({"reaped": pid, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None})
"""


class Helper:
    def __init__(self, project: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", HELPER, str(project)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def iteration(self, cmd: dict, delay_s: float | None) -> list[dict]:
        """One writer, killed by the timer (delay_s) or by itself (cmd["kill_at"]); its reports."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        msgs = [json.loads(self.proc.stdout.readline())]
        pid = msgs[0]["child"]
        if delay_s is not None:
            time.sleep(delay_s)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while "reaped" not in msgs[-1]:
            line = self.proc.stdout.readline()
            assert line, "the helper died"
            msgs.append(json.loads(line))
        assert msgs[-1]["signal"] == signal.SIGKILL, msgs[-1]
        return msgs

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _check_config(project: Path, reported: list[int], in_flight: int) -> int:
    cfg = load_config(project / "configs" / "local" / "shared.yaml")  # parses and validates: never half-written
    seed = cfg.train.seed
    last = reported[-1]
    assert seed in (last, in_flight), f"configs/shared.yaml holds seed {seed}; last reported {last}"
    versions = {load_config(p).train.seed for p in history("shared", root=project)}  # each one whole, too
    lost = set(reported) - versions - {seed}
    assert not lost, f"versions lost: {sorted(lost)}"
    return seed


@pytest.fixture
def helper(project):
    h = Helper(project)
    yield h
    h.close()


def test_update_config_survives_sigkill_at_any_point(project, helper):
    rng = random.Random(10)
    update_config("shared", {"train.seed": 0}, base="tiny", root=project)
    reported, seed, kills = [0], 0, {"timer": 0, "inside": 0}
    # kill_at sweeps 1..13: a write's history copy and new file are ~10 steps, so every step of the first update
    # and the start of the second are hit; the timer lands anywhere in a longer run of updates.
    plan = [(k, None) for k in range(1, 14)] + [(None, rng.uniform(0.0, 0.25)) for _ in range(13)]
    t0 = time.monotonic()
    for kill_at, delay in plan:
        msgs = helper.iteration({"mode": "config", "start": seed + 1, "kill_at": kill_at}, delay)
        kills["inside" if kill_at else "timer"] += 1
        reported += [m["done"] for m in msgs if "done" in m]
        seed = _check_config(project, reported, in_flight=reported[-1] + 1)
        if seed != reported[-1]:  # the write in flight completed before the kill: it is a version now
            reported.append(seed)
    took = time.monotonic() - t0
    # the next writer cleans what killed writers left, and history still has every version
    update_config("shared", {"train.seed": seed + 1}, root=project)
    assert not list((project / "configs" / "local").glob(".shared.yaml.*.tmp")), "stale temp files not cleaned"
    assert not list((project / "configs" / "local" / ".history" / "shared").glob(".*.tmp"))
    assert _check_config(project, [*reported, seed + 1], seed + 1) == seed + 1
    print(f"\natomicity figures: update_config killed {len(plan)} times ({kills['inside']} at a chosen step, "
          f"{kills['timer']} by a timer) in {took:.1f}s; {len(set(reported))} versions reported, none lost, "
          f"{len(history('shared', root=project))} kept in history")


def test_the_ledger_never_loses_a_reported_run_when_the_writer_is_killed(project, helper):
    rng = random.Random(20)
    started: set[str] = set()
    finished: dict[str, int] = {}
    plan = [(k, None) for k in range(1, 7)] + [(None, rng.uniform(0.0, 0.3)) for _ in range(16)]
    t0 = time.monotonic()
    for n, (kill_at, delay) in enumerate(plan):
        msgs = helper.iteration({"mode": "ledger", "start": 100 * n, "kill_at": kill_at}, delay)
        started |= {m["started"] for m in msgs if "started" in m}
        finished |= {m["finished"]: m["i"] for m in msgs if "finished" in m}
        ledger = Ledger(project)  # opens: the database survived
        rows = {r.run_id: r for r in ledger.list(10_000)}
        missing = started - set(rows)
        assert not missing, f"reported runs lost: {missing}"
        for run_id, i in finished.items():
            assert rows[run_id].status == "ok" and rows[run_id].metrics == {"i": i}, rows[run_id]
        for r in rows.values():
            assert r.status in ("running", "ok"), r
            load_config(project / "runs" / r.run_id / "config.yaml")  # the resolved config is whole
            if r.status == "ok":
                assert json.loads((project / "runs" / r.run_id / "metrics.json").read_text()) == r.metrics
    with sqlite3.connect(project / "runs" / "ledger.sqlite3") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    took = time.monotonic() - t0
    interrupted = [r for r in Ledger(project).list(10_000) if r.status == "running"]
    print(f"\natomicity figures: ledger writer killed {len(plan)} times in {took:.1f}s; {len(started)} runs "
          f"reported started, {len(finished)} finished, all present; {len(interrupted)} left 'running' (killed "
          "between start and finish, shown as such); integrity_check ok")
