"""Checkpoints that reshard (torch.distributed.checkpoint): save in layout A, resume in layout B, same losses as an
uninterrupted single-device run; atomic saves; clear errors for every bad resume target."""

from __future__ import annotations

import json

import pytest
import torch
from curry_train.config import ConfigError, load_config
from curry_train.train.launch import launch_forkserver

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
STEPS = {"train.steps": 4, "train.lr_schedule": "cosine", "train.warmup_steps": 1, "train.grad_clip": 0.5}
PAIRS = [  # (layout A, layout B): every parallel setting may change
    ({"parallel.dp": 2, "parallel.zero": 3}, {"parallel.tp": 2, "parallel.dp": 2, "parallel.zero": 2}),
    ({"parallel.dp": 2, "parallel.zero": 1}, {"parallel.pp": 2}),
    ({"parallel.tp": 2}, {"parallel.dp": 4, "parallel.zero": 3}),
]

MOE = PRESETS / "tiny-moe.yaml"
E2 = {"model.num_experts": 2}
MOE_PAIRS = [  # experts are saved under their global index, so ep (and how FSDP shards the experts) may change
    ({"parallel.dp": 2, "parallel.ep": 2}, {"parallel.dp": 2, "parallel.zero": 3}),  # ep2 DDP -> ep1 ZeRO-3
    ({}, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3}),  # one device -> ep2 ZeRO-3
    # ep2 with FSDP's Shard(0) of the 2 local experts over edp=2 (nested in the EP slice) -> ep2 DDP
    ({"parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3}, {"parallel.dp": 2, "parallel.ep": 2}),
    # 1 local expert over edp=2: FSDP shards a hidden dim (expert_shard_placement) -> one device
    ({"parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 2, **E2}, E2),
]


def _cfg(o: dict, base=TINY):
    return load_config(base, {**STEPS, **o})


def _spec(o: dict, base=TINY, **kw) -> dict:
    return {"kind": "train", "config": _cfg(o, base).to_dict(), "out_dir": "/tmp", **kw}


def _single(tmp_path, o: dict | None = None, base=TINY, **kw) -> dict:
    from curry_train.train.loop import run_training

    torch.set_num_threads(1)
    return run_training(_cfg(o or {}, base), **kw)


def test_single_process_save_and_resume_continue_the_same_run(tmp_path):
    full = _single(tmp_path, checkpoint_dir=str(tmp_path / "ck"), save_every=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000002", "step-000004"]
    meta = json.loads((tmp_path / "ck" / "step-000002" / "curry_meta.json").read_text())
    assert meta["step"] == 2 and meta["format_version"] == 1 and meta["files"]
    resumed = _single(tmp_path, resume=str(tmp_path / "ck" / "step-000002"))
    assert resumed["start_step"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-6)


def test_a_failing_save_never_touches_an_earlier_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from curry_train.train import checkpoint
    from curry_train.train.loop import setup

    par = setup(_cfg({}))
    first = checkpoint.save(par, tmp_path, 2)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    with pytest.raises(FileExistsError):
        checkpoint.save(par, tmp_path, 2)  # never overwritten

    real = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):  # the writer thread fails after part of the files reached the disk
        real(self, plan, planner).wait()
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken)
    with pytest.raises(Exception, match="disk full"):
        checkpoint.save(par, tmp_path, 4, keep_last=1)  # keep_last: the earlier one is pruned only after success
    assert not (tmp_path / "step-000004").exists() and list(tmp_path.glob(".step-000004.tmp/*.distcp"))
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert checkpoint.find_checkpoint(tmp_path)[0] == first  # the latest complete one


def test_bad_resume_targets_are_clear_errors(tmp_path, project, capsys):
    from curry_train.cli import main
    from curry_train.train import checkpoint
    from curry_train.train.loop import setup

    (tmp_path / "empty").mkdir()
    folder = checkpoint.save(setup(_cfg({})), tmp_path / "ck", 2)

    def run(target, *sets):
        code = main(["train", "--config", "tiny", "--root", str(project), "--resume", str(target),
                     *[x for s in sets for x in ("--set", s)]])
        return code, capsys.readouterr().err

    code, err = run(tmp_path / "missing")
    assert code == 2 and "does not exist" in err and "Fix:" in err
    code, err = run(tmp_path / "empty")
    assert code == 2 and "holds no checkpoint" in err
    code, err = run(folder, "model.d_model=32")
    assert code == 2 and "model.d_model=64 (config: 32)" in err
    meta = json.loads((folder / "curry_meta.json").read_text())
    (folder / "curry_meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    code, err = run(folder)
    assert code == 2 and "newer than" in err
    (folder / "curry_meta.json").write_text(json.dumps(meta))
    shard = next(f for f in folder.iterdir() if f.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    code, err = run(folder)
    assert code == 2 and "truncated or corrupt" in err
    shard.unlink()
    code, err = run(folder)
    assert code == 2 and "missing shard" in err
    assert not list((project / "runs").glob("*/spec.json"))  # nothing was launched
    with pytest.raises(ConfigError, match="--save-every needs --checkpoint-dir"):
        from curry_train.measure.service import train

        train("tiny", root=project, save_every=2)


@pytest.mark.multirank
def test_resume_in_another_layout_matches_the_uninterrupted_single_device_run(tmp_path):
    from curry_train.train.jobs import rank_jobs

    ref = _single(tmp_path)["losses"]  # 4 steps, one device, no checkpoint
    saves = [_spec(a, checkpoint_dir=str(tmp_path / f"ck{i}"), save_every=2) for i, (a, _) in enumerate(PAIRS)]
    first = launch_forkserver(rank_jobs, 2, saves, timeout=600)[0]
    table = []
    for world in (4, 2):
        idx = [i for i, (_, b) in enumerate(PAIRS) if _cfg(b).world_size == world]
        specs = [_spec(PAIRS[i][1], resume=str(tmp_path / f"ck{i}" / "step-000002")) for i in idx]
        for i, out in zip(idx, launch_forkserver(rank_jobs, world, specs, timeout=600)[0]):
            table.append((i, first[i]["losses"][:2] + out["losses"]))
    print(json.dumps({"reference": ref, "resumed": {str(PAIRS[i]): v for i, v in sorted(table)}}))
    for i, losses in sorted(table):
        assert losses == pytest.approx(ref, rel=1e-5), (PAIRS[i], losses, ref)


@pytest.mark.multirank
def test_moe_resume_changes_expert_parallel_and_matches_the_single_device_run(tmp_path):
    from curry_train.train.jobs import rank_jobs

    ref = {4: _single(tmp_path, base=MOE)["losses"], 2: _single(tmp_path, E2, base=MOE)["losses"]}
    ck = [tmp_path / f"moe{i}" for i in range(len(MOE_PAIRS))]
    first = {1: _single(tmp_path, MOE_PAIRS[1][0], base=MOE, checkpoint_dir=str(ck[1]), save_every=2)["losses"]}
    for world in (2, 4):  # layout A, saving at step 2, one launch per world size
        idx = [i for i, (a, _) in enumerate(MOE_PAIRS) if _cfg(a, MOE).world_size == world]
        specs = [_spec(MOE_PAIRS[i][0], MOE, checkpoint_dir=str(ck[i]), save_every=2) for i in idx]
        first.update(zip(idx, (o["losses"] for o in launch_forkserver(rank_jobs, world, specs, timeout=600)[0])))
    resumed = {3: _single(tmp_path, E2, base=MOE, resume=str(ck[3] / "step-000002"))["losses"]}
    specs = [_spec(MOE_PAIRS[i][1], MOE, resume=str(ck[i] / "step-000002")) for i in (0, 1, 2)]
    resumed.update(zip((0, 1, 2), (o["losses"] for o in launch_forkserver(rank_jobs, 2, specs, timeout=600)[0])))
    table = {i: first[i][:2] + resumed[i] for i in range(len(MOE_PAIRS))}
    print(json.dumps({"reference": ref, "resumed": {str(MOE_PAIRS[i]): v for i, v in table.items()}}))
    for i, losses in table.items():
        assert losses == pytest.approx(ref[_cfg(MOE_PAIRS[i][0], MOE).model.num_experts], rel=1e-5), MOE_PAIRS[i]
