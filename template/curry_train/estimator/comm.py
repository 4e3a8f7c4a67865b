"""Communication and step time for the estimator: collectives per optimizer step with ring factors and
alpha-beta times per link (intra vs inter node); step time = compute at the profile's efficiency + bubble +
exposed communication + optimizer.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from curry_train.estimator.acts import _acts, _moe_slots
from curry_train.estimator.layout import _block_tensors, _Layout, flops_per_token, hardware_flops_per_token
from curry_train.estimator.pipeline import bubble_fraction, stage_ids
from curry_train.estimator.profiles import HardwareProfile
from curry_train.estimator.states import _states

FIRST_BUCKET_BYTES = 1 * 2**20  # DDP's first bucket; later ones are 25 MiB
BUCKET_BYTES = 25 * 2**20


class CommItem(BaseModel):
    """One kind of collective of one primitive, per optimizer step, as seen by one rank."""

    primitive: str = Field(description="dp, zero1, fsdp, tp, pp, cp or ep.")
    collective: str = Field(description="all_reduce, all_gather, reduce_scatter, broadcast, all_to_all or p2p.")
    group_size: int
    calls: int = Field(description="Collectives issued per step.")
    bytes: int = Field(description="Payload bytes per step (S summed over calls, before ring factors).")
    wire_bytes: int = Field(description="Bytes each rank sends per step (ring factors applied).")
    link: str = Field(description="intra (NVLink) or inter (network): the slowest link the group spans.")
    time_s: float = Field(description="alpha-beta time of these collectives.")
    exposed_s: float = Field(description="Part not hidden behind compute.")


class StepTime(BaseModel):
    compute_s: float = Field(description="FLOPs of this rank at peak x efficiency, recompute included.")
    bubble_s: float = Field(description="Pipeline bubble.")
    comm_exposed_s: float = Field(description="Exposed communication, all primitives.")
    optimizer_s: float = Field(description="AdamW step (memory-bound).")
    total_s: float
    tokens_per_s: float
    mfu: float = Field(description="Model FLOPs utilisation (PaLM convention: 6N + 12 L H Dh s per token).")
    comm_fraction: float = Field(description="Exposed communication / step time.")
    comm_bound: bool = Field(description="Exposed communication exceeds half the step.")


def _span_link(x: _Layout, group: int, stride: int) -> str:
    """intra when a group of `group` ranks at `stride` fits in one node (rank = ((pp*dp+dp)*cp+cp)*tp+tp)."""
    return "intra" if group * stride <= x.gpn else "inter"


def _coll_time(hw: HardwareProfile, kind: str, n: int, nbytes: float, calls: int, link: str) -> tuple[float, float]:
    """(wire bytes per rank, alpha-beta seconds) for `calls` collectives moving `nbytes` in total."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    bw = (hw.intra_node_gbps if link == "intra" else hw.inter_node_gbps) * 1e9
    alpha = (hw.alpha_intra_us if link == "intra" else hw.alpha_inter_us) * 1e-6
    if kind == "all_reduce":
        wire, steps = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    elif kind in ("all_gather", "reduce_scatter", "all_to_all") or kind == "broadcast":
        wire, steps = (n - 1) / n * nbytes, n - 1
    else:  # p2p
        wire, steps = nbytes, 1
    return wire, calls * steps * alpha + wire / bw


def _comm(x: _Layout, hw: HardwareProfile, t_compute: float) -> list[CommItem]:
    """Collectives per optimizer step on the pipeline rank holding the first stage."""
    items: list[CommItem] = []
    a = _acts(x)
    st = _states(x, stage_ids(x, 0))
    m = x.m
    t_bwd = t_compute * 2 / 3

    def add(prim: str, kind: str, n: int, nbytes: float, calls: int, link: str, overlap_s: float,
            exposed_share: float = 1.0) -> None:
        """`overlap_s` of compute can hide the collectives; `exposed_share` of them is on the critical path."""
        if n <= 1 or nbytes <= 0 or calls <= 0:
            return
        wire, tm = _coll_time(hw, kind, n, nbytes, calls, link)
        items.append(CommItem(primitive=prim, collective=kind, group_size=n, calls=calls, bytes=int(nbytes),
                              wire_bytes=int(wire), link=link, time_s=tm,
                              exposed_s=max(0.0, tm * exposed_share - overlap_s)))

    dp_link = _span_link(x, x.dpcp, x.tp)
    layers = x.L // x.pp
    if x.ddp:
        nbytes = st.ddp_buckets
        calls = max(1, math.ceil(max(nbytes - FIRST_BUCKET_BYTES, 0) / BUCKET_BYTES) + 1)
        # DDP's bucketed all-reduce overlaps the last micro-batch's backward; the last bucket is exposed
        add("dp", "all_reduce", x.dpcp, nbytes, calls, dp_link, t_bwd / m * 0.9)
        if x.E and x.ep > 1:
            add("ep", "all_reduce", (x.dp // x.ep) * x.cp, 4 * (st.n_local - st.ddp_buckets // 4), 1,
                dp_link, 0.0)
        if x.zero == 1:  # ZeroRedundancyOptimizer broadcasts every parameter from its owner after the step
            n_tensors = len(_block_tensors(x)) * layers + 3
            add("zero1", "broadcast", x.dpcp, 4 * st.n_local, n_tensors, dp_link, 0.0)
    if x.fsdp:
        cb = 2 if x.path == "mp" else 4
        units = st.all_units
        ag_per_mb = 2 if x.zero == 3 else 1
        if x.pp > 1:
            ag_per_mb = 1
        n_units = layers + 1
        # HSDP (x.dpr > 1): all-gather and reduce-scatter inside the shard group (mesh.fsdp_mesh: consecutive
        # ranks, inside a node when shard * tp fits), then each gradient shard all-reduced across the replicas
        shard_link = _span_link(x, x.shard, x.tp)
        add("fsdp", "all_gather", x.shard, units * ag_per_mb * m, n_units * ag_per_mb * m, shard_link,
            t_compute * 0.9)
        rs = 1 if x.pp > 1 else m  # every micro-step (parallelize._grad_sync_fn), once per step under PP
        add("fsdp", "reduce_scatter", x.shard, 4 * units // cb * rs, n_units * rs, shard_link, t_bwd * 0.9)
        if x.dpr > 1:
            add("hsdp", "all_reduce", x.dpr, 4 * units // cb // x.shard * rs, n_units * rs, dp_link, t_bwd * 0.9)
    if x.tp > 1:
        # tensor_parallel.py: one `f` (identity / all-gather under SP) and one `g` (all-reduce / reduce-scatter)
        # per attention and per MLP sub-block, forward and backward: 4 all-reduces of [b, T, D] per layer per
        # micro-batch, or 4 all-gathers + 4 reduce-scatters under SP (same bytes). Recompute replays the
        # forward ones (selective keeps SP's reduce-scatter outputs, so only its all-gathers replay).
        nb = x.b * (x.s // x.cp) * x.D * (2 if x.path != "fp32" else 4)
        per_layer = 4 + (2 if x.recompute == "full" else 0)
        if x.sp:
            ag = per_layer + (1 if x.recompute == "selective" else 0) * 2
            add("tp", "all_gather", x.tp, nb * ag * layers * m, ag * layers * m, "intra", 0.0)
            add("tp", "reduce_scatter", x.tp, nb * per_layer * layers * m, per_layer * layers * m, "intra", 0.0)
        else:
            add("tp", "all_reduce", x.tp, nb * per_layer * layers * m, per_layer * layers * m, "intra", 0.0)
    if x.pp > 1:
        # one activation forward and one gradient backward per micro-batch per chunk boundary; only the fill
        # and drain hops (2 (p - 1)) sit on the critical path, the rest overlap the other stages' compute
        link = "intra" if x.dp * x.cp * x.tp * 2 <= x.gpn else "inter"
        hops = 2 * m * x.v
        add("pp", "p2p", 2, a.stream * hops, hops, link, 0.0, exposed_share=min(1.0, 2 * (x.pp - 1) / hops))
    if x.cp > 1:
        cb = 2 if x.path != "fp32" else 4
        kv = 2 * x.b * (x.G // x.tp) * (x.s // x.cp) * x.Dh
        fwd = (x.cp - 1) * kv * cb
        bwd = (x.cp - 1) * kv * cb + x.cp * kv * 4  # K/V again + the fp32 dK/dV shifts
        nbytes = (fwd + bwd) * layers * m
        calls = (3 * x.cp - 2) * layers * m
        link = _span_link(x, x.cp, x.tp)
        add("cp", "p2p", x.cp, nbytes, calls, link, t_compute * 0.3)
    if x.E and x.ep > 1:
        n = x.b * x.s // x.cp
        _, Sk = _moe_slots(x, n)
        cb = 2 if x.path != "fp32" else 4
        nbytes = 4 * Sk * x.D * cb * layers * m  # dispatch + combine, forward and backward
        add("ep", "all_to_all", x.ep, nbytes, 4 * layers * m, _span_link(x, x.ep, x.cp * x.tp), 0.0)
    return items


def _step_time(x: _Layout, hw: HardwareProfile) -> tuple[StepTime, list[CommItem]]:
    tokens_step = x.gb * x.s
    f_rank = tokens_step * hardware_flops_per_token(x) / (x.dp * x.cp * x.tp * x.pp)
    peak = hw.peak_flops(x.dtype)
    t_compute = f_rank / (peak * hw.efficiency)
    if x.cp > 1:
        # context_parallel.py's ring attention multiplies unfused fp32 score tiles (no flash kernel): its
        # attention FLOPs (causal half, plus the masked diagonal tiles) run at the fp32 peak, not the bf16 one
        attn = tokens_step * 6.0 * x.L * x.H * x.Dh * x.s * (1 + 1 / (2 * x.cp)) / (x.dp * x.cp * x.tp * x.pp)
        if x.recompute == "full":
            attn *= 4.0 / 3.0
        t_compute += attn / (hw.peak_flops("float32") * hw.efficiency) - attn / (peak * hw.efficiency)
    bubble = t_compute * bubble_fraction(x)
    items = _comm(x, hw, t_compute)
    exposed = sum(i.exposed_s for i in items)
    st = _states(x, stage_ids(x, 0))
    t_opt = 28.0 * st.n_stored / (hw.mem_bw_gbps * 1e9) / (x.dpcp if x.zero == 1 and x.dpcp > 1 else 1)
    total = t_compute + bubble + exposed + t_opt
    model_flops = tokens_step * flops_per_token(x)
    mfu = model_flops / (total * x.world * peak) if total > 0 else 0.0
    frac = exposed / total if total > 0 else 0.0
    return StepTime(compute_s=t_compute, bubble_s=bubble, comm_exposed_s=exposed, optimizer_s=t_opt, total_s=total,
                    tokens_per_s=tokens_step / total if total > 0 else 0.0, mfu=mfu, comm_fraction=frac,
                    comm_bound=frac > 0.5), items
