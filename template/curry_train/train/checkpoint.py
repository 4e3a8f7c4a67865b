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
DTensor over a checkpoint-only mesh (pp*tp, ep, edp_cp) placed (Replicate, Shard(0), FSDP's placement or
Replicate). DCP then stores every expert at its global offset, under the same key an ep=1 run uses, and any
layout reads back the rows it holds (DTensor nests two Shard(0)s left to right, as FSDP nests inside the EP
slice). The mesh is built without process groups (`_init_backend=False`): DCP needs only this rank's coordinate.

Atomic save: every rank writes into DIR/.step-NNNNNN.tmp, rank 0 adds curry_meta.json (with every file's size)
and renames the folder to step-NNNNNN only after all ranks finished; an existing step folder is never replaced.
A failing save leaves at most a stale .tmp folder (removed by the next save of that step), never a damaged
checkpoint. `find_checkpoint` checks a resume target before anything launches: missing or empty folder, a newer
format version, another model shape, a missing or truncated shard are ConfigErrors naming the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from curry_train.config import Config, ConfigError, Problem
from curry_train.mesh import expert_rank_grid

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


def _adam_owner(par) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """The AdamW that steps this rank's params, and which params it owns (ZeRO-1: its partition)."""
    opt = par.optimizer
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer keeps the local AdamW here
    owner = inner if inner is not None else opt
    return owner, [p for g in owner.param_groups for p in g["params"]]


def state_dict(par, *, for_load: bool = False) -> dict[str, torch.Tensor]:
    """Flat {key: tensor} this rank saves or loads into (see the module docstring); for_load creates the AdamW
    state the optimizer has not allocated yet (before its first step)."""
    names = _param_names(par)
    glob = _expert_globaliser(par)
    out = {f"model.{name}": glob(p, p.detach()) for name, p in names.values()}  # shares storage: loads in place
    owner, owned = _adam_owner(par)
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
    ranks = expert_rank_grid(t).permute(0, 4, 2, 1, 3)
    mesh = DeviceMesh(par.device.type, ranks.reshape(t.pp * t.tp, t.ep, -1), _init_backend=False,
                      mesh_dim_names=("pp_tp", "ep", "edp_cp"))

    def glob(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not getattr(p, "_curry_expert", False):
            return v
        inner = v.placements[0] if isinstance(v, DTensor) else Replicate()  # FSDP2's 1-D edp_cp placement
        shape = (cfg.model.num_experts, *v.shape[1:])  # v.shape: [El, ...] (global over edp_cp for a DTensor)
        local = v.to_local() if isinstance(v, DTensor) else v
        return DTensor.from_local(local, mesh, (Replicate(), Shard(0), inner), run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    return glob


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(par, ckpt_dir: str | Path, step: int) -> Path:
    """Write step `step` (optimizer steps done) atomically to ckpt_dir/step-NNNNNN. Every rank must call it."""
    import torch.distributed.checkpoint as dcp

    root = Path(ckpt_dir)
    final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    if _rank() == 0:
        if final.exists():
            raise FileExistsError(f"{final} exists; a checkpoint is never overwritten (use another "
                                  "--checkpoint-dir or remove it)")
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a stale half-written save of this step
    _barrier()
    dcp.save(state_dict(par), checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        meta = {"format_version": FORMAT_VERSION, "step": step, "model": par.cfg.model.model_dump(mode="json"),
                "parallel_saved": par.cfg.parallel.model_dump(mode="json"), "files": files}
        (tmp / META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, final)  # atomic on one filesystem: the step folder appears complete or not at all
    _barrier()
    return final


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
