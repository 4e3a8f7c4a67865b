"""The ONE composition function: turn the full reference model into this rank's parallel model and optimizer.

Order (fixed; each constraint is explained where it applies, torchtitan-style):
  1. PP split      - outermost: every later step works on the stage modules this rank keeps.
  2. TP / SP       - rewrites Linear weights into DTensors on the tp axis; must precede FSDP, which then shards
                     the *local* TP shards along dp (2-D "_StridedShard" params), never the other way round.
  3. CP, EP        - swap the attention core for ring attention / shard experts and insert all-to-alls; they
                     change what a block computes, so they go before recompute wraps the block.
  4. recompute     - wraps whole blocks after TP/CP/EP so the recomputed region replays their collectives too.
  4b. compile      - torch.compile per block (train.compile) after recompute, so the checkpoint is inside the
                     graph, and before FSDP/DDP, whose hooks stay eager around it (parallel/compile.py).
  5. FSDP or DDP   - last module transform: it must see the final parameter set (wrapping.py: bf16 = FSDP2 and its
                     MixedPrecisionPolicy on every layout; fp32: ZeRO-2/3 = FSDP2, ZeRO-0/1 = DDP, ZeRO-1 with TP =
                     FSDP2 holding the step) over the dp x cp ranks (CP ranks see different tokens, so their grads
                     are averaged like DP's).
  6. optimizer     - built on the wrapped parameters (FSDP's sharded DTensors); ZeRO-1 shards its state.
  7. PP schedule   - built last, around the fully wrapped stage modules.
Size-1 axes skip their step, so a 1-rank fp32 run is the plain model (a bf16 one is FSDP2 at degree 1).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.mesh import Topology, dp_cp_mesh
from curry_train.parallel.materialize import canonical_name, global_shapes, is_meta, materialize
from curry_train.wrapping import data_parallel_wrapper, fsdp_holds_step, shards_optimizer_only

__all__ = ["Parallelized", "canonical_name", "grad_reduce_group", "parallelize"]


@dataclass
class Parallelized:
    """What one rank trains: its model chunks, optimizer and the hooks the training step needs."""

    cfg: Config
    topo: Topology
    mesh: Any  # DeviceMesh ("pp", "dp", "cp", "tp"), or None for a single process
    device: torch.device
    parts: list[nn.Module]  # model chunks this rank runs: [model] unless pp > 1
    optimizer: torch.optim.Optimizer | None = None
    schedule: Any = None  # torch.distributed.pipelining schedule when pp > 1
    stage_ids: list[int] = field(default_factory=list)  # pipeline stage index of each part
    loss_parallel: bool = False  # logits are vocab-sharded DTensors: compute the loss under loss_parallel()
    grad_sync: Callable[[bool], None] = lambda enabled: None  # skip the gradient reduction on accumulation steps
    feed: Any = None  # train/feed.py Feed: this rank's micro-batches, prefetched (made by the first train_step)
    compiled: bool = False  # the blocks run torch.compile'd (train.compile resolved, parallel/compile.py)

    def loss_context(self) -> AbstractContextManager:
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def zero_grad(self) -> None:
        """Clear gradients for the next step. DDP (gradient_as_bucket_view=True) keeps each .grad a view into its
        bucket and zeroes it in place: set to None, the first micro-steps of a step (no sync) would accumulate
        into fresh tensors beside the buckets, a second full copy of the gradients until the synced backward."""
        from torch.nn.parallel import DistributedDataParallel

        ddp = any(isinstance(part, DistributedDataParallel) for part in self.parts)
        self.optimizer.zero_grad(set_to_none=not ddp)


def parallelize(model: nn.Module, mesh: Any, cfg: Config, *, topo: Topology, device: torch.device) -> Parallelized:
    """Apply every configured primitive to `model` in the fixed order above.

    `model` is normally built on the meta device (train.loop.setup): the layout is applied to the storage-less
    model and each part is materialised (its local shards only, parallel/materialize.py) right after its last
    sharding transform: after FSDP, or before DDP (whose constructor broadcasts the parameters). A model that
    already has storage (the seeded reference model, tests) is moved to `device` whole, as before.
    """
    p = cfg.parallel
    meta = is_meta(model)
    shapes = global_shapes(cfg) if meta else None
    if not meta:
        model.to(device)
    par = Parallelized(cfg=cfg, topo=topo, mesh=mesh, device=device, parts=[model], stage_ids=[0])

    # 1. PP split: keep only this rank's stage(s); names stay those of the full model.
    if topo.pp > 1:
        from curry_train.parallel.pipeline import apply_pp

        par.parts, par.stage_ids = apply_pp(model, mesh, cfg, device=device)

    for i, part in enumerate(par.parts):
        # 2. TP (+SP) on the tp axis.
        if topo.tp > 1:
            from curry_train.parallel.tensor_parallel import apply_tp

            par.loss_parallel = apply_tp(part, mesh, cfg) or par.loss_parallel
        # 3. CP and EP rewrite blocks.
        if topo.cp > 1:
            from curry_train.parallel.context_parallel import apply_cp

            apply_cp(part, mesh, cfg)
        if cfg.model.num_experts > 0:
            from curry_train.parallel.expert_parallel import apply_ep

            apply_ep(part, mesh, cfg)  # ep == 1 still registers the replicated-expert gradient handling
        # 4. recompute.
        if p.recompute != "none":
            from curry_train.parallel.recompute import apply_recompute

            apply_recompute(part, mesh, cfg)
        # 4b. torch.compile per block.
        from curry_train.parallel.compile import apply_compile

        par.compiled = apply_compile(part, mesh, cfg)
        # 5. data parallel over dp x cp; the local shards are materialised after FSDP or before DDP.
        wrapper = data_parallel_wrapper(topo.dp, topo.cp, p.zero, topo.tp, cfg.train.dtype)  # wrapping.py: the rule
        if wrapper == "fsdp":
            from curry_train.parallel.fsdp import apply_fsdp

            apply_fsdp(part, mesh, cfg)
        if meta:
            materialize(part, cfg, device, mesh, shapes)
        if wrapper == "ddp":
            from curry_train.parallel.ddp import apply_ddp

            par.parts[i] = apply_ddp(part, mesh, cfg)

    par.grad_sync = _grad_sync_fn(par)

    # 6. optimizer on the final parameters.
    params = [q for part in par.parts for q in part.parameters()]
    if shards_optimizer_only(topo.dp, topo.cp, p.zero, topo.tp, cfg.train.dtype):
        from curry_train.parallel.zero import build_zero1_optimizer

        par.optimizer = build_zero1_optimizer(params, mesh, cfg)
    else:
        from curry_train.train.optim import adamw_kwargs

        par.optimizer = torch.optim.AdamW(params, **adamw_kwargs(params, cfg))  # fused on CUDA where it can

    # 7. PP schedule around the wrapped stages.
    if topo.pp > 1:
        from curry_train.parallel.pipeline import build_schedule

        par.schedule = build_schedule(par)
    return par


def _grad_sync_fn(par: Parallelized) -> Callable[[bool], None]:
    """Gradient reduction on accumulation micro-steps.

    DDP / ZeRO-1 (fp32): skip the all-reduce until the last micro-step (require_backward_grad_sync, as nanoGPT
    does instead of no_sync()): the accumulated full gradient is there anyway, so earlier syncs would be redundant.
    ZeRO-2/3 (FSDP2): reduce-scatter on *every* micro-step. Skipping it (set_requires_gradient_sync(False)) makes
    FSDP2 keep each unit's unsharded fp32 gradient across micro-steps, i.e. the full 4 bytes/param per rank that
    ZeRO-2 exists to remove (Rajbhandari et al. 2019, §5.2: P_g reduce-scatters gradients as they are produced).
    The extra (m-1) reduce-scatters are the price of keeping gradients sharded. Two exceptions keep the units
    gathered across micro-batches (parallel/fsdp.py holds_step): parallel.fsdp_keep_gathered (zero=2, still
    reduce-scattering each micro-step) and ZeRO-0/1 on FSDP2 (wrapping.fsdp_holds_step: bf16's replicas and
    Megatron's distributed optimizer; the gradients accumulate unsharded in fp32 too, reduced once, as DDP's).
    Pipeline schedules manage their stages' sync themselves. A no-op for an fp32 single process.
    """
    p, topo = par.cfg.parallel, par.topo
    defer = fsdp_holds_step(topo.dp, topo.cp, p.zero, topo.tp, par.cfg.train.dtype)  # wrapping.py
    hold = defer or p.fsdp_keep_gathered

    def set_sync(enabled: bool) -> None:
        for part in par.parts:
            if hasattr(part, "set_requires_gradient_sync"):  # FSDP2 module: reduce-scatter unless deferred
                if hold:
                    from curry_train.parallel.fsdp import holds_step

                    holds_step(part, enabled, defer_reduce=defer)
                continue
            if hasattr(part, "require_backward_grad_sync"):  # DDP
                part.require_backward_grad_sync = enabled

    return set_sync


def grad_reduce_group(par: Parallelized):
    """Process group over which per-rank losses are averaged (dp x cp); None for one process."""
    if par.mesh is None:
        return None
    return dp_cp_mesh(par.mesh).get_group()
