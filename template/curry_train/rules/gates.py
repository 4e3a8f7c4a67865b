"""The ladder's gates: what the advisor and the planner may propose before they weigh it (CP only with proven
need, PP only across nodes, EP only on a MoE; TP with EP lays EP over dp x tp), and the sizes they search.

    python -c "from curry_train.rules import tp_sizes; from curry_train.config import ModelConfig; \
print(tp_sizes(ModelConfig(), 8))"

The thresholds follow skills/stage4-parallel-primitive-intro (CP "only when sequences > 32k actually drive your
task"; a lighter layout within 10% of the fastest is the one to run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from curry_train.moe_blocks import tp_split_widths
from curry_train.rules.validity import divisors, ep_spans_tp
from curry_train.wrapping import expert_replicas

if TYPE_CHECKING:  # type hints only: config.py imports this package at runtime
    from curry_train.config import ModelConfig

LONG_CONTEXT = 32768  # skills/stage4-parallel-primitive-intro: "CP only when sequences > 32k actually drive your task"
ACT_SHARE_FOR_CP = 0.40  # ... and activations are what overflows (share of the per-rank peak)
WITHIN = 0.10  # "within 10%": a lighter layout this close to the fastest is the one to run (plan's final)


def cp_has_proven_need(seq_len: int, act_share: float) -> bool:
    """CP only for long sequences whose activations are what overflows."""
    return seq_len >= LONG_CONTEXT and act_share >= ACT_SHARE_FOR_CP


def pp_allowed(nodes: int) -> bool:
    """PP only across nodes: inside one node NVLink carries TP + FSDP and the bubble is not worth it."""
    return nodes > 1


def ep_domain(dp: int, tp: int, ep: int, num_experts: int = 1) -> int:
    """The ranks an EP group is carved from (each holding distinct tokens): dp x tp when ep_spans_tp, else dp."""
    return dp * tp if ep_spans_tp(num_experts, tp, ep) else dp


def ep_allowed(model: ModelConfig) -> bool:
    """Experts to shard exist only in a MoE model."""
    return model.num_experts > 0


def tp_sizes(model: ModelConfig, gpus_per_node: int) -> list[int]:
    """TP sizes the planner searches: every divisor of gpus_per_node (a TP group never straddles two nodes) that
    divides the heads, the kv heads, d_ff and the vocabulary (`tp_blocked_by_vocab` names the ones only the
    vocabulary blocks, for the padding hint). Any model: on a MoE model attention, dense blocks and shared
    experts are tensor-parallel and the experts expert-parallel over dp x tp (ep_spans_tp), with SP on."""
    return [k for k in divisors(gpus_per_node)
            if k == 1 or all(val % k == 0 for val in (model.n_heads, model.n_kv_heads, model.vocab_size,
                                                     *(w for _, w in tp_split_widths(model))))]


def tp_blocked_by_vocab(model: ModelConfig, gpus_per_node: int) -> list[int]:
    """TP sizes inside a node that only the vocabulary's divisibility blocks (pad it: `vocab_pad_hint`)."""
    return [k for k in divisors(gpus_per_node) if k > 1 and model.vocab_size % k
            and all(val % k == 0 for val in (model.n_heads, model.n_kv_heads,
                                             *(w for _, w in tp_split_widths(model))))]


def pp_sizes(n_layers: int, world: int, nodes: int) -> list[int]:
    """PP sizes the planner searches: stages of whole nodes (pp divides nodes; pp is outermost, curry_train/mesh.py)
    with a layer each; pp need not divide the layers (pipeline_split.py splits by cost: BLOOM's 70 over PP12)."""
    if not pp_allowed(nodes):
        return [1]
    return [p for p in divisors(nodes) if p <= n_layers and world % p == 0]


def hsdp_replicas(dp: int, cp: int, tp: int, gpus_per_node: int, zero: int, ep: int = 1) -> int | None:
    """HSDP's dp_replicate where dp*cp spans nodes: the fewest replicas r (dividing dp) whose shard group dp*cp/r
    (at stride tp, curry_train/mesh.py) sits in one node, so only the replica all-reduce crosses nodes (Zhao et
    al. 2023, "PyTorch FSDP", hybrid sharding). None when FSDP stays in a node, zero < 2, or with ep > 1 when
    the EP groups cut across those replica groups (wrapping.expert_replicas)."""
    if zero < 2 or dp * cp * tp <= gpus_per_node:
        return None
    for r in divisors(dp):
        shard = dp * cp // r
        if r > 1 and gpus_per_node % (shard * tp) == 0:  # whole shard groups per node, none straddling two
            return r if shard >= 2 and expert_replicas(dp, cp, ep, r) is not None else None
    return None


def cp_sizes(seq_len: int, world: int) -> list[int]:
    """CP sizes: every cp with seq_len divisible by 2*cp (each rank holds a head and a tail chunk of the
    sequence, parallel/context_parallel.py), up to the cluster."""
    return [1] + [c for c in range(2, world + 1) if world % c == 0 and seq_len % (2 * c) == 0]


