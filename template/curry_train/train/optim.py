"""The optimizer step of every layout: global-norm gradient clipping, the learning-rate schedule, then the update.

    python -c "from curry_train.train.optim import lr_at; from curry_train.config import Config; \
               print([round(lr_at(Config(train={'lr_schedule': 'cosine', 'warmup_steps': 2, 'steps': 10}), s), 5) \
                      for s in range(10)])"

`optimizer_step(optimizer, parts, cfg, step, mesh)` is called explicitly by `train.loop.train_step` (plain AdamW,
FSDP's AdamW over DTensors, ZeroRedundancyOptimizer alike) and by the white-box's single-device reference
(validation/whitebox.reference), so both run the same clip and schedule; `step` is the optimizer step index
(0 for the first update; a resume continues from the checkpoint's step).

Schedule (train.lr_schedule, train.warmup_steps): linear warm-up lr*(s+1)/(w+1) for s < w (nanoGPT's), then
constant, or cosine decay to lr/10 at train.steps (Loshchilov & Hutter 2017, "SGDR", eq. 5, one cycle).

Clip (train.grad_clip > 0): torch.nn.utils.clip_grad_norm_'s rule, coef = min(1, c / (||g|| + 1e-6)), with
||g|| the L2 norm of the *whole model's* gradient, whatever the layout (Pascanu et al. 2013, "On the difficulty
of training recurrent neural networks", §3.2). Each rank sums the squares of what it holds exactly once:
  plain grads (DDP, ZeRO-1, replicated across tp, dp and cp): the local sum, already the same on those ranks;
  DTensor grads (FSDP shards, TP shards, both): the local sum, all-reduced over each mesh dimension on which the
      grad is sharded (Shard / _StridedShard), not over Replicate dimensions (that would count copies); a Partial
      grad (sequence parallel's norm weights: pending sums) is reduced first;
  expert shards (EP > 1): their partial sum is all-reduced over the ep group too (each EP rank holds other experts);
  pipeline stages: the per-rank total is all-reduced over the pp group (each stage holds other layers).
Per reduction group (the same placements and mesh groups, the expert flag) one `torch._foreach_norm` over the
local gradients (one multi-tensor kernel on CUDA, fp32 accumulation, no per-parameter fp64 copy); the per-tensor
norms are squared and summed in float64 (a vector of one scalar per tensor), so the total differs from a float64
sum of squares by fp32 rounding only. One all-reduce per group kind, not per tensor.

Optimizer (`adamw_kwargs`, the one home of AdamW's arguments: plain AdamW, FSDP's, ZeRO-1's local shard and the
white-box reference): fused=True (one CUDA kernel for the whole update, torch.optim.AdamW "fused") when every
parameter is a floating CUDA tensor of one kind (all plain tensors, or all DTensors on one mesh); otherwise the
per-tensor loop (foreach=False). Both multi-tensor paths (fused and foreach) refuse a parameter list that mixes
plain tensors and DTensors, or DTensors of two meshes ("got mixed torch.Tensor and DTensor"): TP leaves
replicated parameters plain beside its sharded ones, EP's expert shards live on their own mesh. On CPU the loop
is also torch's default and what the estimator's CPU tracker is calibrated on (estimator/states.py
_step_transient: sqrt(v) for one tensor at a time, where foreach would hold it for every tensor at once; fused
holds none, and states.adamw_fused says which layouts leave parameters of one kind: tests/parallel/
test_adamw_kinds.py holds it against the real ranks).
All compute AdamW's update (Loshchilov & Hutter 2019, Algorithm 2) elementwise in the parameter dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from curry_train.config import Config


def lr_at(cfg: Config, step: int) -> float:
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / (t.warmup_steps + 1)
    if t.lr_schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    low = t.lr / 10
    return low + 0.5 * (t.lr - low) * (1.0 + math.cos(math.pi * progress))


def _sharded_groups(g: torch.Tensor) -> tuple:
    from torch.distributed.tensor import Replicate

    mesh = g.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate))


def _reduce_partial(g: torch.Tensor) -> torch.Tensor:
    """A Partial grad (SP's replicated norm weights before their reduction) holds summands, whose squares do not
    add up to the square of the sum: reduce it first."""
    from torch.distributed.tensor import Replicate

    return g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])


def adamw_kwargs(params: list[torch.Tensor], cfg: Config) -> dict[str, Any]:
    """torch.optim.AdamW's keyword arguments for `params` (docstring, "Optimizer")."""
    kinds = {getattr(p, "device_mesh", None) for p in params}  # None: plain; a DeviceMesh hashes by its ranks
    fused = len(kinds) == 1 and all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params)
    return {"lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay, "fused": fused, "foreach": False}


def global_grad_norm(parts: list[nn.Module], cfg: Config, mesh: Any) -> torch.Tensor:
    """L2 norm of the whole model's gradient (float64 scalar, identical on every rank). Every rank must call it."""
    grads: dict[tuple, list[torch.Tensor]] = {}
    device = None
    ep = cfg.parallel.ep if mesh is not None else 1
    for part in parts:
        for p in part.parameters():
            g = p.grad
            if g is None:
                continue
            is_dt = hasattr(g, "to_local")
            if is_dt and any(pl.is_partial() for pl in g.placements):
                g = _reduce_partial(g)
            local = g.to_local() if is_dt else g
            device = local.device
            groups = _sharded_groups(g) if is_dt else ()
            expert = bool(getattr(p, "_curry_expert", False)) and ep > 1
            grads.setdefault((groups, expert), []).append(local.detach())
    total = torch.zeros((), dtype=torch.float64, device=device or "cpu")
    for (groups, expert), tensors in grads.items():
        s = torch.stack(torch._foreach_norm(tensors, 2)).double().pow(2).sum()  # [n tensors] fp32 norms -> scalar
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(s, group=group)
        if expert:
            from curry_train.mesh import ep_meshes

            dist.all_reduce(s, group=ep_meshes(mesh, ep)[0].get_group())
        total += s
    if mesh is not None and cfg.parallel.pp > 1:
        from curry_train.mesh import pp_mesh

        dist.all_reduce(total, group=pp_mesh(mesh).get_group())
    return total.sqrt()


@torch.no_grad()
def clip_grads_(parts: list[nn.Module], cfg: Config, mesh: Any) -> torch.Tensor:
    """Scale every gradient by min(1, grad_clip / (norm + 1e-6)); returns the pre-clip global norm, a float64
    device scalar: the scale is applied on the device, so the host never waits for the norm."""
    norm = global_grad_norm(parts, cfg, mesh)
    coef = torch.clamp(cfg.train.grad_clip / (norm + 1e-6), max=1.0)
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.mul_(coef.to(g.dtype))
    return norm


def optimizer_step(optimizer: torch.optim.Optimizer, parts: list[nn.Module], cfg: Config, step: int,
                   mesh: Any = None) -> torch.Tensor | None:
    """Update the parameters from their accumulated gradients for optimizer step `step` (every rank calls it):
    clip to train.grad_clip by the global norm (if > 0), set every param group's lr to `lr_at(cfg, step)`, step.
    Returns the pre-clip global gradient norm (a device scalar, unread), or None when clipping is off (the norm is
    then not computed)."""
    norm = clip_grads_(parts, cfg, mesh) if cfg.train.grad_clip > 0 else None
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return norm
