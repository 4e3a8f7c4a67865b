"""Sharded initialisation: materialise only this rank's shard of each parameter of a model built on "meta".

    python -c "from curry_train.train.loop import setup; from curry_train.config import Config; setup(Config())"

Every rank builds the model on the meta device (model/gpt.py build_meta_model: shapes, no storage), applies the
layout (PP split, TP, CP, EP, recompute, FSDP) to the storage-less model, and only then allocates and fills its
local shards, parameter by parameter (torchtitan's meta-device init; PyTorch FSDP2 docs, "meta-device
initialization"). So no rank ever holds the whole model: llama3-70b's 263 GiB of fp32 weights on every GPU
was the failure this replaces.

Layout independence: parameter `name`'s value is `gpt.init_tensor(name, global shape, seed)`, a function of
(seed, name) only, drawn by the host (CPU) generator whatever the device: CUDA ranks use the same stream and copy
their rows to the device, so the single-device reference, every layout and every device start from the same bits.
(A CUDA Philox stream would be faster, but which element a thread draws depends on the launch grid, i.e. on the
GPU's SM count: values would change with the GPU model. docs/ARCHITECTURE.md#sharded-initialisation.)

Two paths per parameter:
  own rows   without TP, a parameter this rank holds as a contiguous block of rows (a replicated DDP parameter:
             all of them; FSDP2's Shard(0) chunk; an expert's EP rows, or FSDP's Shard(0) chunk of them) draws just
             those rows, straight into its local storage (`gpt.init_rows_into`: the generator skips the earlier
             draws through that storage), when the RNG's 16-draw blocks allow it (`wrapping.rows_drawn_exactly`;
             every width of a real model does). No full tensor, no extra buffer; ones (norms) are filled.
  full draw  otherwise (TP's column/row splits, FSDP over TP's `_StridedShard`, an expert sharded on a hidden dim):
             the full tensor on the host, the local slice cut by `distribute_tensor(..., src_data_rank=None)`
             (each placement applied locally, no communication), copied in, dropped before the next parameter.

Init peak (measured by measure/init_memory.py, modelled by estimator/init.py):
    local shards of every parameter  +  for the full-draw parameters, the largest one in full plus one local
    chunk of it (the contiguous copy distribute_tensor returns)  +  the RoPE tables  +  4 KiB
    (scalars and bookkeeping; measured 16 B at dp=4 ZeRO-3, tests/test_sharded_init.py).
DDP (fp32 zero 0/1) replicates the model, so its "local shard" is the whole (stage) model: materialised before the
DDP wrap, whose constructor broadcasts from rank 0 (a no-op in value: every rank computed the same numbers). bf16's
ZeRO-0 replicas are FSDP2 units on a (dp*cp, 1) mesh, (Replicate, Shard(0)): their Shard(0) chunk is every row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from curry_train.config import Config
from curry_train.model.gpt import build_meta_model, drawn, init_rows_into, init_tensor, reset_buffers
from curry_train.wrapping import chunk_rows, rows_drawn_exactly

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


def own_rows(p: torch.Tensor, ref: str, shape: torch.Size, cfg: Config, ep_rows: tuple[int, int] | None,
             ) -> tuple[int, int] | None:
    """Rows [lo, hi) of the full parameter that `p` holds here when it can draw them alone, else None (the
    module docstring's two paths). `ep_rows`: this rank's expert rows when `p` is an EP-sliced expert weight."""
    if cfg.parallel.tp > 1:
        return None
    lo, hi = ep_rows or (0, shape[0])
    if hasattr(p, "device_mesh"):  # FSDP2 (1-D, or HSDP's (Replicate, Shard(0)))
        from torch.distributed.tensor import Shard

        shards = [(i, pl) for i, pl in enumerate(p.placements) if not pl.is_replicate()]
        if len(shards) != 1 or type(shards[0][1]) is not Shard or shards[0][1].dim != 0:
            return None
        i = shards[0][0]
        a, b = chunk_rows(hi - lo, p.device_mesh.size(i), p.device_mesh.get_local_rank(i))
        lo, hi = lo + a, lo + b
    if not drawn(ref, cfg.model):
        return lo, hi
    return (lo, hi) if rows_drawn_exactly(shape[0], shape[1:].numel(), lo, hi) else None


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
        expert = getattr(p, "_curry_expert", False) and cfg.parallel.ep > 1
        if expert:
            ep_rows = ep_rows or _ep_rows(cfg, mesh)
        dst = _local(p)
        rows = own_rows(p, ref, shapes[ref], cfg, ep_rows if expert else None)
        if rows is not None:  # draw only this rank's rows, into its own storage where it can
            if tuple(dst.shape) != (rows[1] - rows[0], *shapes[ref][1:]):
                raise RuntimeError(f"materialize {ref}: local shard {tuple(dst.shape)} is not rows {rows} of "
                                   f"the full {tuple(shapes[ref])}")
            host = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty(dst.shape)
            init_rows_into(host, ref, shapes[ref], cfg.model, cfg.train.seed, rows[0])
            if host is not dst:
                dst.copy_(host)
            del host
            continue
        full = init_tensor(ref, shapes[ref], cfg.model, cfg.train.seed)
        if expert:
            full = full[ep_rows[0]:ep_rows[1]]
        src = local_value(p, full)
        if src.shape != dst.shape:
            raise RuntimeError(f"materialize {ref}: local shard {tuple(dst.shape)} but layout gives "
                               f"{tuple(src.shape)} from the full {tuple(shapes[ref])}")
        dst.copy_(src)
        del full, src
    for m in model.modules():
        reset_buffers(m)
    return model
