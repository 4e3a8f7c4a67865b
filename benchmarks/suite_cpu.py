"""CPU-seconds of a pytest run and every process it starts (ranks, torchrun, forkserver, MCP workers included).

    .venv/bin/python benchmarks/suite_cpu.py tests/test_train_essentials.py           # one process, -n 0
    .venv/bin/python benchmarks/suite_cpu.py tests/test_climb.py::test_climb_over_mcp_is_the_cli_climb
    .venv/bin/python benchmarks/suite_cpu.py --per-test 20 tests/parallel   # also each test's CPU-s, 20 costliest
    .venv/bin/python benchmarks/suite_cpu.py --per-test 20 --rank-steps -m multirank tests   # and the ranks' steps

On the shared 2-core machine wall time depends on the neighbours; CPU-seconds (user + sys) mostly do not, and with
-n 2 on 2 cores the suite's wall is about its CPU-seconds / 2. Ranks forked by the
forkserver are its children, not pytest's, and the forkserver itself is not always waited for at exit, so this
process makes itself the child subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux: orphaned descendants are re-parented
to it) and waits for every descendant before reading RUSAGE_CHILDREN: nothing escapes the count.

--per-test N loads this module into pytest as a plugin (`-p benchmarks.suite_cpu`): around each test (set-up, call
and tear-down) it reads the CPU time of the pytest process, of the children it reaped, and of every live descendant
with the children each of those reaped (/proc/PID/stat utime, stime, cutime, cstime), so a forkserver's ranks
count against the test that launched them. A session fixture's cost lands on the first test that uses it. It
prints the N costliest tests and the CPU-seconds per file; the per-test figures add up to the total within the
cost of collection and of processes orphaned mid-test.

--rank-steps (after --per-test N) also splits the CPU of the ranks the forkserver launcher forks (train/launch.py
launch_forkserver, from the pytest process: every white-box, memory, bench and train run of the tests that is not
real torchrun or an MCP worker's) into the training step itself (train/loop.py train_step, less the white-box's
gradient read that runs inside it, `after_backward`) and the rest of each rank's life (fork, group set-up, build and
parallelize, the white-box's reads of gradients and parameters, save, teardown). The forkserver imports this module
(it is added to launch.PRELOAD before the first launch) and, with RANKS_DIR_VAR naming a folder, wraps train_step
and comm_init.end_rank there; each rank that reaches end_rank writes one line. Ranks under real torchrun or an MCP
worker are not counted (their CPU is in the per-test figures).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def measure(args: list[str]) -> tuple[int, float, float]:
    """(pytest's exit code, wall seconds, CPU-seconds of every descendant) of one `pytest -q -n 0 ARGS` run."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--durations=0", *args]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, check=False).returncode
    while True:  # the orphans re-parented here: their rusage joins RUSAGE_CHILDREN once waited for
        try:
            os.wait()
        except ChildProcessError:
            break
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return rc, wall, ru.ru_utime + ru.ru_stime


# ------------------------------------------------------------------------------ the per-test plugin (-p)


def _tree_cpu(root: int) -> float:
    """CPU-seconds of `root` (this process) and everything below it, reaped children included."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])  # after the comm: state, ppid, ...; utime is field 14 of stat(5)
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    below: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in below}
        below |= frontier
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + sum(ticks[p] for p in below) / TICK


_COST: dict[str, float] = {}
RANKS_DIR_VAR = "CURRY_SUITE_CPU_RANKS"  # read only by this benchmark's own copy in the forkserver


def _meter_ranks(out_dir: str) -> None:
    """In the forkserver: wrap train_step (its CPU-s, less after_backward's) and end_rank (write this rank's
    totals: CPU-s since its fork, CPU-s in train_step, steps) so that every forked rank reports at its end."""
    import curry_train.train.comm_init as comm_init
    import curry_train.train.loop as loop

    spent = [0.0, 0]  # CPU-s in train_step, steps; each forked rank starts from the forkserver's zeros
    step, end = loop.train_step, comm_init.end_rank

    def train_step(*args: Any, **kwargs: Any) -> Any:
        held = [0.0]
        after = kwargs.get("after_backward")
        if after is not None:
            def timed(loss: Any) -> None:
                t = time.process_time()
                after(loss)
                held[0] += time.process_time() - t
            kwargs["after_backward"] = timed
        t0 = time.process_time()
        try:
            return step(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - t0 - held[0]
            spent[1] += 1

    def end_rank(*args: Any, **kwargs: Any) -> None:
        with open(os.path.join(out_dir, f"{os.getpid()}.txt"), "w", encoding="utf-8") as f:
            f.write(f"{time.process_time():.4f} {spent[0]:.4f} {spent[1]}\n")
        end(*args, **kwargs)

    loop.train_step, comm_init.end_rank = train_step, end_rank


if os.environ.get(RANKS_DIR_VAR):  # the forkserver: pytest imported this plugin before pytest_configure set it
    _meter_ranks(os.environ[RANKS_DIR_VAR])


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--cpu-top", type=int, default=20, help="suite_cpu: how many of the costliest tests to list")
    parser.addoption("--rank-steps", action="store_true", help="suite_cpu: split the forked ranks' CPU-s into the "
                     "training step and the rest (module docstring)")


def pytest_configure(config: Any) -> None:
    if not config.getoption("--rank-steps", False):
        return
    import tempfile

    import curry_train.train.launch as launch

    os.environ[RANKS_DIR_VAR] = tempfile.mkdtemp(prefix="suite-cpu-ranks-")  # inherited by the forkserver
    launch.PRELOAD.append(__name__)


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
        before = _tree_cpu(os.getpid())
        yield
        _COST[item.nodeid] = _tree_cpu(os.getpid()) - before
except ImportError:  # this module run as the script: no pytest needed
    pass


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    if not _COST:
        return
    top = config.getoption("--cpu-top")
    w = terminalreporter.write_line
    w(f"suite_cpu: per-test CPU-seconds, {top} costliest of {len(_COST)} (total {sum(_COST.values()):.1f})")
    for nodeid, cpu in sorted(_COST.items(), key=lambda kv: -kv[1])[:top]:
        w(f"  {cpu:7.1f}  {nodeid}")
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, cpu in _COST.items():
        per_file[nodeid.split("::")[0]] += cpu
    w("suite_cpu: per-file CPU-seconds")
    for path, cpu in sorted(per_file.items(), key=lambda kv: -kv[1]):
        w(f"  {cpu:7.1f}  {path}")
    if os.environ.get(RANKS_DIR_VAR):
        _rank_summary(w, os.environ[RANKS_DIR_VAR])


def _rank_summary(w: Any, out_dir: str) -> None:
    import shutil

    rows = []
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name), encoding="utf-8") as f:
            total, step, steps = f.read().split()
        rows.append((float(total), float(step), int(steps)))
    shutil.rmtree(out_dir, ignore_errors=True)
    total, step = sum(r[0] for r in rows), sum(r[1] for r in rows)
    share = step / total if total else 0.0
    w(f"suite_cpu: forked ranks {len(rows)} (those that reached end_rank), CPU-s {total:.1f}: training step "
      f"{step:.1f} ({share:.0%}, {sum(r[2] for r in rows)} rank-steps), the rest {total - step:.1f}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--per-test"]:
        argv = ["-p", "benchmarks.suite_cpu", f"--cpu-top={argv[1]}", *argv[2:]]
    elif "--rank-steps" in argv:
        sys.exit("suite_cpu: --rank-steps goes after --per-test N (it is an option of the per-test plugin)")
    code, wall_s, cpu_s = measure(argv)
    print(f"suite_cpu: rc={code} wall={wall_s:.1f}s cpu={cpu_s:.1f}s  {' '.join(sys.argv[1:])}")
    sys.exit(code)
