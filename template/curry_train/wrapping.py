"""Which data-parallel wrapper and which mixed-precision path a layout gets: the one home of this rule.

The template (parallel/parallelize.py), the estimator (estimator/layout.py and the terms built on it), the rules
(rules/) and the planted bugs (validation/inject.py) all ask these functions, so the rule cannot drift between
what runs and what is modelled. Pure arithmetic over the degrees: no torch, importable by the torch-free estimator.

The rule (docs/ARCHITECTURE.md, "Mixed precision"): data parallelism runs over the flattened dp x cp group, because CP
ranks hold different tokens of the same sequences and their gradients are averaged like dp's.

bfloat16: every layout is FSDP2 `fully_shard` with its MixedPrecisionPolicy (bf16 compute parameters, fp32 master
weights and AdamW state, fp32 gradient reduction; Micikevicius et al. 2018, "Mixed Precision Training", §3), as
torchtitan gives its layouts (Wang et al. 2024, "TorchTitan", §3.1): the residual stream, the norms and every
Linear's saved input are bf16, and no layout runs under torch.autocast (which keeps an fp32 stream and a bf16
copy of each Linear's input). The ZeRO stage says what the units do:
- ZeRO-0: dp x cp replicas of one shard, a 2-D mesh (replicate = dp*cp, shard = 1; `fsdp_replicas`): FSDP2's
  HSDP with shard groups of one rank, i.e. DDP's replication. The units stay gathered for the step and the fp32
  gradients accumulate unsharded over the micro-batches, all-reduced once after the last (DDP's no-sync
  accumulation; parallel/fsdp.py holds_step).
- ZeRO-1: FSDP2 holding the step over dp x cp (Megatron's distributed optimizer, Narayanan et al. 2021 /
  Megatron-LM docs/distrib_optimizer.md): the units stay gathered, the fp32 gradients accumulate unsharded for
  the whole step and are reduce-scattered once after the last micro-batch; only the optimizer step runs on the
  1/d shard.
- ZeRO-2 / ZeRO-3: FSDP2 as in fp32 below (reshard_after_forward False / True, fsdp_units.py).
- One dp x cp rank (a single process, TP alone, PP alone): the same, on the 1-rank dp x cp mesh (FSDP2's degree-1
  path copies instead of communicating); a single process gets a 1-rank process group for it
  (train/comm_init.py init_single_rank).

float32 keeps torch's replicated wrappers, because there is no cast for a policy to make: FSDP2 at degree 1 or
as replicas would add a second copy of every unit's parameters and per-unit reductions for no precision gain,
where DDP's bucketed all-reduce overlaps the backward (Li et al. 2020, VLDB, §3.2) and ZeroRedundancyOptimizer
shards only the state:
- FSDP2 when dp x cp has more than one rank and ZeRO stage >= 2 (ZeRO-2: reshard_after_forward False; ZeRO-3:
  True), and for ZeRO-1 with TP, which DDP cannot hold (DTensor parameters): FSDP2 holding the step as above.
- DDP otherwise when dp x cp has more than one rank (ZeRO-0, and ZeRO-1 without TP, which adds
  ZeroRedundancyOptimizer).
- No wrapper on a single data-parallel rank.
Which layouts are valid does not depend on the dtype (rules/validity.py asks the float32 form): a config that
trains in fp32 trains in bf16 and back.
"""

from __future__ import annotations

from typing import Literal

Wrapper = Literal["fsdp", "ddp", "none"]
PrecisionPath = Literal["fp32", "mp"]


def dp_group_size(dp: int, cp: int) -> int:
    """Ranks that average gradients (the flattened dp x cp group)."""
    return dp * cp


def data_parallel_wrapper(dp: int, cp: int, zero: int, tp: int, dtype: str) -> Wrapper:
    """fsdp | ddp | none for a layout's dp, cp, tp degrees, ZeRO stage and train.dtype."""
    if dtype == "bfloat16":
        return "fsdp"
    if dp_group_size(dp, cp) <= 1:
        return "none"
    return "fsdp" if zero >= 2 or (zero == 1 and tp > 1) else "ddp"


def shards_optimizer_only(dp: int, cp: int, zero: int, tp: int, dtype: str) -> bool:
    """ZeRO-1 on DDP plus ZeroRedundancyOptimizer (fp32 without TP): optimizer states sharded over dp x cp,
    params and grads not."""
    return zero == 1 and data_parallel_wrapper(dp, cp, zero, tp, dtype) == "ddp"


def fsdp_holds_step(dp: int, cp: int, zero: int, tp: int, dtype: str) -> bool:
    """FSDP2 keeps its units gathered and its fp32 gradients unsharded for the whole step, one reduction after the
    last micro-batch (what torch's pipeline schedules do to FSDP under PP): ZeRO-1 on FSDP2 (bf16, or fp32 with TP)
    and bf16's ZeRO-0 replicas."""
    return zero <= 1 and data_parallel_wrapper(dp, cp, zero, tp, dtype) == "fsdp"


def fsdp_replicas(dp: int, cp: int, zero: int, tp: int, dtype: str, dp_replicate: int) -> int:
    """Replica groups of FSDP2's mesh over the dp x cp ranks (its first dimension; the second shards): dp*cp under
    ZeRO-0 (bf16: each rank one replica of the one shard), parallel.dp_replicate under HSDP (zero >= 2), else 1
    (also when FSDP2 does not wrap the layout)."""
    if data_parallel_wrapper(dp, cp, zero, tp, dtype) != "fsdp":
        return 1
    return dp_group_size(dp, cp) if zero == 0 else dp_replicate


def expert_replicas(dp: int, cp: int, ep: int, dp_replicate: int) -> int | None:
    """How many FSDP replica groups the ranks holding the same experts (mesh "edp_cp": dp/ep x cp of them) span:
    their FSDP2 mesh is (replicas, dp*cp/ep / replicas), replicated on the first dim, sharded on the second
    (torchtitan's "dp_mod_ep" mesh under HSDP: dp_replicate x the dp_shard ranks left after EP). 1 without
    replicas; every holder when each dp x cp rank is a replica (`fsdp_replicas` of ZeRO-0: dp_replicate = dp*cp).
    None when the EP groups and the replica groups cut across each other (neither ep divides dp/dp_replicate nor
    dp/dp_replicate divides ep), so the expert replicas would not line up with the dense ones."""
    if dp_replicate <= 1:
        return 1
    if dp_replicate == dp * cp and dp % ep == 0:  # one replica per rank: the edp_cp holders all replicate
        return dp // ep * cp
    if dp % dp_replicate or dp % ep:
        return None
    per = dp // dp_replicate  # dp ranks of one replica group
    if per % ep == 0:  # EP inside a replica: every replica holds each expert shard on per/ep ranks
        return dp_replicate
    if ep % per == 0:  # EP spans ep/per replicas: each holder of an expert shard sits in another replica
        return dp // ep
    return None


def precision_path(dtype: str) -> PrecisionPath:
    """fp32 | mp: FSDP2's MixedPrecisionPolicy computes every bf16 layout (module docstring); none runs autocast."""
    return "mp" if dtype == "bfloat16" else "fp32"


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
