"""Model states of one pipeline rank for the estimator: fp32 params, gradients, AdamW state and the buffers
around them (DDP buckets, ZeroRedundancyOptimizer's greedy partition, FSDP2's padded shards and gathered units).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from curry_train.estimator.layout import LAYOUT_CACHE, Layout, _block_tensors, _root_tensors, _Tensor, block_kinds
from curry_train.wrapping import shards_optimizer_only


@lru_cache(maxsize=4096)
def _zero1_shares(numels: tuple[int, ...], local: tuple[int, ...], world: int) -> tuple[tuple[int, int], ...]:
    """(sum of `local` sizes, tensor count) per rank under ZeroRedundancyOptimizer's partition: parameters sorted
    by (global) numel, largest first, each to the rank with the smallest total so far (first such rank)."""
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    heap = [(0, r) for r in range(world)]
    owned, count = [0] * world, [0] * world
    for i in order:
        size, r = heapq.heappop(heap)
        owned[r] += local[i]
        count[r] += 1
        heapq.heappush(heap, (size + numels[i], r))
    return tuple(zip(owned, count, strict=True))


def _zero1_max_share(numels: tuple[int, ...], local: tuple[int, ...], world: int) -> int:
    """Largest per-rank sum of `local` sizes under ZeroRedundancyOptimizer's partition."""
    return max(o for o, _ in _zero1_shares(numels, local, world))


def _zero1_expert_opt(layout: Layout, dense: list[_Tensor], experts: list[_Tensor], step_bytes: int) -> tuple[int, int]:
    """(AdamW bytes, owned parameters) of the worst rank under ZeRO-1 with ep > 1 (parallel/zero.py): the dense
    tensors partitioned over dp x cp, the expert shards (local [El, ...] sizes) over their edp_cp holders; dp x
    cp rank d*cp + c is edp_cp rank (d // ep)*cp + c (mesh.ep_meshes)."""
    d_sh = _zero1_shares(tuple(g if r > 1 else d0 for d0, r, g, _ in dense), tuple(d0 * r for d0, r, _, _ in dense),
                         layout.dpcp)
    sizes = tuple(d0 * r for d0, r, _, _ in experts)
    e_sh = _zero1_shares(sizes, sizes, (layout.dp // layout.ep) * layout.cp)
    best = (0, 0)
    for i, (o, c) in enumerate(d_sh):
        eo, ec = e_sh[(i // layout.cp // layout.ep) * layout.cp + i % layout.cp]
        best = max(best, (8 * (o + eo) + step_bytes * (c + ec), o + eo))
    return best


@dataclass
class _States:
    params: int
    grads_full: int  # grads at the end of the backward that syncs (what the optimizer sees)
    opt: int
    ddp_buckets: int
    unit_max: int  # largest gathered FSDP unit (compute bytes), blocks only
    root_unit: int  # gathered root unit (compute bytes)
    all_units: int  # every unit of this rank gathered (compute bytes)
    rs_buffer: int  # one reduce-scatter input (fp32) of the largest unit
    step_transient: int  # AdamW step temporaries
    n_local: int  # parameters stored (after TP/PP/EP, before FSDP)
    n_stored: int  # parameters stored (after FSDP)
    largest_tensor: int
    root_stored: int = 0  # of which the root unit's (embedding, final norm, head)
    chunk_units: tuple[int, ...] = ()  # per pipeline chunk (stage) of this rank: its units gathered (compute bytes)
    chunk_roots: tuple[int, ...] = ()  # of which the root unit's part (embedding / head) per chunk
    # the root's two FSDP units (fsdp_units.py: the embedding, and [norm, output]): gathered (compute bytes), stored
    embed_unit: int = 0
    head_unit: int = 0
    embed_stored: int = 0
    head_stored: int = 0


def _states(layout: Layout, stages: list[int]) -> _States:
    return _states_cached(layout, tuple(stages))


@lru_cache(maxsize=LAYOUT_CACHE)
def _states_cached(layout: Layout, stages: tuple[int, ...]) -> _States:
    """Parameters, gradients and AdamW state of one pipeline rank: sums per block kind (a MoE model's dense
    first blocks and its MoE blocks; pipeline_split: stages may hold different layer counts)."""
    n_stages = layout.pp * layout.pp_virtual
    kinds = [(n, _block_tensors(layout, dense=d)) for n, d in zip(block_kinds(layout, stages), (True, False)) if n]
    blk = [tn for _, tensors in kinds for tn in tensors]  # one block of each kind present
    root = _root_tensors(layout, 0 in stages, n_stages - 1 in stages)
    root_local = sum(d0 * r for d0, r, _, _ in root)
    n_local = sum(n * sum(d0 * r for d0, r, _, _ in ts) for n, ts in kinds) + root_local
    n_tensors = sum(n * len(ts) for n, ts in kinds) + len(root)
    cbytes = 2 if layout.precision == "mp" else 4
    edp = layout.expert_shard  # an expert shard's FSDP group (edp; under HSDP the holders in one replica group)
    dense_group = layout.shard  # HSDP shards dense tensors over dp*cp/dp_replicate ranks

    def group(tn: _Tensor) -> int:
        return edp if (tn[3] == "expert" and layout.ep > 1) else dense_group

    def shard(tn: _Tensor) -> int:  # FSDP2: dim 0 split in ceil(d0 / d) rows, rank 0 holds the most
        g = group(tn)
        if tn[3] == "expert" and layout.ep > 1 and tn[0] % g:
            # expert_parallel.expert_shard_placement: El experts that do not split over edp are sharded on a
            # hidden dim ([El, D, F] -> D / g rows of each; the _Tensor folds D*F into `rest`)
            return tn[0] * -(-tn[1] // g)
        return -(-tn[0] // g) * tn[1]

    # AdamW's `step`: a 4-byte tensor per parameter tensor, on the device when fused (torch keeps it beside the
    # parameter for the fused kernel), on the host for the per-tensor loop (counted on a CPU device only)
    step_bytes = 4 if layout.device == "cpu" or adamw_fused(layout) else 0
    if layout.fsdp:
        root_shard = sum(shard(tn) for tn in root)
        stored = sum(n * sum(shard(tn) for tn in ts) for n, ts in kinds) + root_shard
        # padded unsharded block (experts nested: same sum), per kind: dense first blocks are smaller units
        units = {d: sum(shard(tn) * group(tn) for tn in _block_tensors(layout, dense=d)) for d in (True, False)}
        unit = max(sum(shard(tn) * group(tn) for tn in ts) for _, ts in kinds)
        root_sz = sum(shard(tn) * group(tn) for tn in root)
        largest = max([shard(tn) for tn in blk + root], default=0)

        def gathered(stage_set: tuple[int, ...]) -> int:
            return sum(n * units[d] for n, d in zip(block_kinds(layout, stage_set), (True, False)))

        roots = tuple(cbytes * sum(shard(tn) * group(tn) for tn in _root_tensors(layout, s_ == 0, s_ == n_stages - 1))
                      for s_ in stages)
        chunks = tuple(cbytes * gathered((s_,)) + rt for s_, rt in zip(stages, roots))
        embed_t = _root_tensors(layout, 0 in stages, False)
        head_t = _root_tensors(layout, False, n_stages - 1 in stages)
        return _States(params=4 * stored, grads_full=4 * stored, opt=8 * stored +
                       step_bytes * n_tensors, ddp_buckets=0, unit_max=cbytes * unit, root_unit=cbytes * root_sz,
                       all_units=cbytes * (gathered(stages) + root_sz), rs_buffer=4 * unit,
                       step_transient=_step_transient(layout, 4 * largest), n_local=n_local,
                       n_stored=stored, largest_tensor=largest, root_stored=root_shard, chunk_units=chunks,
                       chunk_roots=roots, embed_unit=cbytes * sum(shard(tn) * group(tn) for tn in embed_t),
                       head_unit=cbytes * sum(shard(tn) * group(tn) for tn in head_t),
                       embed_stored=sum(shard(tn) for tn in embed_t), head_stored=sum(shard(tn) for tn in head_t))
    if shards_optimizer_only(layout.dp, layout.cp, layout.zero, layout.tp, layout.dtype):  # ZeRO-1 (wrapping.py)
        every = [tn for n, ts in kinds for tn in ts * n] + root
        if layout.num_experts and layout.ep > 1:  # parallel/zero.py: the experts are partitioned on their own
            opt, owned = _zero1_expert_opt(layout, [tn for tn in every if tn[3] != "expert"],
                                           [tn for tn in every if tn[3] == "expert"], step_bytes)
        else:
            owned = _zero1_max_share(tuple(g if r > 1 else d0 for d0, r, g, _ in every),
                                     tuple(d0 * r for d0, r, _, _ in every), layout.dpcp)
            opt = 8 * owned + step_bytes * -(-n_tensors // layout.dpcp)
    else:
        opt = 8 * n_local + step_bytes * n_tensors
    ddp_params = n_local
    # expert shards are on DDP's ignore list (synced by expert_parallel.sync_expert_grads)
    if layout.num_experts and layout.ep > 1:
        ddp_params -= sum(n * sum(d0 * r for d0, r, _, k in ts if k == "expert") for n, ts in kinds)
    largest = max([d0 * r for d0, r, _, _ in blk + root], default=0)
    grads = 4 * n_local
    if layout.tp > 1 and 0 in stages:
        # The vocab-parallel embedding's gradient comes back as a full [V, D] local tensor (measured, torch
        # 2.13 RowwiseParallel on nn.Embedding), not the [V/tp, D] shard the parameter is.
        grads += 4 * (layout.vocab_size - layout.vocab_size // layout.tp) * layout.d_model
    return _States(params=4 * n_local, grads_full=grads, opt=opt,
                   ddp_buckets=4 * ddp_params if layout.ddp else 0, unit_max=0, root_unit=0, all_units=0, rs_buffer=0,
                   step_transient=_step_transient(layout, 4 * largest),
                   n_local=n_local, n_stored=n_local, largest_tensor=largest)


def adamw_fused(layout: Layout) -> bool:
    """Whether the template's AdamW runs fused (train/optim.py adamw_kwargs): on CUDA when every parameter one
    AdamW steps is of one kind, plain tensors or DTensors of one mesh; else the per-tensor loop (foreach=False).
    The kinds each layout leaves (held against the real ranks by tests/parallel/test_adamw_kinds.py): TP without
    SP leaves the norm weights plain beside its DTensors, MLA its latent projections and a MoE its router and
    experts; FSDP puts EP's expert units on their own mesh. DDP's experts and ZeRO-1's per-group optimizers are
    plain."""
    if layout.device == "cpu":
        return False
    if layout.tp > 1 and (not layout.sp or layout.mla or layout.num_experts):
        return False
    return not (layout.num_experts and layout.ep > 1 and layout.fsdp)


def _step_transient(layout: Layout, largest_bytes: int) -> int:
    """AdamW step temporaries: the per-tensor loop (foreach=False, the CPU default and CUDA's mixed parameter sets)
    makes sqrt(v) and its quotient for one tensor at a time; the fused kernel (CUDA, adamw_fused) computes the
    update in registers: none. (foreach, which would hold sqrt(v) for every tensor at once, never runs.)"""
    return 0 if adamw_fused(layout) else 2 * largest_bytes
