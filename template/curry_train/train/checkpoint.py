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
checkpointing). Expert shards under ep > 1 are plain per-rank tensors under one name, which DCP cannot tell
apart: checkpoints refuse ep > 1 with an error rather than save a wrong model.

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
    if par.cfg.model.num_experts and par.cfg.parallel.ep > 1:
        raise _bad("parallel.ep", "checkpoints do not support expert parallel (expert shards share names across "
                   "ranks)", "checkpoint with parallel.ep=1")
    names = _param_names(par)
    out = {f"model.{name}": p.detach() for name, p in names.values()}  # shares storage: loads in place
    owner, owned = _adam_owner(par)
    for p in owned:
        name = names[id(p)][0]
        st = owner.state.get(p)
        if not st and for_load:
            st = owner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                   "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                   "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        for k, v in (st or {}).items():
            out[f"optim.{name}.{k}"] = v
    return out


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
    if par.step_ctl is not None:
        par.step_ctl.step = int(meta["step"])
    return int(meta["step"])
