"""Sharded initialisation: materialise only this rank's shard of each parameter of a model built on "meta".

    python -c "from curry_train.train.loop import setup; from curry_train.config import Config; setup(Config())"

Every rank builds the model on the meta device (model/gpt.py build_meta_model: shapes, no storage), applies the
layout (PP split, TP, CP, EP, recompute, FSDP) to the storage-less model, and only then allocates and fills its
local shards, parameter by parameter (torchtitan's meta-device init; PyTorch FSDP2 docs, "meta-device
initialization"). So no rank ever holds the whole model: llama3-70b's 263 GiB of fp32 weights on every GPU
was the failure this replaces.

Layout independence: parameter `name`'s value is `gpt.init_tensor(name, global shape, seed)`, a function of
(seed, name) only. A rank generates that full tensor on the CPU, keeps the slice its layout owns
(`distribute_tensor(..., src_data_rank=None)` applies each placement locally, no communication, including
FSDP's Shard(0) and the 2-D `_StridedShard` of FSDP over TP; expert shards take rows [r*E/ep, (r+1)*E/ep)
first), copies it into its storage and drops the full tensor before the next parameter.

Init peak (measured by measure/init_memory.py, modelled by estimator/init.py):
    local shards of every parameter  +  one full fp32 parameter (the largest: the embedding or LM head)
    + one local chunk of it (the contiguous copy distribute_tensor returns)  +  the RoPE tables  +  4 KiB
    (scalars and bookkeeping; measured 16 B at dp=4 ZeRO-3, tests/test_sharded_init.py).
DDP (zero 0/1) replicates the model, so its "local shard" is the whole (stage) model: materialised before the
DDP wrap, whose constructor broadcasts from rank 0 (a no-op in value: every rank computed the same numbers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.model.gpt import build_meta_model, init_tensor, reset_buffers

# Wrapper prefixes that DDP / checkpoint_wrapper / torch.compile add to parameter names.
_WRAPPER_PREFIXES = ("module.", "_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Map a wrapped parameter name back to the reference model's name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def global_shapes(cfg: Config) -> dict[str, torch.Size]:
    """Reference parameter name -> full shape (from a meta model: no storage)."""
    return {n: p.shape for n, p in build_meta_model(cfg).named_parameters()}


def is_meta(model: nn.Module) -> bool:
    return any(_local(p).is_meta for p in model.parameters())


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _ep_rows(cfg: Config, mesh: Any) -> tuple[int, int]:
    """Expert rows [lo, hi) this rank's EP shard holds (expert_parallel.apply_ep keeps the same slice)."""
    from curry_train.mesh import ep_meshes

    el = cfg.model.num_experts // cfg.parallel.ep
    r = ep_meshes(mesh, cfg.parallel.ep)[0].get_local_rank()
    return r * el, (r + 1) * el


def local_value(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of `full` (the reference tensor, after any EP row slice) that parameter `p` holds here."""
    if hasattr(p, "device_mesh"):  # DTensor: TP, FSDP, or both
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def materialize(model: nn.Module, cfg: Config, device: torch.device, mesh: Any = None,
                shapes: dict[str, torch.Size] | None = None) -> nn.Module:
    """Allocate `model`'s (already sharded) parameters on `device` and fill each with its slice of the
    reference initial value. Returns `model`. Every rank may call it independently (no collective)."""
    shapes = shapes or global_shapes(cfg)
    # FSDP2's to_empty re-creates its sharded Parameters: carry over the markers the layout put on them
    # (expert_parallel's `_curry_expert` / `_curry_gather`), which the white-box gather and EP rely on.
    marks = {n: {k: v for k, v in vars(p).items() if k.startswith("_curry_")} for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for n, p in model.named_parameters():
        for k, v in marks.get(n, {}).items():
            setattr(p, k, v)
    ep_rows = None
    for name, p in model.named_parameters():
        ref = canonical_name(name)
        if ref not in shapes:
            raise KeyError(f"parameter {name!r} (reference name {ref!r}) is not in the reference model")
        full = init_tensor(ref, shapes[ref], cfg.model, cfg.train.seed)
        if getattr(p, "_curry_expert", False) and cfg.parallel.ep > 1:
            ep_rows = ep_rows or _ep_rows(cfg, mesh)
            full = full[ep_rows[0]:ep_rows[1]]
        dst = _local(p)
        src = local_value(p, full)
        if src.shape != dst.shape:
            raise RuntimeError(f"materialize {ref}: local shard {tuple(dst.shape)} but layout gives "
                               f"{tuple(src.shape)} from the full {tuple(shapes[ref])}")
        dst.copy_(src)
        del full, src
    for m in model.modules():
        reset_buffers(m)
    return model
