"""The torchrun launcher: results per rank, the failing rank's error, deadlines that kill the whole group."""

from __future__ import annotations

import os
import time

import pytest
from curry_train.train.launch import LaunchError, run_torchrun, start_torchrun

pytestmark = pytest.mark.multirank


def _alive(pids):
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


def test_two_ranks_return_their_results(tmp_path):
    res = run_torchrun({"kind": "selftest"}, 2, tmp_path, timeout=120)
    assert [r["rank"] for r in res] == [0, 1] and all(r["sum"] == 2.0 for r in res)


def test_a_raising_rank_is_reported_by_number_and_message(tmp_path):
    with pytest.raises(LaunchError, match=r"rank 1: RuntimeError: selftest: injected failure"):
        run_torchrun({"kind": "selftest", "fault": "raise", "fault_rank": 1}, 2, tmp_path, timeout=120)


def test_a_hanging_rank_is_killed_at_the_deadline_with_its_whole_group(tmp_path):
    job = start_torchrun({"kind": "selftest", "fault": "hang", "fault_rank": 0}, 2, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="timed out"):
        job.wait(timeout=15)
    assert time.monotonic() - t0 < 15 + 8
    with pytest.raises(ProcessLookupError):
        os.killpg(job.proc.pid, 0)  # no process of the group survives
