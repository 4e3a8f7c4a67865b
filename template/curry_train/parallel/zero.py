"""ZeRO-1: shard the AdamW state over the dp x cp ranks; parameters and gradients stay replicated (DDP).

    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --set parallel.zero=1 --json

Rajbhandari et al. 2019, "ZeRO" (arXiv:1910.02054), §5.1 P_os: each rank keeps the optimizer state of 1/d of
the parameters, steps only those, then broadcasts its updated parameters to the other ranks. torch's
`ZeroRedundancyOptimizer` partitions whole parameters greedily (largest first, onto the least-loaded rank), so a
rank's share of the state is 1/d up to the size of one parameter. Gradients are still all-reduced by DDP
(parallel/ddp.py): the communication volume equals DDP's (ZeRO §7), the state memory drops from 8N to ~8N/d bytes.

DDP cannot hold DTensor (TP) parameters: with tp > 1, zero=1 runs on FSDP2 instead (Megatron's distributed
optimizer, parallel/fsdp.py holds_step; wrapping.py), and config.check rejects zero=0 with tp > 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from curry_train.config import Config
from curry_train.mesh import dp_cp_mesh


def build_zero1_optimizer(params: Iterable[torch.Tensor], mesh: Any, cfg: Config) -> ZeroRedundancyOptimizer:
    """AdamW whose state is partitioned over the dp x cp group of `mesh` (every rank must call this)."""
    from curry_train.train.optim import adamw_kwargs

    params = list(params)
    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=torch.optim.AdamW,
        process_group=dp_cp_mesh(mesh).get_group(),
        parameters_as_bucket_view=False,  # per-parameter broadcasts: no persistent flat copy of the params
        **adamw_kwargs(params, cfg),  # its local shard's AdamW: fused on CUDA (train/optim.py)
    )
