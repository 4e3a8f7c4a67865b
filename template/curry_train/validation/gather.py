"""What the white-box reads out of the ranks (imports torch): every parameter, gradient and AdamW state tensor at
full shape under its reference name, and every rank's copy checksummed against the other replicas'.

`_local_full` / `gather_full`: parameters or gradients (DTensor.full_tensor for FSDP/TP, stage dicts merged for PP,
expert shards gathered over the ep group); `replica_copies`: the bitwise replica check (validation/compare.py,
"replicas"); `optimizer_state_full`: AdamW's exp_avg, exp_avg_sq and step of every parameter, from whichever rank
owns it (ZeRO-1's partition owner, every FSDP/TP shard), for the resume check (validation/resume.py).
"""

from __future__ import annotations

from typing import Any

import torch


def _local_full(par, which: str) -> dict[str, torch.Tensor]:
    """This rank's parameters (`which="param"`) or gradients (`"grad"`) at full shape under reference names.
    All ranks must call it: full_tensor and the EP gathers are collectives."""
    from curry_train.parallel.parallelize import canonical_name

    local: dict[str, torch.Tensor] = {}
    for part in par.parts:
        for name, p in part.named_parameters():
            t = p if which == "param" else p.grad
            if t is None:
                t = torch.zeros_like(p)
            t = t.detach()
            if hasattr(t, "full_tensor"):  # DTensor: FSDP shards and/or TP shards
                t = t.full_tensor()
            gather = getattr(p, "_curry_gather", None)  # e.g. expert shards over the ep group
            if gather is not None:
                t = gather(t)
            local[canonical_name(name)] = t.float().cpu().clone()
    return local


def _merge_on_rank0(par, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every name once, on rank 0 (pipeline stages merged); None off rank 0."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    if par.topo.pp == 1:  # every rank holds every name already
        return local if dist.get_rank() == 0 else None
    return _gather_first_holders(local)


def _gather_first_holders(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every rank's {name: tensor} merged on rank 0 (None elsewhere); a name two ranks hold keeps the lowest
    rank's copy. A collective: every rank calls it."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for d in parts:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def gather_full(par, which: str) -> dict[str, torch.Tensor] | None:
    """Every parameter or gradient at full shape under its reference name, on rank 0 (None elsewhere)."""
    return _merge_on_rank0(par, _local_full(par, which))


def checksum(t: torch.Tensor) -> tuple[int, int, int]:
    """A checksum of a tensor's bit pattern (not cryptographic: replicas that differ in any bit almost surely
    differ here). Two int64 sums of the raw 32-bit words, one position-weighted, so a swap of elements counts."""
    w = t.contiguous().view(torch.int32).flatten().to(torch.int64)
    pos = torch.arange(1, w.numel() + 1, dtype=torch.int64)
    return (w.numel(), int(w.sum()), int((w * (pos * 2654435761 % 2147483647)).sum()))


def replica_copies(local: dict[str, torch.Tensor]) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, int]]:
    """Check every rank's copy of every parameter: all ranks exchange checksums, and each copy whose bits differ
    from the first holder's (in rank order) goes to rank 0. Returns ({rank: {name: copy}}, {name: holders}) on
    rank 0, ({}, {}) elsewhere. A correct run ships no copies: replicas stay bitwise equal."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}, {k: 1 for k in local}
    rank, world = dist.get_rank(), dist.get_world_size()
    sums = {k: checksum(v) for k, v in local.items()}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, sums)
    first: dict[str, Any] = {}
    holders: dict[str, int] = {}
    for theirs in everyone:
        for k, c in theirs.items():
            first.setdefault(k, c)
            holders[k] = holders.get(k, 0) + 1
    mine = {k: v for k, v in local.items() if sums[k] != first[k]}
    got: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank != 0:
        return {}, {}
    return {r: d for r, d in enumerate(got) if d}, holders


def optimizer_state_full(par) -> dict[str, torch.Tensor] | None:
    """{"<name>.exp_avg" | "<name>.exp_avg_sq" | "<name>.step": full tensor} of every parameter with AdamW state,
    merged on rank 0 (None elsewhere), fp32 copies on the CPU. Every rank must call it (full_tensor and the
    expert gathers are collectives; ZeRO-1 state lives on its owner rank only, gathered as objects). A name two
    ranks hold (replicas) keeps the first holder's copy; `optimizer_state_full` checks nothing itself."""
    import torch.distributed as dist

    from curry_train.train.checkpoint import _adam_owners, _param_names

    # id(param) -> the AdamW that steps it here (ZeRO-1 with experts: two of them, parallel/zero.py)
    mine = {id(p): owner for owner, owned in _adam_owners(par) for p in owned}
    local: dict[str, torch.Tensor] = {}
    for name, p in _param_names(par).values():  # the parts' parameter order: the same on every rank of a stage
        st = mine[id(p)].state.get(p) if id(p) in mine else None
        for key, v in sorted((st or {}).items()):
            t = v.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            gather = getattr(p, "_curry_gather", None)
            if gather is not None and key != "step":
                t = gather(t)
            local[f"{name}.{key}"] = t.float().cpu().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    return _gather_first_holders(local)
