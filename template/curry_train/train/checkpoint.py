"""Checkpoints that reshard: model and AdamW state saved with torch.distributed.checkpoint (DCP), loadable into
any other layout.

    curry-train train --config tiny --set parallel.dp=2 --set parallel.zero=3 --checkpoint-dir ck --save-every 2
    curry-train train --config tiny --set parallel.tp=2 --resume ck              # another layout, same weights

Format (FORMAT_VERSION 1): DIR/step-NNNNNN/ holds DCP's files (one .distcp per rank + .metadata) and
curry_meta.json {format_version, step, model, files: {name: bytes}}. Keys are the reference model's parameter
names (`layers.3.attention.wq.weight`, the white-box contract), whatever wrapper or stage holds them:
  model.<name>                 the parameter (a DTensor under FSDP / TP: DCP stores the shards with their global
                               offsets and reshards them on load; plain replicated tensors are written once)
  optim.<name>.exp_avg|exp_avg_sq|step   AdamW state of the parameter (ZeRO-1: the owner rank writes it)
So a resume can change every parallel setting: each rank asks DCP for exactly the slices its new layout holds
(DCP's load planner reads the overlapping saved chunks; Wang et al. 2024, "TorchTitan", §3.3 distributed
checkpointing).

Experts under ep > 1: a rank holds El = E/ep experts [ep_i*El, (ep_i+1)*El) of each stacked weight (a plain
[El, D, F] tensor under DDP, or FSDP2's DTensor of it over the edp_cp mesh, sharded on the expert or a hidden
dim; parallel/expert_parallel.py), under the same name on every EP rank. Saved as such, the EP ranks' keys would
collide. So the state dict presents each expert weight as what it is logically: the full [E, D, F] tensor, a
DTensor over a checkpoint-only mesh (pp*tp, ep, edp_cp as (HSDP replicas, shard)) placed (Replicate, Shard(0),
Replicate, FSDP's placement on its shard dim or Replicate). DCP then stores every expert at its global offset,
under the same key an ep=1 run uses, and any
layout reads back the rows it holds (DTensor nests two Shard(0)s left to right, as FSDP nests inside the EP
slice). The mesh is built without process groups (`_init_backend=False`): DCP needs only this rank's coordinate.

Asynchronous, atomic save (docs/ARCHITECTURE.md#cluster-robustness): `save_async` stages a copy of this rank's
state (pinned host buffers on CUDA) and returns; a thread writes it with dcp.async_save (its own gloo group,
WRITER_THREADS file writers) into DIR/.step-NNNNNN.tmp; once every rank has written, rank 0 adds curry_meta.json
(with every file's size), renames the folder to step-NNNNNN and only then prunes step folders beyond keep_last.
An existing step folder is never replaced. A failing or killed save leaves at most a stale .tmp folder (removed
by the next save of that step), never a damaged checkpoint, and the previous one untouched.
`find_checkpoint` checks a resume target before anything launches: missing or empty folder, a newer
format version, another model shape, a missing or truncated shard are ConfigErrors naming the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from curry_train.config import Config, ConfigError, Problem
from curry_train.mesh import expert_rank_grid
from curry_train.wrapping import expert_replicas

FORMAT_VERSION = 1
META = "curry_meta.json"
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "num_experts")
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def _bad(field: str, message: str, fix: str) -> ConfigError:
    return ConfigError([Problem(fields=[field], message=message, fix=fix)])


# --------------------------------------------------------------------------- finding and checking (no torch.dist)


def find_checkpoint(path: str | Path, cfg: Config | None = None) -> tuple[Path, dict[str, Any]]:
    """(step folder, its meta) for `--resume path`: a step-NNNNNN folder, or a checkpoint dir (its latest step).
    Checks what can be checked without loading: raises ConfigError naming --resume and the fix."""
    p = Path(path)
    if not p.is_dir():
        raise _bad("--resume", f"{p} does not exist", "point --resume at a --checkpoint-dir folder or one of its "
                   "step-NNNNNN folders")
    if not (p / META).is_file():
        steps = sorted((int(m[1]), d) for d in p.iterdir() if (m := _STEP_DIR.match(d.name)) and d.is_dir())
        if not steps:
            raise _bad("--resume", f"{p} holds no checkpoint (no step-NNNNNN folder with {META})",
                       "train with --checkpoint-dir DIR --save-every N first, or fix the path")
        p = steps[-1][1]
    meta = json.loads((p / META).read_text(encoding="utf-8"))
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise _bad("--resume", f"{p} was written by checkpoint format {meta['format_version']}, newer than this "
                   f"curry_train's {FORMAT_VERSION}", "upgrade curry_train, or resume from an older checkpoint")
    for name, size in meta.get("files", {}).items():
        f = p / name
        if not f.is_file():
            raise _bad("--resume", f"{p} is missing shard {name}", "resume from another step-NNNNNN folder; "
                       "this one is incomplete")
        if f.stat().st_size != size:
            raise _bad("--resume", f"{p}: shard {name} has {f.stat().st_size} bytes, {size} were written "
                       "(truncated or corrupt)", "resume from another step-NNNNNN folder")
    if cfg is not None:
        diff = {k: (meta["model"].get(k), getattr(cfg.model, k)) for k in SHAPE_FIELDS
                if meta["model"].get(k) != getattr(cfg.model, k)}
        if diff:
            saved = ", ".join(f"model.{k}={a} (config: {b})" for k, (a, b) in diff.items())
            raise ConfigError([Problem(fields=[f"model.{k}" for k in diff], message=f"{p} holds another model "
                                       f"shape: {saved}", fix="resume with the model section the checkpoint was "
                                       "trained with, or start without --resume")])
    return p, meta


# --------------------------------------------------------------------------- the state (inside the ranks)


def _param_names(par) -> dict[int, tuple[str, torch.Tensor]]:
    from curry_train.parallel.parallelize import canonical_name

    return {id(p): (canonical_name(n), p) for part in par.parts for n, p in part.named_parameters()}


def _adam_owners(par) -> list[tuple[torch.optim.Optimizer, list[torch.Tensor]]]:
    """The AdamWs that step this rank's params, each with the params it owns (ZeRO-1: its partition; with
    experts, one ZeroRedundancyOptimizer for them and one for the rest, parallel/zero.py)."""
    from curry_train.parallel.zero import zero_optimizers

    out = []
    for opt in zero_optimizers(par.optimizer):
        inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer keeps the local AdamW here
        owner = inner if inner is not None else opt
        out.append((owner, [p for g in owner.param_groups for p in g["params"]]))
    return out


def state_dict(par, *, for_load: bool = False) -> dict[str, torch.Tensor]:
    """Flat {key: tensor} this rank saves or loads into (see the module docstring); for_load creates the AdamW
    state the optimizer has not allocated yet (before its first step)."""
    names = _param_names(par)
    glob = _expert_globaliser(par)
    out = {f"model.{name}": glob(p, p.detach()) for name, p in names.values()}  # shares storage: loads in place
    for owner, owned in _adam_owners(par):
        for p in owned:
            name = names[id(p)][0]
            st = owner.state.get(p)
            if not st and for_load:
                st = owner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                       "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                       "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            for k, v in (st or {}).items():
                out[f"optim.{name}.{k}"] = glob(p, v) if k != "step" else v
    return out


def _expert_globaliser(par):
    """f(param, tensor) -> tensor, or for an expert shard under ep > 1 the full-expert DTensor view of it (module
    docstring); the view shares the shard's storage, so DCP loads in place."""
    t, cfg = par.topo, par.cfg
    if not cfg.model.num_experts or t.ep == 1:
        return lambda p, v: v
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    # (pp, edp, ep, cp, tp) -> (pp, tp, ep, edp, cp): edp_cp is edp-major, cp-minor like mesh.ep_meshes' flatten,
    # so FSDP's shard index on it is this mesh's last coordinate.
    ranks = expert_rank_grid(t).permute(0, 4, 2, 1, 3)  # with ep over dp x tp: (pp, 1, ep, edp, 1)
    # HSDP and bf16 ZeRO-0 (mesh.expert_fsdp_mesh): edp_cp as (replicas, shard), replicas slowest; FSDP2's
    # placement is 2-D then
    from curry_train.parallel.fsdp import replicas

    reps = expert_replicas(t.dp, t.cp, t.ep, replicas(cfg)) or 1  # HSDP's, bf16 ZeRO-0's (wrapping.fsdp_replicas)
    mesh = DeviceMesh(par.device.type, ranks.reshape(ranks.shape[0] * ranks.shape[1], t.ep, reps, -1),
                      _init_backend=False, mesh_dim_names=("pp_tp", "ep", "edp_replicate", "edp_shard_cp"))

    def glob(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not getattr(p, "_curry_expert", False):
            return v
        inner = v.placements[-1] if isinstance(v, DTensor) else Replicate()  # FSDP2's placement on the shard dim
        shape = (cfg.model.num_experts, *v.shape[1:])  # v.shape: [El, ...] (global over edp_cp for a DTensor)
        local = v.to_local() if isinstance(v, DTensor) else v
        return DTensor.from_local(local, mesh, (Replicate(), Shard(0), Replicate(), inner), run_check=False,
                                  shape=shape, stride=torch.empty(shape, device="meta").stride())

    return glob


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# IO threads per rank of the file writer (DCP's FileSystemWriter splits a rank's tensors over this many files).
WRITER_THREADS = 4
_pending: PendingSave | None = None  # at most one save in flight per process
_stagers: dict[str, Any] = {}  # device type -> the pinned-memory stager reused by every save (CUDA only)


@dataclass
class PendingSave:
    """A save in flight: `wait()` returns the step folder once it is whole (rank 0 renamed it), or raises what
    failed (in the writer of any rank); the step folder then never appears."""

    final: Path
    done: Future

    def wait(self) -> Path:
        self.done.result()
        return self.final


def _ckpt_group():
    """A gloo group of all ranks for the save thread's collectives (DCP's plan and finish), so they never
    interleave with the training's collectives on the default group; async_save needs a CPU backend anyway
    (torch.distributed.checkpoint.async_save: "A CPU backend must be enabled")."""
    if not dist.is_initialized():
        return None
    from curry_train.train.comm_init import shared_group

    return shared_group("checkpoint", backend="gloo")  # the default group's timeout, and set_train_timeout's after


def _stager(device: torch.device):
    """On CUDA, staging copies the state into pinned host buffers kept across saves (fast device-to-host copies,
    no allocation per save); on CPU async_save's own stager copies it into fresh host memory."""
    if device.type != "cuda":
        return None
    if "cuda" not in _stagers:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # synchronous staging: save_async returns once the copy is taken, so the next step may change the weights
        _stagers["cuda"] = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
    return _stagers["cuda"]


def wait_pending() -> Path | None:
    """Block until the save in flight (if any) is whole; re-raises its failure. Every rank calls it."""
    global _pending
    pending, _pending = _pending, None
    return pending.wait() if pending is not None else None


def finish() -> Path | None:
    """End of training: the last save is whole on every rank's view of the filesystem (rank 0 renamed it)."""
    last = wait_pending()
    _barrier()
    return last


def save(par, ckpt_dir: str | Path, step: int, *, keep_last: int = 0) -> Path:
    """Write step `step` (optimizer steps done) to ckpt_dir/step-NNNNNN and wait until it is whole on every rank
    (see save_async). Every rank must call it."""
    save_async(par, ckpt_dir, step, keep_last=keep_last)
    return finish()


def save_async(par, ckpt_dir: str | Path, step: int, *, keep_last: int = 0) -> PendingSave:
    """Start saving step `step`: returns once this rank's state is staged (copied off the live tensors), while a
    background thread writes it (dcp.async_save, WRITER_THREADS file writers per rank) into
    ckpt_dir/.step-NNNNNN.tmp. When every rank has written, rank 0 adds curry_meta.json, renames the folder to
    step-NNNNNN and only then deletes the oldest step folders beyond `keep_last` (0: keep all), so a crash at any
    moment leaves the previous checkpoint loadable and no half checkpoint visible. A previous save still in
    flight is waited for first. Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    global _pending
    wait_pending()
    root = Path(ckpt_dir)
    final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    if _rank() == 0:
        if final.exists():
            raise FileExistsError(f"{final} exists; a checkpoint is never overwritten (use another "
                                  "--checkpoint-dir or remove it)")
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a stale half-written save of this step
    _barrier()
    meta = {"format_version": FORMAT_VERSION, "step": step, "model": par.cfg.model.model_dump(mode="json"),
            "parallel_saved": par.cfg.parallel.model_dump(mode="json")}
    upload = dcp.async_save(state_dict(par), storage_writer=dcp.FileSystemWriter(str(tmp),
                            thread_count=WRITER_THREADS), process_group=_ckpt_group(),
                            async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=_stager(par.device),
                            no_dist=not dist.is_initialized())
    rank0 = _rank() == 0

    def complete() -> Path:
        try:
            upload.result()  # DCP's finish ran on the coordinator after gathering every rank's write results
        except (Exception, CheckpointException) as e:  # a BaseException naming only the ranks: say what failed
            causes = getattr(e, "failures", None) or {_rank(): e}
            why = "; ".join(f"rank {r}: {type(c).__name__}: {c}" for r, c in sorted(causes.items()))
            raise RuntimeError(f"checkpoint {final.name} was not written ({why}); the earlier step folders are "
                               f"untouched, {tmp.name} holds the partial files") from e
        if rank0:
            _publish(tmp, final, meta, keep_last)
        return final

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="curry-ckpt")
    done = pool.submit(complete)
    pool.shutdown(wait=False)
    _pending = PendingSave(final=final, done=done)
    return _pending


def _publish(tmp: Path, final: Path, meta: dict[str, Any], keep_last: int) -> None:
    """Rank 0, every rank's files written: meta with each file's size, atomic rename, then prune older steps."""
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    _write_atomic(tmp / META, json.dumps({**meta, "files": files}, indent=1))
    os.replace(tmp, final)  # atomic on one filesystem: the step folder appears complete or not at all
    if keep_last > 0:
        steps = sorted((int(m[1]), d) for d in final.parent.iterdir() if (m := _STEP_DIR.match(d.name)))
        for _, old in steps[:-keep_last]:
            if old != final:  # renamed first: a half-deleted folder never looks like a checkpoint
                doomed = old.with_name(f".{old.name}.deleting")
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def load(par, path: str | Path) -> int:
    """Load a checkpoint (any layout) into this rank's model and optimizer; returns the step to continue from.
    Every rank must call it."""
    import torch.distributed.checkpoint as dcp

    folder, meta = find_checkpoint(path, par.cfg)
    state = state_dict(par, for_load=True)
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as e:  # DCP's errors name a storage key; add what to do about it
        raise RuntimeError(f"checkpoint {folder} could not be read ({type(e).__name__}: {e}); it is missing a "
                           "shard or corrupt: resume from another step-NNNNNN folder") from e
    return int(meta["step"])
