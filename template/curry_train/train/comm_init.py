"""Joining the process group and bounding every collective: the init timeout, the train timeout, NCCL's knobs.

    python -c "from curry_train.train.comm_init import rank_env; from curry_train.config import Config; \
               print(rank_env(Config(), 'cuda', '/tmp/run'))"

A hung rank must fail the job in bounded time, not after torch's defaults (10 min NCCL, 30 min gloo). Two
timeouts, as torchtitan sets them (Wang et al. 2024, "TorchTitan", §3.4; torchtitan/distributed/utils.py):
`comm.init_timeout_s` from `init_process_group` through the first optimizer step (compilation, the first
all-gathers, allocator warm-up), then `comm.train_timeout_s` on the default group and every mesh group
(`dist.distributed_c10d._set_pg_timeout`, which reaches both ProcessGroupNCCL and ProcessGroupGloo in torch 2.13).
A DeviceMesh's groups are created with torch's default timeout, not the default group's, so each group the mesh
built (mesh.process_groups: every dimension, the flattened dp x cp, HSDP's and EP's views) is set explicitly, and
so is every group made outside it through `new_group` here (the checkpoint's gloo group), which starts at the
default group's timeout of the moment. See docs/ARCHITECTURE.md#cluster-robustness.

On CUDA the launcher sets torch's own NCCL knobs for the ranks (`rank_env`): asynchronous error handling in mode
3 (tear the process down without cleanup: the mode under which the flight recorder can dump), the flight
recorder's ring buffer and its dump on timeout into the run folder (`<run_dir>/comm_traces/rank_<R>`). On CPU
(gloo) none of them exist, and nothing is set.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from curry_train.config import Config

# The flight recorder's ring of the last collectives per rank (torchtitan's comm.trace_buf_size default).
TRACE_BUFFER_ENTRIES = 20_000
TRACE_FOLDER = "comm_traces"


def backend_for(device_type: str) -> str:
    """gloo on CPU, nccl on CUDA: the backend follows the device, never a switch."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_env(cfg: Config, device_type: str, run_dir: str | Path) -> dict[str, str]:
    """Environment the launcher gives every rank: torch's NCCL knobs on CUDA, nothing on CPU."""
    if device_type != "cuda":
        return {}
    traces = Path(run_dir) / TRACE_FOLDER
    traces.mkdir(parents=True, exist_ok=True)
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # the flight recorder dumps only without the abort's cleanup
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(traces / "rank_"),  # torch appends the rank
    }


def init_process_group(cfg: Config, device: torch.device) -> None:
    """The default group for this rank: the device's backend, the init timeout, and on CUDA the rank's device
    (`device_id` binds the communicator to it eagerly, so the first collective does not guess the GPU)."""
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=cfg.comm.init_timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend_for(device.type), **kwargs)


def init_single_rank(cfg: Config, device: torch.device) -> None:
    """A 1-rank default group for a process that runs alone but whose layout needs one: FSDP2 at degree 1 (bf16,
    wrapping.py) builds its DeviceMesh on a process group. An in-process HashStore (no port, no rendezvous), the
    device's backend, the init timeout; FSDP2 copies instead of communicating at degree 1."""
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=cfg.comm.init_timeout_s), "store": dist.HashStore(),
                              "rank": 0, "world_size": 1}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend_for(device.type), **kwargs)


_extra: list[dist.ProcessGroup] = []  # the groups new_group made outside the mesh (this world's: pg_map)


def new_group(**kwargs: Any) -> dist.ProcessGroup:
    """`dist.new_group` at the default group's timeout now (the init timeout before the first step, the train
    timeout after it), registered so that set_train_timeout reaches it too."""
    g = dist.new_group(timeout=pg_timeout(), **kwargs)
    _extra.append(g)
    return g


_shared: dict[str, dist.ProcessGroup] = {}  # name -> a group every caller of shared_group(name) reuses


def shared_group(name: str, **kwargs: Any) -> dist.ProcessGroup:
    """One new_group per name and world (the checkpoint's gloo group): made on first use, reused while this world
    has it registered (a new world of the same process makes its own)."""
    if name not in _shared or _shared[name] not in dist.distributed_c10d._world.pg_map:
        _shared[name] = new_group(**kwargs)
    return _shared[name]


def set_train_timeout(cfg: Config, mesh: Any = None) -> list[dist.ProcessGroup]:
    """After the first optimizer step: every rank has finished it (barrier, device sync), then the default group,
    every group the mesh built (mesh.process_groups) and every group made by new_group get `comm.train_timeout_s`.
    Returns the groups set (for tests)."""
    from curry_train.mesh import process_groups

    if not dist.is_initialized():
        return []
    dist.barrier()
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    timeout = timedelta(seconds=cfg.comm.train_timeout_s)
    groups = [dist.group.WORLD, *(process_groups(mesh) if mesh is not None else [])]
    groups += [g for g in _extra if g in dist.distributed_c10d._world.pg_map]  # this world's only
    done: list[dist.ProcessGroup] = []
    for g in groups:
        if all(g is not d for d in done):
            dist.distributed_c10d._set_pg_timeout(timeout, g)
            done.append(g)
    return done


def pg_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The timeout a group's backend applies now (torch 2.13 exposes it as `ProcessGroup.options._timeout` for
    NCCL and `_get_backend(cpu).options._timeout` for gloo; read through the backend for both)."""
    g = group or dist.group.WORLD
    dev = torch.device("cuda") if torch.device("cuda") in g._device_types else torch.device("cpu")
    return g._get_backend(dev).options._timeout


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def destroy_process_group() -> None:
    """End of a rank: drop the groups this process cached for the world (new_group's, shared_group's) while the
    world still exists, so none outlives it into a later world of the same process (an in-process test, a
    forkserver job), then collect DDP's reference cycles (alive at destroy they abort the process:
    docs/CPU-DISTRIBUTED.md, quirk 1) and destroy the world."""
    import gc

    _extra.clear()
    _shared.clear()
    gc.collect()
    dist.destroy_process_group()


def end_rank(reported: bool = True) -> None:
    """End of a rank whose outcome is already written: wait until every peer has written its own, then
    destroy_process_group. Launchers stop every peer as soon as one process exits non-zero (torchrun's agent,
    torch's ProcessContext.join: docs/CPU-DISTRIBUTED.md, quirk 6), so a rank that aborts in its teardown (quirk
    1) while a slower peer still computes - rank 0 merging the gathered results - would lose that peer's result.

    The wait is on the world's store, not a collective barrier: on NCCL a rank held in a barrier for longer than the
    group's timeout (comm.train_timeout_s) while rank 0 merges a large result would be aborted by the watchdog,
    the very failure this prevents; a store wait is host-side, bounded by the world's init timeout, and raises.
    A rank that failed (`reported=False`) does not wait: its launcher stops the peers. A wait that fails (a peer
    or the store's host already gone) only means there is nobody left to wait for."""
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    if reported and world > 1:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"curry_train/reported/{dist.get_rank()}", "1")
        try:
            store.wait([f"curry_train/reported/{r}" for r in range(world)])
        except RuntimeError:  # DistStoreError included: a peer gone, nothing left to wait for
            pass
    destroy_process_group()
