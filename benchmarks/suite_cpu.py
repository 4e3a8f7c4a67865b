"""CPU-seconds of a pytest run and every process it starts (ranks, torchrun, forkserver, MCP workers included).

    .venv/bin/python benchmarks/suite_cpu.py tests/test_train_essentials.py           # one process, -n 0
    .venv/bin/python benchmarks/suite_cpu.py tests/test_climb.py::test_climb_over_mcp_is_the_cli_climb

On the shared 2-core machine wall time depends on the neighbours; CPU-seconds (user + sys) mostly do not, and with
-n 2 on 2 cores the suite's wall is about its CPU-seconds / 2. Ranks forked by the
forkserver are its children, not pytest's, and the forkserver itself is not always waited for at exit, so this
process makes itself the child subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux: orphaned descendants are re-parented
to it) and waits for every descendant before reading RUSAGE_CHILDREN: nothing escapes the count.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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


if __name__ == "__main__":
    code, wall_s, cpu_s = measure(sys.argv[1:])
    print(f"suite_cpu: rc={code} wall={wall_s:.1f}s cpu={cpu_s:.1f}s  {' '.join(sys.argv[1:])}")
    sys.exit(code)
