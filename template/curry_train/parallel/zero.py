"""ZeRO-1: shard the AdamW state over the dp x cp ranks; parameters and gradients stay replicated (DDP).

    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --set parallel.zero=1 --json

Rajbhandari et al. 2019, "ZeRO" (arXiv:1910.02054), §5.1 P_os: each rank keeps the optimizer state of 1/d of
the parameters, steps only those, then broadcasts its updated parameters to the other ranks. torch's
`ZeroRedundancyOptimizer` partitions whole parameters greedily (largest first, onto the least-loaded rank), so a
rank's share of the state is 1/d up to the size of one parameter. Gradients are still all-reduced by DDP
(parallel/ddp.py): the communication volume equals DDP's (ZeRO §7), the state memory drops from 8N to ~8N/d bytes.

DDP cannot hold DTensor (TP) parameters: with tp > 1, zero=1 runs on FSDP2 instead (Megatron's distributed
optimizer, parallel/fsdp.py holds_step; wrapping.py), and config.check rejects zero=0 with tp > 1.

Expert parallel (ep > 1): an expert shard differs between the ranks of an EP group, so one partition over dp x cp
would broadcast one rank's experts over another's. The expert params get a ZeroRedundancyOptimizer of their own
over "edp_cp" (mesh.ep_meshes: the ranks holding the same experts, over which their gradients are all-reduced,
parallel/expert_parallel.py), the rest one over dp x cp, as DeepSpeed's MoE splits its ZeRO optimizer's groups by
expert-data-parallel group (DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv:2201.05596): a rank keeps the AdamW
state of ~1/edp_cp of its El experts and ~1/(dp*cp) of the rest.
`ZeroGroups` steps both as one optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from curry_train.config import Config
from curry_train.mesh import dp_cp_mesh, ep_meshes


class ZeroGroups:
    """Several ZeroRedundancyOptimizers over disjoint parameters and groups, stepped as one optimizer: what
    train/optim.optimizer_step (param_groups' lr, step), zero_grad, the checkpoint and the memory tracker
    (`optims`: each one's local AdamW is its `.optim`) read."""

    def __init__(self, optims: list[ZeroRedundancyOptimizer]) -> None:
        self.optims = optims

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optims for g in o.param_groups]

    def step(self) -> None:
        for o in self.optims:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optims:
            o.zero_grad(set_to_none=set_to_none)


def zero_optimizers(opt: Any) -> list[Any]:
    """The ZeroRedundancyOptimizers (or the one plain optimizer) behind `opt`."""
    return list(getattr(opt, "optims", [opt]))


def _zero(params: list[torch.Tensor], group: Any, cfg: Config) -> ZeroRedundancyOptimizer:
    from curry_train.train.optim import adamw_kwargs

    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=torch.optim.AdamW,
        process_group=group,
        parameters_as_bucket_view=False,  # per-parameter broadcasts: no persistent flat copy of the params
        **adamw_kwargs(params, cfg),  # its local shard's AdamW: fused on CUDA (train/optim.py)
    )


def build_zero1_optimizer(params: Iterable[torch.Tensor], mesh: Any, cfg: Config) -> Any:
    """AdamW whose state is partitioned over the dp x cp group of `mesh`, and with ep > 1 the experts' over
    their edp_cp group (every rank must call this)."""
    params = list(params)
    experts = [p for p in params if getattr(p, "_curry_expert", False)] if cfg.parallel.ep > 1 else []
    if not experts:
        return _zero(params, dp_cp_mesh(mesh).get_group(), cfg)
    dense = [p for p in params if not getattr(p, "_curry_expert", False)]
    edp = ep_meshes(mesh, cfg.parallel.ep)[1]
    return ZeroGroups([_zero(dense, dp_cp_mesh(mesh).get_group(), cfg), _zero(experts, edp.get_group(), cfg)])
