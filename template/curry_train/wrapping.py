"""Which data-parallel wrapper and which mixed-precision path a layout gets: the one home of this rule.

The template (parallel/parallelize.py), the estimator (estimator/layout.py and the terms built on it), the rules
(rules/) and the planted bugs (validation/inject.py) all ask these functions, so the rule cannot drift between
what runs and what is modelled. Pure arithmetic over the degrees: no torch, importable by the torch-free estimator.

The rule (docs/ARCHITECTURE.md, "One rung"): data parallelism runs over the flattened dp x cp group, because CP
ranks hold different tokens of the same sequences and their gradients are averaged like dp's.
- FSDP2 `fully_shard` when that group has more than one rank and ZeRO stage >= 2 (ZeRO-2: reshard_after_forward
  False; ZeRO-3: True). Its MixedPrecisionPolicy computes in bf16 and reduces in fp32.
- FSDP2 also for ZeRO-1 with TP (Megatron's distributed optimizer, Narayanan et al. 2021 / Megatron-LM
  docs/distrib_optimizer.md): DDP cannot hold TP's DTensor parameters, so the units stay gathered and the fp32
  gradients accumulate unsharded for the whole step, reduce-scattered once after the last micro-batch; only the
  optimizer step runs on the 1/d shard (parallel/fsdp.py, `holds_step`).
- DDP otherwise when the group has more than one rank (ZeRO-0, and ZeRO-1 without TP, which adds
  ZeroRedundancyOptimizer).
- No wrapper on a single data-parallel rank.
bf16 on a layout FSDP does not wrap runs under `torch.autocast`.
"""

from __future__ import annotations

from typing import Literal

Wrapper = Literal["fsdp", "ddp", "none"]
PrecisionPath = Literal["fp32", "mp", "autocast"]


def dp_group_size(dp: int, cp: int) -> int:
    """Ranks that average gradients (the flattened dp x cp group)."""
    return dp * cp


def data_parallel_wrapper(dp: int, cp: int, zero: int, tp: int) -> Wrapper:
    """fsdp | ddp | none for a layout's dp, cp, tp degrees and ZeRO stage."""
    if dp_group_size(dp, cp) <= 1:
        return "none"
    return "fsdp" if zero >= 2 or (zero == 1 and tp > 1) else "ddp"


def shards_optimizer_only(dp: int, cp: int, zero: int, tp: int) -> bool:
    """ZeRO-1 without TP: DDP plus ZeroRedundancyOptimizer (optimizer states sharded over dp x cp, params and
    grads not)."""
    return zero == 1 and data_parallel_wrapper(dp, cp, zero, tp) == "ddp"


def fsdp_holds_step(dp: int, cp: int, zero: int, tp: int) -> bool:
    """ZeRO-1 on FSDP2 (with TP): parameters gathered and fp32 gradients unsharded for the whole step, one
    reduce-scatter after the last micro-batch (what torch's pipeline schedules do to FSDP under PP)."""
    return zero == 1 and data_parallel_wrapper(dp, cp, zero, tp) == "fsdp"


def expert_replicas(dp: int, cp: int, ep: int, dp_replicate: int) -> int | None:
    """How many HSDP replica groups the ranks holding the same experts (mesh "edp_cp": dp/ep x cp of them) span:
    their FSDP2 mesh is (replicas, dp*cp/ep / replicas), replicated on the first dim, sharded on the second
    (torchtitan's "dp_mod_ep" mesh under HSDP: dp_replicate x the dp_shard ranks left after EP). 1 without HSDP.
    None when the EP groups and the replica groups cut across each other (neither ep divides dp/dp_replicate nor
    dp/dp_replicate divides ep), so the expert replicas would not line up with the dense ones."""
    if dp_replicate <= 1:
        return 1
    if dp % dp_replicate or dp % ep:
        return None
    per = dp // dp_replicate  # dp ranks of one replica group
    if per % ep == 0:  # EP inside a replica: every replica holds each expert shard on per/ep ranks
        return dp_replicate
    if ep % per == 0:  # EP spans ep/per replicas: each holder of an expert shard sits in another replica
        return dp // ep
    return None


def precision_path(dtype: str, dp: int, cp: int, zero: int, tp: int) -> PrecisionPath:
    """fp32 | mp (FSDP's MixedPrecisionPolicy) | autocast (bf16 without FSDP)."""
    if dtype == "float32":
        return "fp32"
    return "mp" if data_parallel_wrapper(dp, cp, zero, tp) == "fsdp" else "autocast"


# ------------------------------------------------------------------------------ rows a rank draws by itself
# The host RNG (model/gpt.py init_tensor: torch.randn on a CPU generator) fills a float32 tensor of >= 16
# elements in blocks of 16 consecutive uniform draws (Box-Muller on each block), and redraws the last 16 when the
# size is not a multiple of 16. So elements [a, b) of a tensor of n elements come out bit-identical from a fresh
# generator that first consumes a uniform draws, whenever n, a and b are multiples of 16: a rank can draw just
# the rows it keeps (parallel/materialize.py), and the estimator (estimator/init.py) asks the same question.
RNG_BLOCK = 16


def rows_drawn_exactly(rows: int, row_numel: int, lo: int, hi: int) -> bool:
    """Whether rows [lo, hi) of a [rows, ...] float32 initial value (row_numel elements a row) can be drawn alone,
    bit-identical to the same rows of the full draw."""
    n, a, b = rows * row_numel, lo * row_numel, hi * row_numel
    return n % RNG_BLOCK == 0 and a % RNG_BLOCK == 0 and b % RNG_BLOCK == 0 and n > 0


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) chunk `index` of `parts` holds under a dim-0 split (torch.chunk, DTensor Shard(0), FSDP2)."""
    size = -(-rows // parts)
    return min(index * size, rows), min((index + 1) * size, rows)
