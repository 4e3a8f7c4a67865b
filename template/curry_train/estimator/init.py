"""The init peak: live bytes on a rank while it builds its model (parallel/materialize.py, train.loop.setup).

Each rank builds the model on the meta device, applies the layout, allocates its local shards (`to_empty`)
and fills them one parameter at a time from the full reference tensor of that parameter, generated on the
host and dropped before the next. So the peak is the largest of two moments:
  materialise  local params (fp32, FSDP-padded)  +  the largest full fp32 parameter this rank holds a part of
               (its global shape: the embedding / LM head or, for MoE, the full [E, D, F] expert tensor)
               +  the contiguous local chunk distribute_tensor cuts from it (DTensor params: TP or FSDP)
               +  the RoPE tables
  DDP wrap     local params + DDP's flat gradient buckets (allocated by the DDP constructor) + RoPE tables
Measured against measure/init_memory.py: exact to 16 bytes at dp=4 ZeRO-3 (tests/test_sharded_init.py).
On CUDA the full tensor of a DTensor parameter is copied to the device before it is split (distribute_tensor),
so the same sum holds for device memory; the host holds at most one full parameter.
"""

from __future__ import annotations

from functools import lru_cache

from curry_train.estimator.layout import Layout, _block_tensors, _root_tensors, _Tensor
from curry_train.estimator.pipeline import stage_ids
from curry_train.estimator.states import _states


@lru_cache(maxsize=4096)
def init_peak(layout: Layout, pp_rank: int = 0) -> int:
    """Peak bytes of one pipeline rank while it initialises (see the module docstring)."""
    stages = stage_ids(layout, pp_rank)
    st = _states(layout, stages)
    n_stages = layout.pp * layout.pp_virtual
    tensors = _block_tensors(layout) + _root_tensors(layout, 0 in stages, n_stages - 1 in stages)
    edp = (layout.dp // layout.ep) * layout.cp
    dtensor = layout.fsdp or layout.tp > 1

    def chunk(tn: _Tensor) -> int:
        d0, r, _, kind = tn
        if layout.fsdp:
            group = edp if (kind == "expert" and layout.ep > 1) else layout.shard
            return -(-d0 // group) * r
        return d0 * r if dtensor else 0

    largest = max(4 * (tn[2] + chunk(tn)) for tn in tensors)
    rope = 2 * layout.seq_len * (layout.head_dim // 2) * 4 * len(stages)
    return max(st.params + largest + rope, st.params + st.ddp_buckets + rope)
