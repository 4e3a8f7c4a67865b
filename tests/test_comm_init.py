"""Collective timeouts and NCCL's knobs (train/comm_init.py): the config fields are validated, the launcher gives
CUDA ranks torch's flight-recorder settings under the run folder, and after the first optimizer step every group a
rank uses carries `comm.train_timeout_s`, so a rank that stops answering fails its peers in that time."""

from __future__ import annotations

import time

import pytest
from curry_train.config import ConfigError, from_dict, load_config
from curry_train.train.comm_init import TRACE_FOLDER, backend_for, rank_env
from curry_train.train.launch import comm_env, launch_forkserver

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"


@pytest.mark.parametrize("field", ["comm.init_timeout_s", "comm.train_timeout_s"])
def test_a_non_positive_timeout_is_refused_naming_its_field(field):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, {field: 0})
    assert field in str(e.value)
    assert load_config(TINY, {field: 30}).comm.model_dump()[field.split(".")[1]] == 30


def test_cuda_ranks_get_torchs_nccl_knobs_with_the_dump_in_the_run_folder(tmp_path):
    cuda = load_config(TINY, {"hardware.device": "cuda"})
    env = comm_env({"config": cuda.to_dict()}, tmp_path)  # what start_torchrun adds to the ranks' environment
    assert env == rank_env(cuda, "cuda", tmp_path)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / TRACE_FOLDER / "rank_")
    assert (tmp_path / TRACE_FOLDER).is_dir()
    cpu = load_config(TINY, {"hardware.device": "cpu"})
    assert comm_env({"config": cpu.to_dict()}, tmp_path / "cpu") == {}  # gloo has none of these knobs
    assert comm_env({"kind": "selftest"}, tmp_path) == {}
    assert (backend_for("cuda"), backend_for("cpu")) == ("nccl", "gloo")


def _train_then_hang(rank: int, world: int, raw: dict) -> dict:
    """Two training steps (the first lowers the timeouts), then rank 1 stays away from a barrier for longer than
    comm.train_timeout_s: rank 0 must fail with gloo's timeout, not wait for it."""
    import torch.distributed as dist
    from curry_train.config import from_dict as build
    from curry_train.train.comm_init import pg_timeout, set_train_timeout
    from curry_train.train.loop import run_training, setup

    cfg = build(raw)
    run_training(cfg)
    seen = [pg_timeout().total_seconds()]  # run_training lowered the default group's timeout after step 0
    mesh = setup(cfg).mesh  # a fresh mesh's groups start at torch's default; set_train_timeout reaches them all
    before = {pg_timeout(mesh.get_group(i)).total_seconds() for i in range(mesh.ndim)}
    groups = set_train_timeout(cfg, mesh)
    seen += [len(groups) > 1, before != {cfg.comm.train_timeout_s}, {pg_timeout(g).total_seconds() for g in groups}]
    if rank == 1:
        time.sleep(4 * cfg.comm.train_timeout_s)
        return {"seen": seen}
    try:
        dist.barrier()
    except RuntimeError as e:
        return {"seen": seen, "error": str(e)[:300]}
    return {"seen": seen, "error": None}


@pytest.mark.multirank
def test_after_the_first_step_a_silent_rank_fails_its_peers_within_the_train_timeout():
    cfg = from_dict({"train": {"steps": 2, "global_batch": 4, "micro_batch": 2}, "parallel": {"dp": 2},
                     "comm": {"train_timeout_s": 1.5}, "hardware": {"device": "cpu"}})
    out = launch_forkserver(_train_then_hang, 2, cfg.to_dict(), timeout=120)
    assert out[0]["seen"] == out[1]["seen"] == [1.5, True, True, {1.5}]
    assert out[0]["error"] is not None and "timed out" in out[0]["error"].lower(), out[0]


def _every_group_timeout(rank: int, world: int, raw: dict) -> dict:
    """After set_train_timeout: the timeout of every view's group build_mesh made (the flattened dp x cp, HSDP's
    replicate and shard groups, EP's ep and edp x cp groups) and of the checkpoint's gloo group."""
    import torch.distributed as dist
    from curry_train.config import from_dict as build
    from curry_train.mesh import Topology, build_mesh, dp_cp_mesh, ep_meshes, fsdp_mesh
    from curry_train.train import checkpoint
    from curry_train.train.comm_init import pg_timeout, set_train_timeout

    cfg = build(raw)
    assert dist.is_initialized()  # the forkserver rank joined at its own init timeout
    mesh = build_mesh(Topology(dp=2, ep=2), "cpu", dp_replicate=2, experts=True)
    early = checkpoint._ckpt_group()  # made before the first step: at the default group's (init) timeout
    at_init = pg_timeout(early) == pg_timeout()
    set_train_timeout(cfg, mesh)
    (ep, edp), hsdp = ep_meshes(mesh, 2), fsdp_mesh(mesh, 2)
    views = {"dp_cp": dp_cp_mesh(mesh).get_group(0), "hsdp_replicate": hsdp.get_group(0),
             "hsdp_shard": hsdp.get_group(1), "ep": ep.get_group(0), "edp_cp": edp.get_group(0), "checkpoint": early}
    return {"at_init": at_init, **{k: pg_timeout(g).total_seconds() for k, g in views.items()}}


@pytest.mark.multirank
def test_every_group_the_mesh_and_the_checkpoint_make_gets_the_train_timeout():
    cfg = from_dict({"parallel": {"dp": 2}, "comm": {"init_timeout_s": 120, "train_timeout_s": 7},
                     "hardware": {"device": "cpu"}})
    out = launch_forkserver(_every_group_timeout, 2, cfg.to_dict(), timeout=120)
    for r in out:
        assert r.pop("at_init")  # a group made outside the mesh starts at the default group's timeout
        assert r == dict.fromkeys(r, 7), r  # not torch's 30-minute gloo default


def test_init_distributed_gives_up_after_the_init_timeout_when_a_rank_never_joins(monkeypatch):
    """Rank 0 of a 2-rank job whose peer never starts: the rendezvous fails in comm.init_timeout_s, naming it."""
    import torch.distributed as dist
    from curry_train.train.launch import free_port
    from curry_train.train.loop import init_distributed

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "2",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = from_dict({"comm": {"init_timeout_s": 1}, "hardware": {"device": "cpu"}})
    with pytest.raises(dist.DistStoreError, match=r"Timed out after \d seconds waiting for clients"):
        init_distributed(cfg)
    assert not dist.is_initialized()
