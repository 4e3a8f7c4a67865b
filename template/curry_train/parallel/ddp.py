"""DDP: replicate the model on every dp x cp rank and average gradients with bucketed all-reduces.

Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB), §3.2:
gradients are all-reduced in buckets during backward, overlapping communication with the rest of backward.
ZeRO-1 (parallel/zero.py) keeps this wrapper and shards only the optimizer state.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from curry_train.config import Config
from curry_train.mesh import dp_cp_mesh


def apply_ddp(model: nn.Module, mesh: Any, cfg: Config) -> nn.Module:
    """Wrap `model` in DDP over the dp x cp ranks. Returns the wrapper (names gain a `module.` prefix).

    CPU: no device_ids. CUDA: the module already lives on this rank's device, which DDP infers.
    """
    from curry_train.parallel.expert_parallel import exclude_experts_from_ddp, sync_expert_grads

    group = dp_cp_mesh(mesh).get_group()
    exclude_experts_from_ddp(model)  # EP: expert shards differ per rank; reduced over edp by sync_expert_grads
    # broadcast_buffers=False: the only buffers are the RoPE tables, identical on every rank by construction.
    # gradient_as_bucket_view=True: each .grad is a view into DDP's flat all-reduce bucket instead of a second
    # fp32 copy of every gradient (+4 B/param: 29.9 GiB at llama3-8b; torch DDP docs, gradient_as_bucket_view).
    ddp = DistributedDataParallel(model, process_group=group, broadcast_buffers=False, gradient_as_bucket_view=True)
    sync_expert_grads(ddp, mesh, cfg)  # EP (expert_parallel.py): no-op without sharded experts
    return ddp
