"""The forkserver launcher's outcome rules (train/launch.py, launch_forkserver): a rank's result file is whole or
absent; a rank that dies in teardown after reporting costs the job nothing, even while a slower peer is still
computing; a rank tears down only after every peer has reported (comm_init.end_rank); a rank that dies before
reporting fails the launch at once, naming itself and its signal; a rank that raises fails the launch, named."""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def _abort_after_reporting_while_rank_0_computes(rank: int, world: int) -> int:
    """Rank 1 aborts as soon as its result is written, without waiting for its peers (comm_init.end_rank replaced),
    while rank 0 still computes (it merges the white-box's gathered tensors after the last collective): a launcher
    that stops the peers of a dead rank loses rank 0's result."""
    import curry_train.train.comm_init as comm_init

    if rank == 0:
        time.sleep(3.0)
    else:
        comm_init.end_rank = lambda *_: os.abort()
    return rank * 10


def _teardown_times(rank: int, world: int, stamp_dir: str) -> float:
    """Rank 1 returns at once and stamps when its teardown begins; rank 0 returns 2 s later, with the time."""
    import torch.distributed as dist

    if rank == 0:
        time.sleep(2.0)
        return time.time()
    destroy = dist.destroy_process_group

    def stamped() -> None:
        with open(os.path.join(stamp_dir, "rank1"), "w") as f:
            f.write(repr(time.time()))
        destroy()

    dist.destroy_process_group = stamped
    return 0.0


def _abort_before_reporting(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # a native crash: no result, no Python error
    time.sleep(60.0)  # rank 0 waits as if blocked in a collective with the dead rank: the launch must not
    return rank


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    return rank


def test_a_rank_that_dies_in_teardown_after_reporting_does_not_fail_the_job():
    assert launch_forkserver(_abort_in_teardown, 2, timeout=120) == [0, 10]


def test_a_rank_that_raises_fails_the_launch_and_is_named():
    with pytest.raises(LaunchError, match="rank 1: ValueError: planted failure"):
        launch_forkserver(_raise_on_rank_1, 2, timeout=120)


def test_a_rank_that_dies_after_reporting_while_a_slower_peer_computes_does_not_fail_the_job():
    assert launch_forkserver(_abort_after_reporting_while_rank_0_computes, 2, timeout=120) == [0, 10]


def test_a_rank_tears_down_only_after_every_peer_has_reported(tmp_path):
    """comm_init.end_rank's wait on the store: rank 1's teardown begins after rank 0's result, so a teardown abort there
    (quirk 1) cannot end the job early under torchrun either, whose agent stops every peer of a dead rank."""
    rank0_done, _ = launch_forkserver(_teardown_times, 2, str(tmp_path), timeout=120)
    assert float((tmp_path / "rank1").read_text()) >= rank0_done


def test_a_rank_that_dies_before_reporting_fails_the_launch_at_once_naming_it_and_its_signal():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 ended with signal SIGABRT before writing its result"):
        launch_forkserver(_abort_before_reporting, 2, timeout=120)
    assert time.monotonic() - start < 50  # not the peer's 60 s nor the timeout: the peer is killed


def test_the_docs_quote_the_launchers_teardown_grace():
    from curry_train.train import launch

    doc = (Path(__file__).resolve().parents[1] / "docs" / "CPU-DISTRIBUTED.md").read_text(encoding="utf-8")
    assert f"stragglers get {launch._TEARDOWN_GRACE_S:g} s to finish their teardown" in " ".join(doc.split())
