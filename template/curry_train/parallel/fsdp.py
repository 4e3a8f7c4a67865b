"""ZeRO-2 / ZeRO-3 with FSDP2: shard parameters, gradients and optimizer state over the dp x cp ranks.

    curry-train whitebox --config configs/tiny.yaml --set parallel.dp=2 --set parallel.zero=3 --json

Rajbhandari et al. 2019, "ZeRO" (arXiv:1910.02054), §5: P_os+g (stage 2) and P_os+g+p (stage 3). FSDP2
(`torch.distributed.fsdp.fully_shard`, Zhao et al. 2023, "PyTorch FSDP", VLDB) stores every parameter as a
DTensor `Shard(0)` over the mesh; before a unit's forward it all-gathers the unit's parameters, after its backward
it reduce-scatters the unit's gradients, so each rank keeps 1/d of params, grads and AdamW state.

  zero=2  reshard_after_forward=False: a unit's gathered parameters stay alive from its forward until its
          backward (the SHARD_GRAD_OP equivalent; no second all-gather in backward). Between steps, and during
          the optimizer step, only the shards exist.
  zero=3  reshard_after_forward=True: parameters are freed after each unit's forward and gathered again for its
          backward (FULL_SHARD). The root unit too (an explicit True overrides FSDP2's keep-the-root heuristic):
          the root is gathered for the whole forward anyway (embedding first, head last), so at most the root
          plus one block are gathered at a time.

  zero=1  (with TP; wrapping.py) Megatron's distributed optimizer (Narayanan et al. 2021, SC21; Megatron-LM
          docs "Distributed Optimizer"): reshard_after_forward=False, and on every micro-batch but the last
          neither reshard after backward nor reduce (`holds_step`): parameters stay gathered and fp32 gradients
          accumulate unsharded across the step, one reduce-scatter after the last backward, AdamW on the 1/d
          shard, and the next step's all-gather plays Megatron's parameter all-gather. Peak memory is Megatron's
          (2/4 B gathered params + 4 B grads per parameter, 12-16 B of master + AdamW / d).
  parallel.fsdp_keep_gathered (zero=2): the same without the deferred reduction: units stay gathered across
          micro-batches (one all-gather per step), gradients are still reduce-scattered every micro-batch.
  Under PP torch's schedule does both itself for every ZeRO stage (pipelining stage.py, no-sync backward).

Units: one per transformer block plus the root (embedding, final norm, LM head and whatever the blocks leave),
as torchtitan `apply_fsdp` does: the all-gather of block i+1 overlaps the compute of block i.
HSDP (parallel.dp_replicate = r > 1): the same units on a 2-D mesh (r replicas x dp*cp/r shards): parameters,
gradients and AdamW state are sharded r times less finely, and each gradient shard is all-reduced across the r
replicas after its reduce-scatter (FSDP2's HYBRID_SHARD). The shard group sits inside a node when it fits, so
only the all-reduce of shards crosses nodes.
Mixed precision (train.dtype=bfloat16): bf16 all-gather and compute, fp32 master shards, fp32 reduce-scatter
(Micikevicius et al. 2018, "Mixed Precision Training", §3: fp32 master weights and accumulation); a unit's
forward inputs are not cast (the hidden states are bf16 already, the RoPE tables stay fp32).
Composes with TP (params already DTensors on mesh["tp"] become 2-D `(_StridedShard, Shard)` params), with a
pipeline stage (tok_embeddings/norm/output may be None, `layers` a subset) and with recompute (applied first,
so a unit's recomputed forward uses the already gathered parameters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.mesh import fsdp_mesh


def fsdp_kwargs(cfg: Config) -> dict[str, Any]:
    """The fully_shard arguments every unit of this config gets (experts, blocks and the root alike)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.train.dtype == "bfloat16":
        # cast_forward_inputs=False (as torchtitan): the blocks' hidden states are bf16 already (the embedding
        # computes in bf16), and the fp32 RoPE tables the root hands every block stay fp32, shared, instead of
        # one bf16 copy per block, which RoPE would keep for backward (docs/ESTIMATION.md, "Activations")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    else:
        mp = MixedPrecisionPolicy()
    return {"reshard_after_forward": cfg.parallel.zero >= 3, "mp_policy": mp}


def holds_step(module: nn.Module, last: bool, *, defer_reduce: bool) -> None:
    """Before a micro-batch: on all but the `last`, keep `module`'s FSDP units gathered after backward and, with
    `defer_reduce` (zero=1), accumulate their gradients unsharded instead of reduce-scattering them."""
    module.set_reshard_after_backward(last)
    if defer_reduce:
        module.set_requires_gradient_sync(last)


def apply_fsdp(model: nn.Module, mesh: Any, cfg: Config) -> None:
    """Shard `model` in place: one FSDP2 unit per block, then the root, over the dp x cp mesh."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_kwargs(cfg)
    dp_mesh = fsdp_mesh(mesh, cfg.parallel.dp_replicate)  # 2-D for HSDP (mesh.py fsdp_mesh)
    if cfg.model.num_experts > 0:
        # Expert shards are summed over edp_cp, not dp_cp: they get their own units first, and the block's
        # fully_shard below skips the params those units already manage (expert_parallel.py docstring).
        from curry_train.parallel.expert_parallel import fully_shard_experts

        fully_shard_experts(model, mesh, cfg, **kwargs)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
