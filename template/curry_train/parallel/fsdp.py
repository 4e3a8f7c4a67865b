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
          backward (FULL_SHARD), except the [norm, output] unit, which the backward needs at once, and except
          under a pipeline, where parallel.fsdp_reshard=default keeps every unit gathered for the step (each
          micro-batch's forward would gather it again); the rule and its policy: curry_train/fsdp_units.py.

  zero=1  (bf16, or fp32 with TP; wrapping.py) Megatron's distributed optimizer (Narayanan et al. 2021, SC21;
          Megatron-LM docs "Distributed Optimizer"): reshard_after_forward=False, and on every micro-batch but the last
          neither reshard after backward nor reduce (`holds_step`): parameters stay gathered and fp32 gradients
          accumulate unsharded across the step, one reduce-scatter after the last backward, AdamW on the 1/d
          shard, and the next step's all-gather plays Megatron's parameter all-gather. Peak memory is Megatron's
          (2/4 B gathered params + 4 B grads per parameter, 12-16 B of master + AdamW / d).
  zero=0  (bf16; wrapping.py) dp x cp replicas of one shard: a 2-D mesh (dp*cp, 1) whose shard groups are one
          rank (FSDP2 copies there instead of gathering), holding the step as zero=1 does, so the fp32 gradients
          accumulate unsharded and are all-reduced across the replicas once per step (DDP's no-sync accumulation),
          with bf16 compute parameters and fp32 masters. At dp*cp = 1 every stage is this one rank's own unit.
  parallel.fsdp_keep_gathered (zero=2): the same without the deferred reduction: units stay gathered across
          micro-batches (one all-gather per step), gradients are still reduce-scattered every micro-batch.
  Under PP torch's schedule does both itself for every ZeRO stage (pipelining stage.py, no-sync backward).

Units, as torchtitan's apply_fsdp_to_decoder splits them (fsdp_units.py): the experts (EP), the token embedding,
each transformer block, [norm, output] and the root, in that order; the all-gather of block i+1 overlaps the
compute of block i, and the embedding is not held while the blocks run.
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
from curry_train.fsdp_units import reshard_after_forward
from curry_train.mesh import fsdp_mesh
from curry_train.wrapping import fsdp_replicas


def replicas(cfg: Config) -> int:
    """FSDP2's replica groups over dp x cp for this config (wrapping.fsdp_replicas: HSDP's, bf16 ZeRO-0's dp*cp;
    1 when FSDP2 does not wrap the layout): the first dimension of the mesh it shards over (mesh.fsdp_mesh)."""
    p = cfg.parallel
    return fsdp_replicas(p.dp, p.cp, p.zero, p.tp, cfg.train.dtype, p.dp_replicate)


def fsdp_kwargs(cfg: Config) -> dict[str, Any]:
    """The fully_shard arguments of this config's units: the blocks' reshard_after_forward (apply_fsdp sets the
    embedding's and the head's from fsdp_units.py) and the mixed-precision policy every unit gets."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.train.dtype == "bfloat16":
        # cast_forward_inputs=False (as torchtitan): the blocks' hidden states are bf16 already (the embedding
        # computes in bf16), and the fp32 RoPE tables the root hands every block stay fp32, shared, instead of
        # one bf16 copy per block, which RoPE would keep for backward (docs/ESTIMATION.md, "Activations")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    else:
        mp = MixedPrecisionPolicy()
    p = cfg.parallel
    return {"reshard_after_forward": reshard_after_forward(p.zero, p.pp, p.fsdp_reshard, "block"), "mp_policy": mp}


def holds_step(module: nn.Module, last: bool, *, defer_reduce: bool) -> None:
    """Before a micro-batch: on all but the `last`, keep `module`'s FSDP units gathered after backward and, with
    `defer_reduce` (zero=1), accumulate their gradients unsharded instead of reduce-scattering them."""
    module.set_reshard_after_backward(last)
    if defer_reduce:
        module.set_requires_gradient_sync(last)


def apply_fsdp(model: nn.Module, mesh: Any, cfg: Config) -> None:
    """Shard `model` in place over the dp x cp mesh: experts (EP), embedding, each block, [norm, output], root."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_kwargs(cfg)
    p = cfg.parallel
    dp_mesh = fsdp_mesh(mesh, replicas(cfg))  # 2-D for HSDP and bf16 ZeRO-0's replicas (mesh.py fsdp_mesh)

    def unit(modules: Any, name: str) -> None:
        flag = reshard_after_forward(p.zero, p.pp, p.fsdp_reshard, name)  # fsdp_units.py: the one rule
        fully_shard(modules, mesh=dp_mesh, **{**kwargs, "reshard_after_forward": flag})

    if cfg.model.num_experts > 0:
        # Expert shards are summed over edp_cp, not dp_cp: they get their own units first, and the block's
        # fully_shard below skips the params those units already manage (expert_parallel.py docstring).
        from curry_train.parallel.expert_parallel import fully_shard_experts

        fully_shard_experts(model, mesh, cfg, replicas(cfg), **kwargs)
    if model.tok_embeddings is not None:  # (the model's head is untied: model/gpt.py)
        unit(model.tok_embeddings, "embed")
    for block in model.layers.values():
        unit(block, "block")
    head = [m for m in (model.norm, model.output) if m is not None]
    if head:
        unit(head if len(head) > 1 else head[0], "head")
    unit(model, "root")
