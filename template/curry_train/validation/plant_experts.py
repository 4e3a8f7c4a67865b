"""Planters of the expert-gradient bugs of ZeRO-1 and HSDP with expert parallel (validation/inject.py CATALOGUE;
plant.planted applies them, imports torch): what parallel/expert_parallel.py and parallel/zero.py must not do.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from curry_train.config import Config
from curry_train.validation.inject import InjectionError
from curry_train.validation.planting import Planted, _patch


def _is_expert_unit(module: Any) -> bool:
    return any(getattr(p, "_curry_expert", False) for p in module.parameters(recurse=False))


def ep_expert_ep_averaged(stack, cfg: Config, target: str | None) -> Planted:
    """After their reduction, the expert gradients are also averaged over the EP group, as if the EP ranks' expert
    shards were replicas of one tensor (the bug of putting the experts in the dense gradient group): each rank's
    experts step on the mean of every EP peer's experts' gradients. DDP / ZeRO-1: after expert_parallel's
    all-reduce over edp_cp (comms.all_reduce_sum_scaled_, which only it calls); FSDP2 / HSDP: the expert units'
    all-reduce hook (FSDPModule.set_all_reduce_hook, run on each reduced gradient shard)."""
    from curry_train.mesh import ep_meshes
    from curry_train.parallel import comms

    ep_group: dict[str, Any] = {}
    exact = comms.all_reduce_sum_scaled_

    def average(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ep_group["group"])  # gloo has no AVG
        t.div_(cfg.parallel.ep)

    def reduce_then_average(tensors: list[torch.Tensor], group: Any, scale: float) -> None:
        exact(tensors, group, scale)
        for t in tensors:
            average(t)

    _patch(stack, comms, "all_reduce_sum_scaled_", reduce_then_average)

    def after(par: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        ep_group["group"] = ep_meshes(par.mesh, cfg.parallel.ep)[0].get_group()
        for part in par.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule) and _is_expert_unit(m):
                    m.set_all_reduce_hook(average)

    return Planted(after_setup=after)


def hsdp_expert_no_replica_allreduce(stack, cfg: Config, target: str | None) -> Planted:
    """HSDP whose expert units skip the all-reduce across the replica groups (the dense units keep it): an expert
    mesh built 1-D over one replica's holders, or a hand-built expert reduction that forgot the replicas. Each
    replica's experts step on its own half of the batch. Patched as hsdp-no-replica-allreduce is (FSDP2's
    foreach_reduce, where _fsdp_param_group.post_backward looks it up), for the expert units only."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    exact = _fsdp_param_group.foreach_reduce
    sig = inspect.signature(exact)
    if "all_reduce_group" not in sig.parameters or "fsdp_params" not in sig.parameters:
        raise InjectionError(f"hsdp-expert-no-replica-allreduce: torch {torch.__version__}'s FSDP2 foreach_reduce "
                             "changed its arguments; the planter in validation/plant_experts.py needs updating")

    def no_expert_replica_all_reduce(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        if any(getattr(fp.sharded_param, "_curry_expert", False) for fp in bound.arguments["fsdp_params"]):
            bound.arguments["all_reduce_group"] = None
        return exact(*bound.args, **bound.kwargs)

    _patch(stack, _fsdp_param_group, "foreach_reduce", no_expert_replica_all_reduce)
    return Planted()


PLANTERS = {
    "ep-expert-ep-averaged": ep_expert_ep_averaged,
    "hsdp-expert-no-replica-allreduce": hsdp_expert_no_replica_allreduce,
}
