"""A rank killed in the middle of an asynchronous save (train/checkpoint.py save_async): the previous checkpoint
stays whole and loadable, no half checkpoint is visible, and `keep_last` prunes only after a newer one is whole."""

from __future__ import annotations

import pytest
import torch
from curry_train.config import load_config
from curry_train.train.launch import LaunchError, launch_forkserver

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"


def _cfg(steps: int, **o):
    return load_config(TINY, {"train.steps": steps, "train.lr_schedule": "cosine", "train.warmup_steps": 1, **o})


def _train_and_die(rank: int, world: int, raw: dict, ck: str, die_at: int) -> None:
    """Train with a save every 2 steps (keep_last=1); rank 1 is SIGKILLed inside its file writer while saving
    step `die_at`, after part of its files reached the disk."""
    import os
    import signal

    import torch.distributed.checkpoint as dcp
    from curry_train.config import from_dict
    from curry_train.train.loop import run_training

    real = dcp.FileSystemWriter.write_data

    def writer(self, plan, planner):
        fut = real(self, plan, planner)
        if rank == 1 and f"step-{die_at:06d}" in str(self.path):
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return fut

    dcp.FileSystemWriter.write_data = writer
    run_training(from_dict(raw), checkpoint_dir=ck, save_every=2, keep_last=1)


@pytest.mark.multirank
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    from curry_train.train import checkpoint
    from curry_train.train.loop import run_training

    ck = tmp_path / "ck"
    layout = {"parallel.dp": 2, "parallel.zero": 3}
    with pytest.raises(LaunchError):
        launch_forkserver(_train_and_die, 2, _cfg(6, **layout).to_dict(), str(ck), 4, timeout=300)
    visible = sorted(p.name for p in ck.iterdir() if not p.name.startswith("."))
    assert visible == ["step-000002"]  # step 4 never appeared, and step 2 was not pruned for it
    assert list(ck.glob(".step-000004.tmp/*.distcp"))  # the killed save did write part of its files
    folder, meta = checkpoint.find_checkpoint(ck)
    assert folder.name == "step-000002" and meta["step"] == 2

    torch.set_num_threads(1)
    ref = run_training(_cfg(4))["losses"]  # one device, uninterrupted
    # the survivor resumes on one device (another layout) and saves again: now the older step is pruned
    out = run_training(_cfg(4), resume=str(ck), checkpoint_dir=str(ck), save_every=2, keep_last=1)
    assert out["start_step"] == 2 and out["losses"] == pytest.approx(ref[2:], rel=1e-5)
    assert sorted(p.name for p in ck.iterdir()) == ["step-000004"]  # the stale .tmp went with the new save


def test_keep_last_is_checked_before_anything_launches(project):
    from curry_train.config import ConfigError
    from curry_train.measure.service import train

    with pytest.raises(ConfigError, match="--keep-last needs --checkpoint-dir"):
        train("tiny", root=project, keep_last=2)
    with pytest.raises(ConfigError, match="--keep-last") as e:
        train("tiny", root=project, checkpoint_dir=str(project / "ck"), save_every=1, keep_last=-1)
    assert "keep all" in str(e.value)
    assert not list((project / "runs").glob("*/spec.json"))  # nothing was launched
