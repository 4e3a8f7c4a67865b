"""The forkserver launcher's outcome rules (train/launch.py, launch_forkserver): a rank's result file is whole or
absent, a rank that dies in teardown after reporting costs the job nothing, and a rank that raises fails the launch
naming itself."""

from __future__ import annotations

import os
import time

import pytest
from curry_train.train.launch import LaunchError, launch_forkserver

pytestmark = pytest.mark.multirank


def _abort_in_teardown(rank: int, world: int) -> int:
    """Rank 1 aborts inside destroy_process_group (the DDP teardown abort of docs/CPU-DISTRIBUTED.md, quirk 1),
    after its result is written and after rank 0 has finished."""
    import torch.distributed as dist

    if rank == 1:
        def abort() -> None:
            time.sleep(1.0)  # rank 0 has written its result and exited by then
            os.abort()

        dist.destroy_process_group = abort
    return rank * 10


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    return rank


def test_a_rank_that_dies_in_teardown_after_reporting_does_not_fail_the_job():
    assert launch_forkserver(_abort_in_teardown, 2, timeout=120) == [0, 10]


def test_a_rank_that_raises_fails_the_launch_and_is_named():
    with pytest.raises(LaunchError, match="rank 1: ValueError: planted failure"):
        launch_forkserver(_raise_on_rank_1, 2, timeout=120)
