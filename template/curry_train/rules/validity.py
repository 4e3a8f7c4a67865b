"""Which layouts may launch: `check(cfg)` returns every cross-field problem (fields, what is wrong, the fix); an
empty list means the config may launch. config.check / validate_config refuse a launch on any problem, before a
process starts; the planner's enumeration uses the same function as its validity filter.

    python -c "from curry_train.config import Config; from curry_train.rules import check; \
print(check(Config.model_validate({'parallel': {'tp': 3}})))"

Torch-free, without runtime imports from `curry_train.config` (it imports this package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from curry_train.moe_blocks import tp_split_widths
from curry_train.pipeline_split import check_pp_layers
from curry_train.rules.attention import check_attention
from curry_train.wrapping import data_parallel_wrapper, expert_replicas

if TYPE_CHECKING:  # type hints only: config.py imports this package at runtime
    from curry_train.config import Config


class Problem(BaseModel):
    """One thing wrong with a config: which fields, what is wrong, how to fix it."""

    fields: list[str]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{', '.join(self.fields)}: {self.message}. Fix: {self.fix}"


def ep_spans_tp(num_experts: int, tp: int, ep: int) -> bool:
    """Whether the EP groups are carved from the dp x tp ranks instead of dp alone: a MoE model with tp > 1 and
    ep > 1 (Megatron-LM's expert-tensor-parallel size 1: experts whole, never TP-split; the EP group takes the tp
    ranks first, curry_train/mesh.py). Each tp rank then routes its own T/tp sequence shard (sp=true, which
    check requires, as Megatron-LM's validate_args does for MoE with TP)."""
    return bool(num_experts) and tp > 1 and ep > 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(val: int, gpus_per_node: int) -> list[int]:
    """TP sizes > 1 a hint may offer for a dimension of size `val`: they divide it and gpus_per_node (a TP group
    never straddles two nodes); [1] when none does (n_heads=71 on 8 GPUs per node)."""
    return [d for d in divisors(val) if d > 1 and gpus_per_node % d == 0] or [1]


def check(cfg: Config) -> list[Problem]:
    """Every cross-field rule; an empty list means the config may launch."""
    m, t, p, h = cfg.model, cfg.train, cfg.parallel, cfg.hardware
    out: list[Problem] = []

    def bad(fields: list[str], message: str, fix: str) -> None:
        out.append(Problem(fields=fields, message=message, fix=fix))

    check_attention(m, p, bad)  # model.attention: GQA/MHA, or MLA and its ranks (rules/attention.py)
    if m.attention == "mla":
        pass  # MLA's head dims are its own fields, not d_model / n_heads
    elif m.d_model % m.n_heads:
        bad(["model.d_model", "model.n_heads"], f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}",
            f"pick n_heads among {divisors(m.d_model)[:12]}")
    elif (m.d_model // m.n_heads) % 2:
        bad(["model.d_model", "model.n_heads"], f"head dim {m.d_model // m.n_heads} is odd; RoPE rotates pairs",
            "use an even d_model / n_heads")
    if m.n_heads % m.n_kv_heads:
        bad(["model.n_kv_heads", "model.n_heads"], f"n_heads={m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}",
            f"pick n_kv_heads among {divisors(m.n_heads)}")
    if p.tp > 1:
        for field, val in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                           ("model.vocab_size", m.vocab_size)):
            if val % p.tp:
                bad([field, "parallel.tp"], f"{field.split('.')[1]}={val} is not divisible by tp={p.tp}",
                    f"use tp in {tp_choices(val, h.gpus_per_node)}"
                    + (f" or {vocab_pad_hint(val, p.tp)}" if "vocab" in field else ""))
        for field, w in tp_split_widths(m):  # the routed experts stay whole under TP
            if w % p.tp:
                bad([f"model.{field}", "parallel.tp"], f"the FFN width {w} ({field}) is not divisible by tp={p.tp}",
                    f"use a tp that divides {w}")
    if p.sp and p.tp == 1:
        bad(["parallel.sp", "parallel.tp"], "sp=true shards the sequence over the TP group, but tp=1",
            "set parallel.tp >= 2 or parallel.sp=false")
    if p.sp and t.seq_len % p.tp:
        bad(["train.seq_len", "parallel.tp", "parallel.sp"], f"seq_len={t.seq_len} is not divisible by tp={p.tp}",
            "with sp=true seq_len must be a multiple of tp")
    stages = p.pp * p.pp_virtual
    if m.n_layers < stages:
        bad(["model.n_layers", "parallel.pp", "parallel.pp_virtual"],
            f"n_layers={m.n_layers} cannot give each of pp*pp_virtual={stages} stages a layer",
            f"use pp*pp_virtual <= {m.n_layers}")
    else:
        why = check_pp_layers(p.pp_layers, m.n_layers, stages)
        if why:
            bad(["parallel.pp_layers", "model.n_layers"], why,
                f"give {stages} positive layer counts summing to {m.n_layers}, or drop pp_layers to split by cost")
    if p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and p.pp > 1 and p.pp_virtual < 2:
        bad(["parallel.pp_schedule", "parallel.pp_virtual"], f"{p.pp_schedule} needs pp_virtual >= 2 chunks per rank",
            "set parallel.pp_virtual=2, or use pp_schedule=1f1b")
    if p.pp_virtual > 1 and p.pp == 1:
        bad(["parallel.pp_virtual", "parallel.pp"], "pp_virtual > 1 needs a pipeline (pp >= 2)",
            "set parallel.pp_virtual=1 or parallel.pp >= 2")
    if p.pp_virtual > 1 and p.pp_schedule in ("gpipe", "1f1b"):
        bad(["parallel.pp_schedule", "parallel.pp_virtual"], f"{p.pp_schedule} runs one chunk per rank",
            "use pp_schedule=interleaved_1f1b or zero_bubble, or pp_virtual=1")
    if m.num_experts:
        if m.top_k > m.num_experts:
            bad(["model.top_k", "model.num_experts"], f"top_k={m.top_k} > num_experts={m.num_experts}",
                "use top_k <= num_experts")
        if m.num_experts % p.ep:
            bad(["model.num_experts", "parallel.ep"], f"num_experts={m.num_experts} is not divisible by ep={p.ep}",
                f"use ep in {divisors(m.num_experts)}")
        _check_frontier_moe(m, p, bad)
    elif p.ep > 1:
        bad(["parallel.ep", "model.num_experts"], "expert parallel needs a MoE model, but num_experts=0",
            "set parallel.ep=1 (dense models have no experts to shard)")
    if not m.num_experts:
        for field, val, off in (("n_shared_experts", m.n_shared_experts, 0), ("shared_d_ff", m.shared_d_ff, 0),
                                ("first_k_dense", m.first_k_dense, 0), ("dense_d_ff", m.dense_d_ff, 0),
                                ("route_groups", m.route_groups, 1), ("route_top_groups", m.route_top_groups, 1)):
            if val != off:
                bad([f"model.{field}", "model.num_experts"], f"{field}={val} is a MoE setting, but num_experts=0",
                    f"set model.{field}={off}, or model.num_experts > 0")
    if p.ep > 1 and p.tp == 1 and p.dp % p.ep:
        bad(["parallel.ep", "parallel.dp"], f"ep={p.ep} is carved from the dp ranks but does not divide dp={p.dp}",
            f"use ep in {divisors(p.dp)}")
    if m.num_experts and ep_spans_tp(m.num_experts, p.tp, p.ep):
        _check_ep_over_tp(m, p, t, bad)
    if t.seq_len % (2 * p.cp) and p.cp > 1:
        bad(["train.seq_len", "parallel.cp"],
            f"seq_len={t.seq_len} is not divisible by 2*cp={2 * p.cp} (each CP rank holds a head and a tail chunk)",
            f"use a seq_len that is a multiple of {2 * p.cp}")
    if p.cp > 1 and p.sp:
        bad(["parallel.cp", "parallel.sp"], "context parallel and sequence parallel both shard the sequence",
            "use parallel.sp=false with cp > 1")
    if p.dp_replicate > 1:
        if p.dp % p.dp_replicate:
            bad(["parallel.dp_replicate", "parallel.dp"], f"dp_replicate={p.dp_replicate} does not divide "
                f"dp={p.dp} (HSDP splits the dp ranks into replica groups of equal size)",
                f"use dp_replicate in {divisors(p.dp)}")
        if p.zero < 2:
            bad(["parallel.dp_replicate", "parallel.zero"], f"dp_replicate={p.dp_replicate} needs sharded "
                f"parameters (HSDP = FSDP inside a group, replicas across groups), but zero={p.zero}",
                "set parallel.zero=2 or 3, or parallel.dp_replicate=1")
        elif m.num_experts and p.ep > 1 and expert_replicas(p.dp, p.cp, p.ep, p.dp_replicate) is None:
            per = p.dp // p.dp_replicate
            bad(["parallel.dp_replicate", "parallel.ep"], f"the EP groups (ep={p.ep} consecutive dp ranks) and the "
                f"HSDP replica groups ({per} dp ranks each) cut across each other, so the experts' replicas would "
                "not line up with the dense ones", f"use an ep that divides {per} or that {per} divides")
    if t.global_batch % (p.dp * t.micro_batch):
        bad(["train.global_batch", "parallel.dp", "train.micro_batch"],
            f"global_batch={t.global_batch} is not divisible by dp*micro_batch={p.dp * t.micro_batch}",
            f"use global_batch a multiple of {p.dp * t.micro_batch}, or change micro_batch")
    elif p.pp > 1:
        n_micro = cfg.num_microbatches
        if n_micro < p.pp:
            bad(["train.global_batch", "train.micro_batch", "parallel.pp"],
                f"the pipeline needs at least pp={p.pp} micro-batches per step, got "
                f"global_batch/(dp*micro_batch)={n_micro}",
                f"raise global_batch to {p.pp * p.dp * t.micro_batch} or lower micro_batch")
        elif p.pp_virtual > 1 and n_micro % p.pp:
            bad(["train.global_batch", "train.micro_batch", "parallel.pp"],
                f"{p.pp_schedule} needs the micro-batch count ({n_micro}) to be a multiple of pp={p.pp}",
                f"use global_batch a multiple of {p.pp * p.dp * t.micro_batch}")
    # Validity does not depend on train.dtype (wrapping.py): the fp32 form of the layout decides, so a config
    # valid in one precision is valid in the other (bf16 runs these layouts on FSDP2, unproven with what fp32
    # refuses here).
    wrapper = data_parallel_wrapper(p.dp, p.cp, p.zero, p.tp, "float32")
    ddp = wrapper == "ddp"  # zero 0/1 replicated over dp x cp (DDP in fp32; FSDP2 replicas in bf16)
    if ddp and p.tp > 1:  # DDP's bucketed all-reduce takes plain tensors only
        bad(["parallel.zero", "parallel.tp"], f"zero={p.zero} with dp*cp > 1 replicates the model (DDP in fp32), "
            "which cannot hold tensor-parallel (DTensor) parameters",
            "use parallel.zero=1 with tp (Megatron's distributed optimizer: replicated parameters, sharded "
            "optimizer step, on FSDP2), or zero=2/3")
    if p.fsdp_keep_gathered and (p.zero != 2 or wrapper != "fsdp"):
        bad(["parallel.fsdp_keep_gathered", "parallel.zero"], f"fsdp_keep_gathered keeps FSDP's ZeRO-2 units "
            f"gathered across micro-batches, but zero={p.zero} with dp*cp={p.dp * p.cp} "
            + ("has no ZeRO-2 units to keep" if wrapper != "fsdp" else
               "(zero=3 re-gathers by design; zero=1 with tp keeps them gathered already)"),
            "set parallel.zero=2 with dp*cp > 1, or parallel.fsdp_keep_gathered=false")
    if p.fsdp_reshard != "default" and (p.zero != 3 or wrapper != "fsdp"):
        bad(["parallel.fsdp_reshard", "parallel.zero"], f"fsdp_reshard={p.fsdp_reshard} sets when ZeRO-3's FSDP "
            f"units reshard after forward, but zero={p.zero} with dp*cp={p.dp * p.cp} "
            + ("has no ZeRO-3 units" if wrapper != "fsdp" else
               "never reshards after forward"),
            "set parallel.zero=3 with dp*cp > 1, or parallel.fsdp_reshard=default")
    elif p.fsdp_reshard == "never" and p.pp == 1:
        bad(["parallel.fsdp_reshard", "parallel.zero"], "fsdp_reshard=never with zero=3 and no pipeline keeps "
            "every unit gathered from forward to backward: that is ZeRO-2",
            "set parallel.zero=2 and parallel.fsdp_reshard=default (never matters only under parallel.pp > 1)")
    if ddp and p.pp > 1 and p.pp_schedule == "zero_bubble":
        bad(["parallel.zero", "parallel.pp_schedule"], f"zero={p.zero} (DDP in fp32) all-reduces when the last "
            "micro-batch's backward ends, but zero_bubble runs some weight-gradient passes after it (gradients "
            "would be wrong)", "use parallel.zero=2 or 3 with zero_bubble, or pp_schedule=interleaved_1f1b")
    nodes_gpus = h.gpus_per_node * h.nodes
    if cfg.world_size > nodes_gpus:
        bad(["hardware.gpus_per_node", "hardware.nodes"],
            f"world size dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {cfg.world_size} exceeds "
            f"gpus_per_node*nodes = {nodes_gpus}",
            "shrink the parallel sizes or raise hardware.nodes")
    if p.tp > h.gpus_per_node:
        bad(["parallel.tp", "hardware.gpus_per_node"], f"tp={p.tp} spans more than one node ({h.gpus_per_node} "
            "GPUs per node); TP all-reduces every layer and needs the node's fast link", "keep tp <= gpus_per_node")
    elif h.gpus_per_node % p.tp:
        bad(["parallel.tp", "hardware.gpus_per_node"], f"tp={p.tp} does not divide gpus_per_node="
            f"{h.gpus_per_node}: some TP groups would straddle two nodes",
            f"use tp in {divisors(h.gpus_per_node)}")
    return out


def vocab_pad_hint(vocab: int, tp: int) -> str:
    """Megatron pads the vocabulary to a multiple of 64 * tp (make-vocab-size-divisible-by 128 by default, times
    tp), so the embedding and the LM head split evenly over the TP group."""
    mult = 64 * tp
    return (f"pad model.vocab_size {vocab} to {-(-vocab // mult) * mult} "
            f"(a multiple of 64*tp = {mult}, as Megatron does)")


def _check_ep_over_tp(m: Any, p: Any, t: Any, bad: Any) -> None:
    """TP with EP: the EP groups are carved from the dp x tp ranks (ep_spans_tp), so each tp rank must hold
    distinct tokens: sequence parallel's T/tp shard (Megatron-LM validate_args: "When using MoE and tensor
    parallelism, sequence parallelism must be used"). Without SP every tp rank holds the same tokens and the
    dispatch would send each token tp times."""
    if (p.dp * p.tp) % p.ep:
        bad(["parallel.ep", "parallel.dp", "parallel.tp"], f"ep={p.ep} is carved from the dp*tp={p.dp * p.tp} "
            "ranks under tensor parallel but does not divide them", f"use ep in {divisors(p.dp * p.tp)}")
    if not p.sp:
        bad(["parallel.sp", "parallel.ep", "parallel.tp"], f"tp={p.tp} with ep={p.ep} lays the expert-parallel "
            "group over the dp x tp ranks, which needs every tp rank to route its own tokens; without sequence "
            f"parallel each tp rank holds the same tokens and the dispatch would count them {p.tp} times",
            "set parallel.sp=true (each tp rank routes its T/tp slice, as Megatron-LM requires for MoE with TP), "
            "or parallel.ep=1")
    if m.capacity_factor > 0:
        bad(["model.capacity_factor", "parallel.ep", "parallel.tp"], "token dropping ranks a micro-batch's slots "
            "over the whole sequence, but with tp and ep > 1 each tp rank routes only its T/tp slice",
            "set model.capacity_factor=0 (dropless) with tp and ep > 1, or parallel.tp=1")


def _check_frontier_moe(m: Any, p: Any, bad: Any) -> None:
    """Shared experts, dense first blocks and group-limited routing (docs/ARCHITECTURE.md#mixture-of-experts)."""
    if m.shared_d_ff and not m.n_shared_experts:
        bad(["model.shared_d_ff", "model.n_shared_experts"], f"shared_d_ff={m.shared_d_ff} sizes a shared expert, "
            "but n_shared_experts=0", "set model.n_shared_experts >= 1, or model.shared_d_ff=0")
    if m.first_k_dense >= m.n_layers:
        bad(["model.first_k_dense", "model.n_layers"], f"first_k_dense={m.first_k_dense} leaves no MoE block of "
            f"n_layers={m.n_layers}", f"use first_k_dense < {m.n_layers}, or num_experts=0 for a dense model")
    if m.dense_d_ff and not m.first_k_dense:
        bad(["model.dense_d_ff", "model.first_k_dense"], f"dense_d_ff={m.dense_d_ff} sizes the dense first "
            "blocks, but first_k_dense=0", "set model.first_k_dense >= 1, or model.dense_d_ff=0")
    if p.tp > 1 and m.first_k_dense and (m.dense_d_ff or m.d_ff) % p.tp:
        bad(["model.dense_d_ff", "parallel.tp"], f"the dense blocks' d_ff={m.dense_d_ff or m.d_ff} is not "
            f"divisible by tp={p.tp}", "use a tp that divides model.dense_d_ff")
    G, M = m.route_groups, m.route_top_groups
    if m.num_experts % G:
        bad(["model.route_groups", "model.num_experts"], f"num_experts={m.num_experts} does not split into "
            f"route_groups={G} equal groups", f"use route_groups in {divisors(m.num_experts)}")
    elif M > G:
        bad(["model.route_top_groups", "model.route_groups"], f"route_top_groups={M} > route_groups={G}",
            f"use route_top_groups <= {G}")
    elif M * (m.num_experts // G) < m.top_k:
        bad(["model.route_top_groups", "model.top_k"], f"route_top_groups={M} groups of {m.num_experts // G} "
            f"experts hold fewer than top_k={m.top_k} experts",
            f"use route_top_groups >= {-(-m.top_k // (m.num_experts // G))}")
