"""Communication and step time for the estimator: collectives per optimizer step with ring factors and
alpha-beta times per link (intra vs inter node), then the step:

  pipeline  each stage's compute per step (its layers; the first stage also the embedding's dense
            gradient, the last the LM head GEMMs and the loss): the step follows the slowest rank, plus the
            bubble of the schedule's real action order (estimator/makespan.py: bubble_ratio, simulated or its
            verified closed form) times the mean rank's compute.
  exposed   collectives on one link share it: their times add. Each hides only behind the compute it can
            overlap (FSDP's prefetched all-gathers: the forward's behind the forward, the backward's behind the
            backward; reduce-scatters: backward; DDP's buckets: the last micro-batch's backward; CP's ring: the
            attention blocks), and collectives hiding behind the same compute share that budget: per link,
            exposed >= (sum of their times) - (the compute they can overlap). TP's, EP's dispatch and the
            pipeline's fill/drain transfers sit on the critical path, and so do FSDP's first gather and last
            reduce-scatter of each micro-batch (nothing runs before or after them to hide behind); EP's combine
            hides behind the shared expert only (estimator/comm_ep.py).
  contention  a hidden collective is not free: its kernels take SMs and HBM bandwidth from the compute it
            overlaps, which runs OVERLAP_SLOWDOWN slower meanwhile (`_expose`).
  step      = pipeline makespan + exposed communication + optimizer step (memory-bound).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from curry_train.estimator.acts import _acts
from curry_train.estimator.comm_ep import SHARED_WINDOWS, ep_all_to_alls
from curry_train.estimator.compute import block_rates
from curry_train.estimator.layout import (
    MFU_CONVENTION,
    Layout,
    _block_tensors,
    attention_flops_per_token,
    block_kinds,
    flops_per_token,
    hardware_flops_per_token,
    rank_layers,
)
from curry_train.estimator.makespan import bubble_ratio
from curry_train.estimator.mla import mla_replicated_flops_per_token
from curry_train.estimator.pipeline import stage_ids
from curry_train.estimator.profiles import HardwareProfile
from curry_train.estimator.states import _states
from curry_train.wrapping import shards_optimizer_only

FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 * 2**20, 25 * 2**20  # DDP's first bucket, and the later ones
# Compute that overlaps a collective runs 18.9% slower on average (max 40%): Lee et al. 2025, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning" (arXiv:2507.03114), GPT and Llama
# training on A100, H100, MI250 and MI210. The cause is the collective's own kernels: NCCL runs one CTA per
# channel on an SM of its own, never shared with a compute kernel (16 of an A100's 108 SMs at a DGX's 190 GB/s,
# github.com/NVIDIA/nccl/issues/689: 15%), and its copies read and write HBM two to three times per byte sent
# (github.com/NVIDIA/nccl/issues/1428).
OVERLAP_SLOWDOWN = 0.189


class CommItem(BaseModel):
    """One kind of collective of one primitive, per optimizer step, as seen by one rank."""

    primitive: str = Field(description="dp, zero1, fsdp, hsdp, tp, pp, cp or ep.")
    collective: str = Field(description="all_reduce, all_gather, reduce_scatter, broadcast, all_to_all or p2p.")
    group_size: int
    calls: int = Field(description="Collectives issued per step.")
    bytes: int = Field(description="Payload bytes per step (S summed over calls, before ring factors).")
    wire_bytes: int = Field(description="Bytes each rank sends per step (ring factors applied).")
    link: str = Field(description="intra (NVLink) or inter (network): the slowest link the group spans.")
    time_s: float = Field(description="alpha-beta time of these collectives.")
    exposed_s: float = Field(description="Part not hidden behind compute (its share of its link's exposed time).")
    overlaps: str = Field("", description="The compute it can hide behind: forward+backward, backward, last "
                                          "micro-batch backward, attention, or none (critical path).")


class StepTime(BaseModel):
    compute_s: float = Field(description="Busy compute of the slowest rank (pipeline: the slowest stage's rank), "
                                         "recompute included.")
    bubble_s: float = Field(description="Pipeline idle time on that rank: the schedule's makespan - its compute.")
    comm_exposed_s: float = Field(description="Exposed communication, all primitives.")
    optimizer_s: float = Field(description="AdamW step (memory-bound).")
    total_s: float
    tokens_per_s: float
    mfu: float = Field(description="Model FLOPs utilisation: 6N + 6 L H Dh s per token (causal half, no recompute) "
                                   "over the dense peak (mfu_convention).")
    hfu: float = Field(0.0, description="Hardware FLOPs utilisation: executed FLOPs (recompute included) over the "
                                        "dense peak.")
    mfu_convention: str = Field(MFU_CONVENTION, description="How mfu and hfu count FLOPs.")
    comm_fraction: float = Field(description="Exposed communication / step time.")
    comm_bound: bool = Field(description="Exposed communication exceeds half the step.")
    stage_compute_s: list[float] = Field(default_factory=list, description="Busy compute per pipeline rank "
                                         "(first: + embedding, last: + head and loss).")


def _span_link(layout: Layout, group: int, stride: int) -> str:
    """intra when a group of `group` ranks at `stride` fits in one node (rank = ((pp*dp+dp)*cp+cp)*tp+tp)."""
    return "intra" if group * stride <= layout.gpus_per_node else "inter"


def _rails(layout: Layout, group: int, stride: int) -> int:
    """Ranks of a group at `stride` that share one node: on DGX/HGX every GPU has its own NIC (rail-optimised),
    and NCCL runs one ring channel per NIC, so a group with k ranks per node crosses nodes on k NICs at once."""
    return max(1, min(group, layout.gpus_per_node // max(stride, 1)))


def _coll_time(hw: HardwareProfile, kind: str, n: int, nbytes: float, calls: int, link: str,
               rails: int = 1) -> tuple[float, float]:
    """(wire bytes per rank, alpha-beta seconds) for `calls` collectives moving `nbytes` in total. Across nodes the
    bus bandwidth is the per-GPU NIC's times the group's ranks per node (`_rails`), at most the node's own
    (NVIDIA nccl-tests doc/PERFORMANCE.md: busbw is set by the slowest link a ring crosses; with k NICs in use
    the inter-node hop carries 1/k of each ring's bytes per NIC)."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    bw = (hw.intra_node_gbps if link == "intra" else min(hw.intra_node_gbps, hw.inter_node_gbps * rails)) * 1e9
    alpha = (hw.alpha_intra_us if link == "intra" else hw.alpha_inter_us) * 1e-6
    if kind == "all_reduce":
        wire, steps = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    elif kind in ("all_gather", "reduce_scatter", "all_to_all") or kind == "broadcast":
        wire, steps = (n - 1) / n * nbytes, n - 1
    else:  # p2p
        wire, steps = nbytes, 1
    return wire, calls * steps * alpha + wire / bw


# the compute windows a collective can hide behind; `_WINDOW_SETS` are the groups that must share one window
# (nested: a collective allowed in a smaller window is also counted against every larger one; the shared expert's,
# comm_ep.SHARED_WINDOWS, lie in the forward and the backward: its replay under full recompute in the backward)
_WINDOW_SETS = (("bwd_last",), ("bwd_last", "shared_bwd", "shared_replay", "bwd"), ("fwd_first",),
                ("fwd_first", "shared_fwd", "fwd"), ("attn",),
                ("bwd_last", "shared_bwd", "shared_replay", "bwd", "fwd_first", "shared_fwd", "fwd", "attn", "all"))
_WINDOW_WORDS = {"bwd_last": "last micro-batch backward", "bwd": "backward", "fwd_first": "first micro-batch forward",
                 "fwd": "forward", "attn": "attention", "all": "forward+backward", None: "none", **SHARED_WINDOWS}


def _comm(layout: Layout, hw: HardwareProfile, t_compute: float) -> list[CommItem]:
    """Collectives per optimizer step on the pipeline rank holding the first stage; `t_compute` is its busy
    compute per step (the overlap budget)."""
    # entries: (item fields, window, share of it on the critical path regardless of overlap)
    entries: list[tuple[dict, str | None, float]] = []
    a = _acts(layout)
    st = _states(layout, stage_ids(layout, 0))
    m = layout.n_micro_batches

    def add(prim: str, kind: str, n: int, nbytes: float, calls: int, link: str, window: str | None,
            critical: float = 0.0, rails: int = 1) -> None:
        if n <= 1 or nbytes <= 0 or calls <= 0:
            return
        wire, tm = _coll_time(hw, kind, n, nbytes, calls, link, rails)
        entries.append((dict(primitive=prim, collective=kind, group_size=n, calls=calls, bytes=int(nbytes),
                             wire_bytes=int(wire), link=link, time_s=tm), window, critical))

    dp_link, dp_rails = _span_link(layout, layout.dpcp, layout.tp), _rails(layout, layout.dpcp, layout.tp)
    layers = max(rank_layers(layout, stage_ids(layout, r)) for r in range(layout.pp))  # the busiest pipeline rank
    if layout.ddp:
        nbytes = st.ddp_buckets
        calls = max(1, math.ceil(max(nbytes - FIRST_BUCKET_BYTES, 0) / BUCKET_BYTES) + 1)
        # DDP syncs only on the last micro-batch (no_sync before): its buckets overlap that backward
        add("dp", "all_reduce", layout.dpcp, nbytes, calls, dp_link, "bwd_last", rails=dp_rails)
        if layout.num_experts and layout.ep > 1:
            add("ep", "all_reduce", layout.edp, 4 * (st.n_local - st.ddp_buckets // 4), 1, dp_link, None)
        if layout.zero == 1:  # ZeroRedundancyOptimizer broadcasts every parameter from its owner after the step
            n_tensors = len(_block_tensors(layout)) * layers + 3
            experts = 4 * st.n_local - st.ddp_buckets if layout.num_experts and layout.ep > 1 else 0
            n_exp = 3 * layers if experts else 0  # parallel/zero.py: the expert shards' own ZeRO over edp_cp
            add("zero1", "broadcast", layout.dpcp, 4 * st.n_local - experts, n_tensors - n_exp, dp_link, None,
                rails=dp_rails)
            add("zero1", "broadcast", layout.edp, experts, n_exp, dp_link, None)
    if layout.fsdp:
        _fsdp(layout, st.all_units, layers, add, st.head_unit, bool(st.embed_unit))
    if layout.tp > 1:
        # tensor_parallel.py: one `f` (identity / all-gather under SP) and one `g` (all-reduce / reduce-scatter)
        # per attention and per MLP sub-block, forward and backward: 4 all-reduces of [b, T, D] per layer per
        # micro-batch, or 4 all-gathers + 4 reduce-scatters under SP (same bytes). Recompute replays the
        # forward ones (selective keeps SP's reduce-scatter outputs, so only its all-gathers replay).
        nb = layout.micro_batch_tokens * layout.d_model * (2 if layout.precision != "fp32" else 4)
        per_layer = 4 + (2 if layout.recompute == "full" else 0)
        if layout.sp:
            ag = per_layer + (1 if layout.recompute == "selective" else 0) * 2
            add("tp", "all_gather", layout.tp, nb * ag * layers * m, ag * layers * m, "intra", None)
            add("tp", "reduce_scatter", layout.tp, nb * per_layer * layers * m, per_layer * layers * m, "intra", None)
        else:
            add("tp", "all_reduce", layout.tp, nb * per_layer * layers * m, per_layer * layers * m, "intra", None)
    if layout.pp > 1:
        # one activation forward and one gradient backward per micro-batch per chunk boundary; only the fill
        # and drain hops (2 (p - 1)) sit on the critical path, the rest overlap the other stages' compute
        link = "intra" if layout.dp * layout.cp * layout.tp * 2 <= layout.gpus_per_node else "inter"
        hops = 2 * m * layout.pp_virtual
        add("pp", "p2p", 2, a.stream * hops, hops, link, "all", critical=min(1.0, 2 * (layout.pp - 1) / hops))
    if layout.cp > 1:
        cb = 2 if layout.precision != "fp32" else 4
        kv = 2 * layout.micro_batch * (layout.n_kv_heads // layout.tp) * (layout.seq_len // layout.cp) * \
            layout.head_dim
        fwd = (layout.cp - 1) * kv * cb
        bwd = (layout.cp - 1) * kv * cb + layout.cp * kv * 4  # K/V again + the fp32 dK/dV shifts
        add("cp", "p2p", layout.cp, (fwd + bwd) * layers * m, (3 * layout.cp - 2) * layers * m,
            _span_link(layout, layout.cp, layout.tp), "attn", rails=_rails(layout, layout.cp, layout.tp))
    windows: dict[str, float] = {}
    if layout.num_experts and layout.ep > 1:  # estimator/comm_ep.py: the combine hides behind the shared expert
        stride = 1 if layout.ep_over_tp else layout.cp * layout.tp  # TP + EP: the group takes the tp ranks first
        windows = ep_all_to_alls(layout, hw, add, _span_link(layout, layout.ep, stride),
                                 _rails(layout, layout.ep, stride))
    return _expose(entries, t_compute, m, 3 / 4 if layout.recompute == "full" else 2 / 3, windows)


def _fsdp(layout: Layout, units: int, layers: int, add, head: int = 0, embed: bool = True) -> None:
    """FSDP2 (every bf16 layout; fp32 zero 1 under TP, 2, 3) and HSDP collectives. Without PP the template
    reduce-scatters every micro-step (parallelize._grad_sync_fn) and FSDP re-gathers per micro-batch: zero 3 in forward
    and again in backward (reshard_after_forward), zero 2 once. Under PP, torch's schedule keeps the unit gathered after
    each backward but the last (set_reshard_after_backward) and reduce-scatters once: zero 3 re-gathers for each
    backward (m + 1 in all), zero 2 gathers once. Units held across micro-batches without PP (fsdp.holds_step) gather
    once; ZeRO-1 on FSDP2 also reduce-scatters once (Megatron's distributed optimizer: one reduce-scatter of the
    gradients and one all-gather of the parameters per step, the volume of one all-reduce). HSDP (dp_replicate r > 1,
    and bf16 ZeRO-0 with r = dp*cp and shard groups of one rank, which FSDP2 copies instead of collecting): the shard
    group is dp*cp / r ranks; the reduced shard is then all-reduced across the r replicas.
    Units (fsdp_units.py): the blocks, the embedding (`embed`) and [norm, output] (`head`: its gathered bytes),
    which is not re-gathered in backward unless parallel.fsdp_reshard=always; zero 3 under PP re-gathers only
    under always (layout.reshards_blocks)."""
    m, cb = layout.n_micro_batches, (2 if layout.precision == "mp" else 4)
    r = layout.replicas if layout.replicas > 1 and layout.dpcp % layout.replicas == 0 else 1
    shard = layout.dpcp // r
    link, rails = _span_link(layout, shard, layout.tp), _rails(layout, shard, layout.tp)
    n_units = layers + int(embed) + int(head > 0)
    extra_rs = (0, 0)
    if layout.pp > 1:
        gathers, ag_window = (m + 1, "all") if layout.reshards_blocks else (1, "bwd_last")
        add("fsdp", "all_gather", shard, units * gathers, n_units * gathers, link, ag_window, rails=rails)
        syncs, rs_window, first = 1, "bwd_last", 0.0
    elif layout.fsdp_holds_units:
        # fsdp.holds_step: the units are gathered once per step, in the first micro-batch's forward (prefetched
        # one unit ahead, the first unit exposed), and stay gathered; ZeRO-1 reduce-scatters once, in the last
        # micro-batch's backward, kept zero-2 units every micro-batch
        first = 1.0 / n_units
        add("fsdp", "all_gather", shard, units, n_units, link, "fwd_first", critical=first, rails=rails)
        syncs, rs_window = (1, "bwd_last") if layout.fsdp_defers_reduce else (m, "bwd")
    else:
        # FSDP2 prefetches one unit ahead in the order it runs (fully_shard's implicit prefetch), so a forward's
        # gathers hide behind that forward and a backward's behind that backward; the first unit of each pass
        # (the embedding's in forward, the head's in backward, which zero 3 keeps from its forward) and the
        # last reduce-scatter (the embedding's) wait with nothing to overlap
        # (Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, sec. 3.3: 1 of n_units of each)
        first = 1.0 / n_units
        add("fsdp", "all_gather", shard, units * m, n_units * m, link, "fwd", critical=first, rails=rails)
        # the chunked loss calls `output` once per chunk: the second call enters the [norm, output] unit's forward
        # again (FSDPParamGroup.pre_forward registers a second post-backward hook), so after that chunk's backward
        # the unit reduce-scatters and reshards, and the first chunk's recompute gathers it again (measured, torch
        # 2.13: 2 post_backward and 1 unshard of the unit per backward; tests/test_fsdp_units.py). Priced in the
        # backward's gathers (zero 3) and reduce-scatters; zero 2's extra gather of the head is not priced.
        twice = int(head > 0 and _acts(layout).chunks > 1)  # the loss's token chunks (config.loss_chunk_count)
        if layout.reshards_blocks:  # every unit but [norm, output] (unless always) gathered again for its backward
            again, n_again = (units, n_units) if layout.head_reshards else (units - head, n_units - int(head > 0))
            again, n_again = again + twice * head, n_again + twice
            add("fsdp", "all_gather", shard, again * m, n_again * m, link, "bwd", critical=first, rails=rails)
        syncs, rs_window = m, "bwd"
        extra_rs = (4 * twice * head // cb, twice)
    # the shard group's collectives are FSDP's own; HSDP adds the replica all-reduce
    rs_bytes, rs_calls = 4 * units // cb + extra_rs[0], n_units + extra_rs[1]
    add("fsdp", "reduce_scatter", shard, rs_bytes * syncs, rs_calls * syncs, link, rs_window,
        critical=first, rails=rails)
    if r > 1:  # HSDP's replicas, or bf16 ZeRO-0's (each rank a replica of the one shard: DDP's all-reduce)
        add("dp" if layout.zero == 0 else "hsdp", "all_reduce", r, rs_bytes // shard * syncs, rs_calls * syncs,
            _span_link(layout, r, shard * layout.tp), rs_window, rails=_rails(layout, r, shard * layout.tp))


def _expose(entries: list[tuple[dict, str | None, float]], t_compute: float, m: int,
            bwd_share: float = 2 / 3, windows: dict[str, float] | None = None) -> list[CommItem]:
    """Per link: critical-path collectives are exposed in full; the others share the compute they can hide
    behind. Compute overlapping a collective of time C runs 1 + s slower (OVERLAP_SLOWDOWN), so behind a window
    of W seconds of compute the pair takes max(W + k C, C) with k = s / (1 + s): every hidden collective costs
    k of its time, and a window group costs the largest max(0, (1 - k) (sum of times) - window) over the
    nested groups besides, split over that group's collectives in proportion to their time. `bwd_share`: the
    backward's part of the compute (2/3; 3/4 under full recompute, whose forward replay runs in backward).
    `windows`: comm_ep's, one collective's each: max(0, (1 - k) C - W) is critical, the rest hides as above."""
    t_bwd = t_compute * bwd_share
    size = {"bwd_last": t_bwd / max(m, 1), "bwd": t_bwd, "fwd_first": (t_compute - t_bwd) / max(m, 1),
            "fwd": t_compute - t_bwd, "attn": 0.3 * t_compute, "all": t_compute}
    k = OVERLAP_SLOWDOWN / (1 + OVERLAP_SLOWDOWN)
    entries = [(e, w, max(0.0, (1 - k) * e["time_s"] - windows[w]) / ((1 - k) * e["time_s"]))
               if w in (windows or {}) else (e, w, c) for e, w, c in entries]
    exposed = [e[0]["time_s"] * (e[2] + k * (1 - e[2])) if e[1] else e[0]["time_s"] for e in entries]
    for link in {e[0]["link"] for e in entries}:
        idx = [i for i, e in enumerate(entries) if e[0]["link"] == link and e[1]]
        if not idx:
            continue
        hide = {i: entries[i][0]["time_s"] * (1 - entries[i][2]) for i in idx}
        worst, group = 0.0, []
        for names in _WINDOW_SETS:
            members = [i for i in idx if entries[i][1] in names]
            over = (1 - k) * sum(hide[i] for i in members) - size[names[-1]]
            if members and over > worst:
                worst, group = over, members
        total = sum(hide[i] for i in group)
        for i in group:
            exposed[i] += worst * hide[i] / total
    return [CommItem(**e[0], exposed_s=exp, overlaps=_WINDOW_WORDS[e[1]]) for e, exp in zip(entries, exposed)]


# parallel/context_parallel.py RING_KERNEL and RING_KERNEL_DTYPE, quoted rather than imported (the estimator
# stays free of torch); tests/test_cost_terms.py fails when these and the ring's own differ. Every ring block
# runs torch's fused attention (LSE out, no score tile) in the compute dtype, the diagonal blocks with its causal
# flag: the ring's attention FLOPs are hardware_flops_per_token's causal half at the compute dtype's peak.
CP_RING_KERNEL = "fused_sdpa"
CP_RING_KERNEL_DTYPE = "compute"


def ring_attention_dtype(layout: Layout) -> str:
    """The dtype whose peak prices CP's ring attention (CP_RING_KERNEL_DTYPE: the compute dtype, or fp32)."""
    return layout.dtype if CP_RING_KERNEL_DTYPE == "compute" else "float32"


def _stage_costs(layout: Layout, hw: HardwareProfile) -> tuple[float, float, float]:
    """Busy seconds per step of this rank's dp x cp x tp share of (all blocks, LM head + loss, embedding), by
    estimator/compute.py. Blocks: the Linears' executed FLOPs at their shapes' GEMM efficiency, the causal
    attention core at the fused kernel's efficiency for its block length (CP's ring at the peak of the dtype its
    kernel runs in, ring_attention_dtype), the element-wise passes and the weight-gradient writes by bytes.
    The last stage's head: its GEMM plus the loss (log_softmax forward + backward: ~4 fp32 passes over
    [tokens, V/tp], memory-bound). The first stage's embedding: its dense [V/tp, D] fp32 gradient (zero-fill +
    index-add per micro-batch, memory-bound)."""
    tokens = layout.global_batch * layout.seq_len / (layout.dp * layout.cp)  # this rank's tokens per step
    peak = hw.peak_flops(layout.dtype)
    bw = hw.mem_bw_gbps * 1e9
    head_tok = 6.0 * layout.vocab_size * layout.d_model
    attn_tok = attention_flops_per_token(layout)
    linear = tokens * (hardware_flops_per_token(layout) - head_tok - attn_tok) / layout.tp
    linear += tokens * mla_replicated_flops_per_token(layout) * (1.0 - 1.0 / layout.tp)  # MLA: replicated under TP
    attn_peak = hw.peak_flops(ring_attention_dtype(layout)) if layout.cp > 1 else peak
    # every block's local parameters (before FSDP): a MoE model's dense first blocks hold their own SwiGLU
    n_blocks = sum(n * sum(d0 * rest for d0, rest, _, _ in _block_tensors(layout, dense=d))
                   for n, d in ((layout.first_k_dense, True), (layout.n_layers - layout.first_k_dense, False)))
    lin_eff, head_eff, attn_eff, elem_bytes, param_bytes = block_rates(layout, hw)
    blocks = linear / (peak * lin_eff) + tokens * attn_tok / layout.tp / (attn_peak * attn_eff) + \
        (tokens * layout.n_layers * elem_bytes + layout.n_micro_batches * n_blocks * param_bytes) / bw
    head = tokens * head_tok / layout.tp / (peak * head_eff) + \
        tokens * 16.0 * layout.vocab_size / layout.tp / bw
    embed = layout.n_micro_batches * 8.0 * layout.vocab_size * layout.d_model / layout.tp / bw
    return blocks, head, embed


def _pipeline(layout: Layout, hw: HardwareProfile) -> tuple[float, list[float]]:
    """(makespan, busy compute per pipeline rank) of one step. The schedule is paced by its busiest rank (the
    one with the head, or with embedding and head under ZBV's V placement), and idles the schedule's bubble
    (`bubble_ratio`: its simulated action order with equal stages) times the average rank's work:
    makespan = max(W_r) + bubble x mean(W_r); with equal stages it is the simulation's own makespan."""
    blocks, head, embed = _stage_costs(layout, hw)
    if layout.pp == 1:
        return blocks + head + embed, [blocks + head + embed]
    layers, first, last = _rank_layers(layout)
    # each rank's share of the block time by its layers' forward FLOPs (pipeline_split.stage_costs: a MoE
    # model's dense first blocks cost less than its MoE blocks)
    if layout.first_k_dense:
        w_dense, w_moe = _layer_weights(layout)
        kinds = [block_kinds(layout, stage_ids(layout, r)) for r in range(layout.pp)]
        total = layout.first_k_dense * w_dense + (layout.n_layers - layout.first_k_dense) * w_moe
        busy = [blocks * (nd * w_dense + nm * w_moe) / total for nd, nm in kinds]
    else:
        busy = [blocks * n / layout.n_layers for n in layers]
    busy[first] += embed
    busy[last] += head
    return max(busy) + bubble_ratio(layout) * sum(busy) / layout.pp, busy


def _layer_weights(layout: Layout) -> tuple[int, int]:
    """(dense first block, MoE block) forward FLOPs per token (pipeline_split.stage_costs)."""
    from curry_train.pipeline_split import stage_costs

    shape = dict(d_model=layout.d_model, n_heads=layout.n_heads, n_kv_heads=layout.n_kv_heads,
                 vocab_size=layout.vocab_size, seq_len=layout.seq_len)
    moe = stage_costs(**shape, d_ff=layout.d_ff, num_experts=layout.num_experts, top_k=layout.top_k,
                      shared_d_ff=layout.shared_d_ff)[0]
    return stage_costs(**shape, d_ff=layout.dense_d_ff)[0], moe


def _rank_layers(layout: Layout) -> tuple[tuple[int, ...], int, int]:
    """(layers each pipeline rank holds under the template's own split (pipeline_split, possibly uneven), the
    rank with stage 0, the rank with the last stage)."""
    n_stages = layout.pp * layout.pp_virtual
    ids = [stage_ids(layout, r) for r in range(layout.pp)]
    layers = tuple(rank_layers(layout, st) for st in ids)
    return layers, next(r for r, st in enumerate(ids) if 0 in st), \
        next(r for r, st in enumerate(ids) if n_stages - 1 in st)


def _step_time(layout: Layout, hw: HardwareProfile) -> tuple[StepTime, list[CommItem]]:
    tokens_step = layout.global_batch * layout.seq_len
    peak = hw.peak_flops(layout.dtype)
    span, busy = _pipeline(layout, hw)
    t_compute = max(busy)
    bubble = max(0.0, span - t_compute)
    items = _comm(layout, hw, busy[0])
    exposed = sum(i.exposed_s for i in items)
    st = _states(layout, stage_ids(layout, 0))
    stepped = st.n_stored
    if shards_optimizer_only(layout.dp, layout.cp, layout.zero, layout.tp, layout.dtype):  # ZeRO-1: its 1/owners share
        experts = st.n_local - st.ddp_buckets // 4 if layout.num_experts and layout.ep > 1 else 0
        stepped = (st.n_local - experts) / layout.dpcp + experts / ((layout.dp // layout.ep) * layout.cp)
    t_opt = 28.0 * stepped / (hw.mem_bw_gbps * 1e9)
    total = span + exposed + t_opt
    model_flops = tokens_step * flops_per_token(layout)
    mfu = model_flops / (total * layout.world * peak) if total > 0 else 0.0
    hfu = tokens_step * hardware_flops_per_token(layout) / (total * layout.world * peak) if total > 0 else 0.0
    frac = exposed / total if total > 0 else 0.0
    return StepTime(compute_s=t_compute, bubble_s=bubble, comm_exposed_s=exposed, optimizer_s=t_opt, total_s=total,
                    tokens_per_s=tokens_step / total if total > 0 else 0.0, mfu=mfu, hfu=hfu, comm_fraction=frac,
                    comm_bound=frac > 0.5, stage_compute_s=busy if layout.pp > 1 else []), items
