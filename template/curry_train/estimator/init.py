"""The init peak: live bytes on a rank while it builds its model (parallel/materialize.py, train.loop.setup).

Each rank builds the model on the meta device, applies the layout, allocates its local shards (`to_empty`)
and fills them one parameter at a time (parallel/materialize.py, its two paths): without TP a parameter held as a
block of rows draws only those rows into its own storage (no temporary, when `wrapping.rows_drawn_exactly`
allows; ones always); any other parameter is drawn in full on the host and dropped before the next. So the
peak is the largest of two moments:
  materialise  local params (fp32, FSDP-padded)  +  the largest full fp32 parameter of the full-draw ones this
               rank holds a part of (its global shape: the embedding / LM head or, for MoE, the full [E, D, F]
               expert tensor)  +  the contiguous local chunk distribute_tensor cuts from it (DTensor params: TP or
               FSDP)  +  the RoPE tables
  RoPE build   local params + RoPE tables + the temporaries of recomputing the last stage's tables
  DDP wrap     local params + DDP's flat gradient buckets (allocated by the DDP constructor) + RoPE tables
Measured against measure/init_memory.py: exact to 16 bytes at dp=4 ZeRO-3 (tests/test_sharded_init.py).
On CUDA the full tensor of a DTensor parameter is copied to the device before it is split (distribute_tensor),
so the same sum holds for device memory; an own-rows parameter is drawn into a host buffer of its local size
and copied, so it adds nothing on the device; the host holds at most one full parameter.
"""

from __future__ import annotations

from functools import lru_cache

from curry_train.estimator.layout import LAYOUT_CACHE, Layout, _block_tensors, _root_tensors, _Tensor
from curry_train.estimator.pipeline import stage_ids
from curry_train.estimator.states import _states
from curry_train.wrapping import chunk_rows, rows_drawn_exactly


@lru_cache(maxsize=LAYOUT_CACHE)
def init_peak(layout: Layout, pp_rank: int = 0) -> int:
    """Peak bytes of one pipeline rank while it initialises (see the module docstring)."""
    stages = stage_ids(layout, pp_rank)
    st = _states(layout, stages)
    n_stages = layout.pp * layout.pp_virtual
    tensors = _block_tensors(layout) + _root_tensors(layout, 0 in stages, n_stages - 1 in stages)
    edp = layout.expert_shard  # the FSDP group of an expert shard (HSDP: inside a replica group)
    dtensor = layout.fsdp or layout.tp > 1

    def chunk(tn: _Tensor) -> int:
        d0, r, _, kind = tn
        if layout.fsdp:
            group = edp if (kind == "expert" and layout.ep > 1) else layout.shard
            return -(-d0 // group) * r
        return d0 * r if dtensor else 0

    def own_rows(tn: _Tensor) -> bool:
        """materialize.own_rows for rank 0 (the first chunk of the first EP slice)."""
        d0, r, numel, kind = tn
        if layout.tp > 1:
            return False
        if r == 1:  # the norm weights: ones, filled in place
            return True
        hi = d0
        if layout.fsdp:
            group = edp if (kind == "expert" and layout.ep > 1) else layout.shard
            if kind == "expert" and layout.ep > 1 and d0 % group:
                return False  # FSDP shards a hidden dim of these experts (expert_shard_placement)
            hi = chunk_rows(d0, group, 0)[1]
        return rows_drawn_exactly(numel // r, r, 0, hi)

    largest = max((4 * (tn[2] + chunk(tn)) for tn in tensors if not own_rows(tn)), default=0)
    half = layout.rope_dim // 2
    rope = 2 * layout.seq_len * half * 4 * len(stages)
    # model/gpt.py rope_tables while the last stage recomputes its tables (its old ones still live): the fp64
    # angles [T, Dh/2] and inv_freq [Dh/2], then cos (fp32), sin (fp64, then fp32)
    rope_build = layout.seq_len * half * (8 + 4 + 8 + 4) + 8 * half
    return max(st.params + largest + rope, st.params + st.ddp_buckets + rope, st.params + rope + rope_build)
