"""What a GPU budget keeps free of the estimate: outside torch's caching allocator, and its fragmentation.

    python -c "from curry_train.config import load_config; from curry_train.estimator import reserve_bytes; \
print(reserve_bytes(load_config('configs/llama3-8b.yaml')) / 2**30)"

reserve = CUDA_CONTEXT_RESERVE_GIB (the CUDA context, cuBLAS / cuDNN workspaces) + FRAGMENTATION_RESERVE of the
budget (Megatron adds 5%) + NCCL_COMMUNICATOR_MIB per NCCL communicator the rank's mesh uses (`communicators`).
NCCL allocates each communicator's buffers outside the allocator, per channel and per connected peer: the
Simple protocol's NCCL_BUFFSIZE (4 MiB by default), LL128's and LL's beside it
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize), so a rank in four groups
holds four sets. The per-communicator number is ASSUMED until a GPU calibrates it, and is the floor (2 channels;
NCCL opens more on NVLink, and NVLS buffers beside them), so a layout near the limit may still not fit.
`bench` on CUDA reports `device_used_at_peak_bytes - max_memory_reserved_bytes` (measure/memory.cuda_device_view),
which is this reserve's non-fragmentation part (docs/ESTIMATION.md#reserve). On CPU the reserve is 0: the
measurement counts live tensor bytes exactly.
"""

from __future__ import annotations

from curry_train.estimator.layout import GiB, Layout

CUDA_CONTEXT_RESERVE_GIB = 2.0  # CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator
FRAGMENTATION_RESERVE = 0.05  # caching-allocator fragmentation (Megatron adds 5%)
NCCL_COMMUNICATOR_MIB = 32  # ASSUMED per communicator: its floor, 2 channels x 2 peers x ~8 MiB of buffers


def communicators(layout: Layout) -> int:
    """NCCL communicators one rank initialises: the process groups it communicates over (NCCL creates a
    communicator at a group's first collective), a group spanning every rank being the default one.
    mesh.build_mesh's groups: tp, cp (the ring), the gradient group dp x cp (under HSDP its shard and replica
    groups instead), ep and its edp x cp complement, and under a pipeline a pair communicator per neighbouring
    stage."""
    world = layout.dp * layout.tp * layout.pp * layout.cp
    if world == 1:
        return 0
    dpcp = layout.dp * layout.cp
    grad = [dpcp // layout.dp_replicate, layout.dp_replicate] if layout.dp_replicate > 1 else [dpcp]
    expert = [layout.ep, dpcp // layout.ep] if layout.ep > 1 else []
    sizes = [layout.tp, layout.cp, *grad, *expert]
    n = 1 + sum(1 for s in sizes if 1 < s < world)  # the default group + every smaller one
    if layout.pp > 1:  # torch's NCCL p2p opens one communicator per pair of peers: the stage's neighbours
        n += min(layout.pp - 1, 2)
    return n


def reserve_of(layout: Layout) -> int:
    """The bytes the estimate keeps free on one rank (0 on CPU)."""
    if layout.device == "cpu":
        return 0
    return int(CUDA_CONTEXT_RESERVE_GIB * GiB + FRAGMENTATION_RESERVE * layout.gpu_memory_gib * GiB
               + communicators(layout) * NCCL_COMMUNICATOR_MIB * 2**20)
