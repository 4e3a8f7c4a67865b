"""Expert parallel: shard each MoE layer's experts over an EP group carved from the data-parallel ranks.

    curry-train whitebox --config configs/tiny-moe.yaml --set parallel.dp=2 --set parallel.ep=2 --json

Shape legend: E experts, El = E / ep experts per rank, D d_model, F d_ff.

GShard (Lepikhin et al. 2020, §2.2-2.3): ep consecutive dp ranks hold E/ep experts each; every rank routes its
own tokens, an all-to-all sends each kept slot to the rank owning its expert, and a second all-to-all brings the
outputs back (moe.MoE._run_experts; comms.all_to_all, the functional all-to-all, is differentiable with uneven
splits and its output is what selective recompute saves: docs/ARCHITECTURE.md#recompute).

Gradients. Non-expert parameters are replicated over dp x cp and averaged there as usual. An expert shard on
rank j already holds the gradient of *every* EP peer's tokens (the all-to-all's backward brought it home), so it
is summed only over "edp_cp" (mesh.ep_meshes: the dp/ep x cp ranks holding the same experts) and divided by
dp * cp, the same mean-over-ranks the rest of the model gets:
  * DDP (fp32 zero 0/1): the expert params are on DDP's ignore list (ddp.py calls `exclude_experts_from_ddp`);
    `sync_expert_grads` all-reduces them over edp_cp at the end of the backward in which DDP syncs (the same
    `require_backward_grad_sync` flag), one flat all-reduce per backward. ZeRO-1 (zero.py) shards their AdamW
    state over edp_cp too, with a ZeroRedundancyOptimizer of their own: its broadcast then copies an update
    only to the ranks holding the same experts.
  FSDP2 (zero 2/3, and every bf16 layout: wrapping.py): fsdp.py calls `fully_shard_experts` before wrapping the blocks:
    each Experts module gets its own FSDP unit over edp_cp with gradient divide factor dp * cp (torchtitan's MoE
    layout); the block's fully_shard then skips those already-managed params. Sharded on the expert dim when El % edp_cp
    == 0, else on a hidden dim (expert_shard_placement), so a rank holds 1/(ep * edp_cp) of the experts. Under HSDP
    (dp_replicate > 1) the unit's mesh is edp_cp as (replicas, shard) (mesh.expert_fsdp_mesh): sharded inside a replica
    group, all-reduced across them, still divided by dp * cp. bf16's ZeRO-0 makes every holder a replica (edp_cp, 1):
    the expert units all-reduce over their holders, as DDP's expert sync does.
ep = 1 changes nothing: the experts are ordinary replicated params under DDP/FSDP.

White-box: each expert param carries `_curry_gather` (all-gather over the ep group, dim 0), which maps the
local [El, ...] (after FSDP's full_tensor) to the reference's full [E, ...].
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.mesh import ep_meshes, expert_fsdp_mesh
from curry_train.model.moe import moe_layers
from curry_train.parallel import comms
from curry_train.rules import ep_spans_tp


def _mark_expert_params(experts: nn.Module, ep_group: Any) -> None:
    for p in experts.parameters():
        p._curry_gather = partial(comms.all_gather_dim0, group=ep_group)
        p._curry_expert = True


def apply_ep(model: nn.Module, mesh: Any, cfg: Config) -> None:
    """Keep this rank's El experts of every MoE layer and route through the ep group, in place."""
    ep = cfg.parallel.ep
    if ep == 1:
        return
    # with tp > 1 the ep group spans the tp ranks (mesh.ep_meshes), each routing its T/tp shard: sp=true is
    # required before launch (curry_train/rules/validity.py: check)
    ep_mesh, _ = ep_meshes(mesh, ep)
    group, rank = ep_mesh.get_group(), ep_mesh.get_local_rank()
    El = cfg.model.num_experts // ep
    tp_group = mesh["tp"].get_group() if ep_spans_tp(cfg.model.num_experts, cfg.parallel.tp, ep) else None
    for _, moe in moe_layers(model):
        moe.ep_group = group
        moe.router.tp_group = tp_group  # TP + EP: the router's gradient and aux-loss statistics over tp
        for name, full in list(moe.experts.named_parameters()):
            # rank `rank` of the group owns experts [rank*El, (rank+1)*El), sliced from the seeded full tensor
            setattr(moe.experts, name, nn.Parameter(full.detach()[rank * El : (rank + 1) * El].clone()))
        _mark_expert_params(moe.experts, group)


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_curry_expert", False))


# --------------------------------------------------------------------------- DDP (zero 0 / 1)


def exclude_experts_from_ddp(model: nn.Module) -> list[str]:
    """Put the sharded expert params on DDP's ignore list (names as DDP will see them: call right before
    wrapping). Keeps any names already there (the white-box fault injector uses the same list)."""
    names = [n for n, p in model.named_parameters() if is_expert_param(p)]
    if names:
        from torch.nn.parallel import DistributedDataParallel

        old = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(old) | set(names)))
    return names


def sync_expert_grads(ddp: nn.Module, mesh: Any, cfg: Config) -> None:
    """Sum expert grads over edp_cp and divide by dp*cp at the end of each backward in which `ddp` syncs."""
    params = [p for p in ddp.module.parameters() if is_expert_param(p)]
    if not params:
        return
    _, edp = ep_meshes(mesh, cfg.parallel.ep)
    group, scale = edp.get_group(), 1.0 / (cfg.parallel.dp * cfg.parallel.cp)
    state = {"queued": False}

    def reduce_all() -> None:
        state["queued"] = False
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        comms.all_reduce_sum_scaled_([p.grad for p in params], group, scale)

    def hook(_: torch.Tensor) -> None:
        # First expert grad of a syncing backward: reduce all of them once autograd finishes (DDP queues its
        # own bucket finalisation the same way). Under a pipeline schedule the flag stays False (the schedule
        # arms DDP's reducer directly, torch pipelining stage.backward_maybe_with_nosync), so the pipeline
        # calls `_curry_reduce_experts` itself after the step (pipeline.finish_expert_grads).
        if ddp.require_backward_grad_sync and not getattr(ddp, "_curry_manual_expert_sync", False) \
                and not state["queued"]:
            state["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(reduce_all)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    ddp._curry_reduce_experts = reduce_all


# --------------------------------------------------------------------------- FSDP2 (zero 2 / 3)


def expert_shard_placement(local_experts: int, edp: int) -> Any:
    """FSDP2 placement of a stacked expert weight [El, D, F] over the edp ranks: dim 0 (whole experts) when
    they split evenly, else dim 1 (a hidden dimension), so every rank holds 1/(ep * edp) of the expert weights
    whatever the ratio of experts to ranks (torchtitan's `shard_placement_fn` for MoE under FSDP2). Sharding
    dim 0 with El < edp would leave some ranks only padding and others whole experts."""
    from torch.distributed.tensor import Shard

    return Shard(0) if local_experts % edp == 0 else Shard(1)


def fully_shard_experts(model: nn.Module, mesh: Any, cfg: Config, replicas: int, **fsdp_kwargs: Any) -> None:
    """Give every Experts module its own FSDP2 unit over edp_cp (call before fully_shard of the blocks, with the
    same mp_policy / reshard_after_forward; `replicas`: the dense units' replica groups, parallel/fsdp.py
    replicas). Divides gradients by dp*cp with sum-only collectives."""
    if cfg.parallel.ep == 1:
        return
    from torch.distributed.fsdp import fully_shard

    ep_mesh, _ = ep_meshes(mesh, cfg.parallel.ep)
    edp = expert_fsdp_mesh(mesh, cfg.parallel.ep, replicas)  # 2-D under HSDP and bf16 ZeRO-0 (mesh.py)
    shard = edp.size(edp.ndim - 1)  # the ranks an expert weight is split over (HSDP: inside one replica group)
    placement = expert_shard_placement(cfg.model.num_experts // cfg.parallel.ep, shard)
    for _, moe in moe_layers(model):
        fully_shard(moe.experts, mesh=edp, shard_placement_fn=lambda _p, pl=placement: pl, **fsdp_kwargs)
        # FSDP2 would divide by its mesh's size (dp*cp/ep); the gradient holds the tokens of all dp*cp ranks
        # (the all-to-all's backward brought the EP peers' home), so the mean divides by dp*cp (torchtitan's
        # fsdp_gradient_divide_factor for the experts), HSDP's replicas included.
        moe.experts.set_gradient_divide_factor(float(cfg.parallel.dp * cfg.parallel.cp))
        if shard > 1:
            # gloo has no PREMUL_SUM: reduce with SUM, then divide. Not when the reduce-scatter group is one
            # rank, where FSDP2 (torch 2.13 _fsdp_collectives.foreach_reduce) divides in its copy branch and
            # would divide again after the sum; there only HSDP's all-reduce (SUM) runs, after that division.
            moe.experts.set_force_sum_reduction_for_comms(True)
        _mark_expert_params(moe.experts, ep_mesh.get_group())  # fully_shard replaced the Parameters
