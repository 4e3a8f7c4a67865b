"""Analytical per-rank memory, communication, FLOPs and step time of *this template's* implementation.

    curry-train estimate --config llama3-8b --set parallel.dp=8 --set parallel.zero=3 --json
    python -c "from curry_train.estimate import estimate_memory; print(estimate_memory('tiny').memory)"

Pure arithmetic (no tensor is allocated; 405B takes milliseconds). It models what the template does, not a
textbook transformer (estimation-formulas.md §1-§8, with the implementation corrections of §2.2 and §12):

Dtype policy (train.dtype = float32 | bfloat16):
  master params fp32 (4 B), grads fp32 (4 B), AdamW exp_avg + exp_avg_sq fp32 (8 B), plus a 4-byte `step`
  tensor per parameter tensor (counted on CPU only: AdamW keeps it on the host unless capturable/fused).
  compute fp32: every activation 4 B.
  compute bf16, no FSDP (single process, DDP, ZeRO-1, TP, PP): torch.autocast. The residual stream and the
    RMSNorm inputs/outputs stay fp32 (the embedding is not autocast, and fp32 + bf16 = fp32); every Linear
    saves a *bf16 copy* of its input (wq, wk and wv each cast the same input: three copies) and of its weight.
  compute bf16 under FSDP (zero >= 2 with dp*cp > 1): MixedPrecisionPolicy(bf16 params, fp32 reduce). The
    stream is bf16, RMSNorm saves its fp32 upcast and a bf16 normalised copy, weights are gathered in bf16.
  logits: compute dtype; the loss upcasts them and log_softmax saves an fp32 [tokens, V] tensor.

Per op, what autograd saves (measured on torch 2.13 CPU with saved-tensor hooks, exact to the byte):
  RMSNorm: input, rsqrt [tokens, 1] fp32, normalised x; wq/wk/wv: their input; RoPE: only cos/sin;
  GQA repeat_interleave: the repeated k, v are new tensors [B, H, T, Dh]; SDPA (CPU flash and CUDA flash):
  q, k, v, out and the fp32 logsumexp [B, H, T]; the transpose+reshape before wo copies out (wo saves the copy);
  SwiGLU: w1 and w3 outputs, silu(w1 x), and the product (w2's input); MoE: router probs and gates, dispatched
  and combined rows, per-expert SwiGLU intermediates (and each SelectBackward's full-size expert gradient in
  backward); ring attention (CP): q, the un-repeated k/v, an fp32 out and lse; TP's loss_parallel: an fp32
  log_softmax of the local vocabulary slice; the vocab-parallel embedding's gradient is full-size.
Implementation buffers modelled: DDP's flat gradient buckets (gradient_as_bucket_view=False: a second fp32 copy
of the gradients), ZeroRedundancyOptimizer's greedy whole-tensor partition, FSDP2's padded dim-0 shards, the
gathered units (zero 2: all of them from forward to backward; zero 3: root + current + prefetched block), the
unsharded fp32 gradients FSDP2 accumulates under a pipeline (its schedule turns sync off for all micro-batches
but the last; without PP the template reduce-scatters every micro-step), the reduce-scatter input kept in flight, the pipeline's receive buffers
(one per micro-batch) and the logits the schedule keeps for every micro-batch (step() returns the outputs), the
loss's transients (two fp32 [tokens, V] gradients), AdamW's step temporaries.

The peak is the largest of a few moments of the step (the loss and LM-head backward, a block's backward at the
SwiGLU gradient or in RMSNorm's backward, the step's last block backward, the optimizer step; with a pipeline, at
the schedule's fullest backward starts); `memory` reports the components live at that moment, for the pipeline
rank with the largest total (every other axis is symmetric; ZeRO-1 and FSDP padding take rank 0's share, the
largest). Checked against curry_train.memory on 39 tiny layouts (benchmarks/estimator_accuracy.py): model
states exact, median total error < 0.1%. Communication uses ring factors and alpha-beta times per link (intra
vs inter node); step time = compute at the profile's efficiency + bubble + exposed communication + optimizer.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .config import Config, from_dict, load_yaml
from .hardware_profiles import HardwareProfile, from_device_name, from_probe, get_profile, guess_profile

GiB = 2**30

# Implementation facts this estimator encodes (change them here when the template changes).
PP_KEEPS_OUTPUTS = True  # pipeline.py calls schedule.step() with return_outputs=True: logits of every micro-batch
# parallelize._grad_sync_fn: FSDP reduce-scatters on every micro-step (sharded grads accumulate), but a pipeline
# schedule turns sync off for all but the last micro-batch, so FSDP under PP keeps unsharded fp32 accumulators
FSDP_ACCUMULATES_UNSHARDED_UNDER_PP = True
CUDA_CONTEXT_RESERVE_GIB = 2.0  # CUDA context, cuBLAS/NCCL workspaces: outside torch's allocator
FRAGMENTATION_RESERVE = 0.05  # caching-allocator fragmentation (Megatron adds 5%)
FIRST_BUCKET_BYTES = 1 * 2**20  # DDP's first bucket; later ones are 25 MiB
BUCKET_BYTES = 25 * 2**20


# ----------------------------------------------------------------------------------------------- results


class MemoryBreakdown(BaseModel):
    """Bytes live on one rank at its peak, in the components bench reports (curry_train.memory's categories,
    folded as bench.fold does)."""

    params: int = Field(description="fp32 master params (full, TP-local or this rank's FSDP shard) plus working "
                                    "copies: FSDP-gathered units, autocast's bf16 weight casts.")
    grads: int = Field(description=".grad tensors plus DDP's buckets and FSDP's unsharded gradients/accumulators.")
    optimizer: int = Field(description="AdamW state (exp_avg, exp_avg_sq, step) this rank owns.")
    activations: int = Field(description="Forward-created tensors alive at the peak: what backward reads for every "
                                         "in-flight micro-batch, logits, the batch; recomputed ones too.")
    other: int = Field(description="Everything else: gradients of activations and other backward temporaries, "
                                   "loss gradients, communication staging, pipeline buffers, module buffers.")
    total: int = Field(description="Sum of the five: the per-rank peak.")
    pp_rank: int = Field(0, description="Pipeline rank this breakdown is for.")
    phase: str = Field("", description="Moment of the step where the peak falls.")
    detail: dict[str, int] = Field(default_factory=dict, description="Named pieces of the components.")

    def gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / GiB, 3) for k in ("params", "grads", "optimizer", "activations",
                                                               "other", "total")}


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


class Estimate(BaseModel):
    """The estimator's answer for one config."""

    memory: MemoryBreakdown = Field(description="The rank with the largest total.")
    per_pp_rank: list[MemoryBreakdown] = Field(description="One breakdown per pipeline rank.")
    budget_bytes: int = Field(description="hardware.gpu_memory_gib.")
    reserve_bytes: int = Field(description="Held back for the CUDA context/NCCL and fragmentation (0 on CPU).")
    usable_bytes: int = Field(description="budget - reserve: what the peak must stay under.")
    fits: bool
    headroom_bytes: int = Field(description="usable - total (negative: over budget).")
    param_count: int = Field(description="Parameters of the whole model.")
    params_per_rank: int = Field(description="Parameters stored on the largest rank (after TP/PP/EP/FSDP).")
    model_state_bytes: int = Field(description="fp32 params + final grads + AdamW state on the largest rank.")
    model_state_bytes_per_param: float = Field(
        description="model_state_bytes / param_count: 16 for DDP, 16/d under ZeRO-3 (the ZeRO paper's Fig. 1).")
    active_params_per_token: int = Field(description="Matmul parameters one token passes through (MoE: top-k).")
    flops_per_token: float = Field(description="Model FLOPs per token, fwd+bwd (PaLM: 6N + 12 L H Dh s).")
    hardware_flops_per_token: float = Field(description="Executed FLOPs per token: causal attention, recompute.")
    communication: list[CommItem]
    step_time: StepTime
    hardware: HardwareProfile
    dtype_policy: str
    assumptions: list[str]


# ----------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class _Layout:
    """Everything the arithmetic needs, flattened from a Config (hashable for the caches)."""

    V: int
    D: int
    L: int
    H: int
    G: int
    F: int
    E: int
    K: int
    cf: float
    s: int
    gb: int
    b: int
    dp: int
    zero: int
    recompute: str
    tp: int
    sp: bool
    pp: int
    schedule: str
    v: int
    ep: int
    cp: int
    dtype: str
    device: str
    gpn: int
    nodes: int
    budget_gib: float
    has_z: bool
    has_aux: bool

    @property
    def Dh(self) -> int:
        return self.D // self.H

    @property
    def m(self) -> int:
        return self.gb // (self.dp * self.b)

    @property
    def dpcp(self) -> int:
        return self.dp * self.cp

    @property
    def fsdp(self) -> bool:
        return self.zero >= 2 and self.dpcp > 1

    @property
    def ddp(self) -> bool:
        return self.zero <= 1 and self.dpcp > 1

    @property
    def path(self) -> str:
        """fp32 | autocast | mp: which mixed-precision mechanism computes the model."""
        if self.dtype == "float32":
            return "fp32"
        return "mp" if self.fsdp else "autocast"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def _layout(cfg: Config) -> _Layout:
    m, t, p, h = cfg.model, cfg.train, cfg.parallel, cfg.hardware
    device = h.device if h.device != "auto" else "cuda"
    return _Layout(V=m.vocab_size, D=m.d_model, L=m.n_layers, H=m.n_heads, G=m.n_kv_heads, F=m.d_ff,
                   E=m.num_experts, K=m.top_k, cf=m.capacity_factor, s=t.seq_len, gb=t.global_batch,
                   b=t.micro_batch, dp=p.dp, zero=p.zero, recompute=p.recompute, tp=p.tp, sp=p.sp, pp=p.pp,
                   schedule=p.pp_schedule, v=p.pp_virtual, ep=p.ep, cp=p.cp, dtype=t.dtype, device=device,
                   gpn=h.gpus_per_node, nodes=h.nodes, budget_gib=h.gpu_memory_gib,
                   has_z=m.z_loss_coef > 0, has_aux=m.aux_loss_coef > 0)


# One parameter tensor as one rank holds it before FSDP: (dim0, rest, global numel, fsdp group size kind)
#   kind: "dense" (sharded over dp*cp by FSDP) or "expert" (over edp*cp when ep > 1).
_Tensor = tuple[int, int, int, str]


def _block_tensors(x: _Layout) -> list[_Tensor]:
    """A transformer block's parameters, TP-local (colwise: dim 0 / tp; rowwise: dim 1 / tp)."""
    D, t, Dh = x.D, x.tp, x.Dh
    q, kv = x.H * Dh, x.G * Dh
    out: list[_Tensor] = [(D, 1, D, "dense"), (q // t, D, q * D, "dense"), (kv // t, D, kv * D, "dense"),
                          (kv // t, D, kv * D, "dense"), (D, q // t, D * q, "dense"), (D, 1, D, "dense")]
    if x.E:
        El = x.E // x.ep
        out.append((x.E, D, x.E * D, "dense"))  # router gate [E, D], replicated over tp
        kind = "expert" if x.ep > 1 else "dense"
        out += [(El, D * x.F, x.E * D * x.F, kind)] * 3  # w1, w3 [El, D, F]; w2 [El, F, D]
    else:
        Fl = x.F // t
        out += [(Fl, D, x.F * D, "dense"), (Fl, D, x.F * D, "dense"), (D, Fl, D * x.F, "dense")]
    return out


def _root_tensors(x: _Layout, embed: bool, head: bool) -> list[_Tensor]:
    out: list[_Tensor] = []
    if embed:
        out.append((x.V // x.tp, x.D, x.V * x.D, "dense"))
    if head:
        out += [(x.D, 1, x.D, "dense"), (x.V // x.tp, x.D, x.V * x.D, "dense")]
    return out


def param_count(cfg: Config) -> int:
    """Parameters of the whole model (model.py's module structure: untied head, separate q/k/v, router)."""
    x = _layout(cfg)
    blk = sum(g for _, _, g, _ in _block_tensors(_replace(x, tp=1, ep=1)))
    return x.L * blk + 2 * x.V * x.D + x.D


def _replace(x: _Layout, **kw: Any) -> _Layout:
    d = {f: getattr(x, f) for f in x.__dataclass_fields__}
    d.update(kw)
    return _Layout(**d)


# ----------------------------------------------------------------------------------------------- pipeline


def stage_ids(x: _Layout, pp_rank: int) -> list[int]:
    """Stages a pipeline rank holds (pipeline.py: ZBV places rank r on stages r and 2p-1-r, otherwise looped)."""
    if x.pp == 1:
        return [0]
    if x.schedule == "zero_bubble" and x.v == 2:
        return [pp_rank, 2 * x.pp - 1 - pp_rank]
    return [pp_rank + k * x.pp for k in range(x.v)]


def _actions(x: _Layout, rank: int) -> list[tuple[str, int]]:
    """This rank's compute actions in schedule order: ("F"|"B"|"I"|"W", local chunk index).

    Ports torch.distributed.pipelining's schedules (2.13): Schedule1F1B's warm-up of p - r micro-batches,
    ScheduleGPipe's all-forward-all-backward, the interleaved/zero-bubble warm-up of _get_warmup_ops and
    ScheduleZBVZeroBubble's V order. Only the order on one rank matters for the memory it holds.
    """
    p, m, v = x.pp, x.m, x.v
    if x.schedule == "gpipe" or p == 1:
        return [("F", 0)] * m + [("B", 0)] * m
    if x.schedule == "1f1b":
        warm = min(m, p - rank)
        acts = [("F", 0)] * warm
        for _ in range(m - warm):
            acts += [("B", 0), ("F", 0)]
        return acts + [("B", 0)] * warm
    if x.schedule == "zero_bubble" and v == 2:
        n = max(2 * p - 1, m)
        acts, f0, f1, b0, b1 = [], 0, 0, 0, 0
        for _ in range(2 * (p - rank) - 1):
            acts.append(("F", 0))
            f0 += 1
        for _ in range(rank):
            acts += [("F", 1), ("F", 0)]
            f1 += 1
            f0 += 1
        for _ in range(p - rank):
            acts += [("F", 1), ("I", 1), ("W", 1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                acts.append(("F", 0))
                f0 += 1
            acts += [("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1)]
            b0 += 1
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            acts += [("I", 0), ("I", 1)]
            b0 += 1
            b1 += 1
        for _ in range(p - rank):
            acts += [("I", 0), ("W", 0)]
            b0 += 1
            w0 += 1
        acts += [("W", 1)] * (b1 - w1) + [("W", 0)] * (b0 - w0)
        return acts
    # interleaved 1F1B / interleaved zero bubble (looped placement)
    zb = x.schedule == "zero_bubble"
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zb else 2) * (p - 1 - rank), m * v)
    total = m * v

    def fwd_chunk(step: int) -> int:
        return (step // per_round) % v

    def bwd_chunk(step: int) -> int:
        return v - 1 - ((step - warm) // per_round) % v

    acts: list[tuple[str, int]] = []
    pending_w: list[int] = []
    for op in range(total + warm):
        if op < warm:
            acts.append(("F", fwd_chunk(op)))
        elif op < total:
            acts.append(("F", fwd_chunk(op)))
            c = bwd_chunk(op)
            acts.append(("I" if zb else "B", c))
            if zb:
                pending_w.append(c)
                if op - warm >= rank:
                    acts.append(("W", pending_w.pop(0)))
        else:
            c = bwd_chunk(op)
            acts.append(("I" if zb else "B", c))
            if zb:
                pending_w.append(c)
                if op - warm >= rank:
                    acts.append(("W", pending_w.pop(0)))
    acts += [("W", c) for c in pending_w]
    return acts


@dataclass(frozen=True)
class _PipeState:
    """A pipeline rank just before one of its backwards starts."""

    held: tuple[int, ...]  # per local chunk: micro-batches whose activations are alive
    grads: float  # share of this rank's chunks that already hold gradients (0 before the first backward)
    head_fwds: int  # forwards the head chunk has run so far (their logits are kept by step())
    chunk: int  # the chunk whose backward starts


def pipe_states(x: _Layout, rank: int) -> list[_PipeState]:
    """The backward starts worth evaluating: the one with the most activations alive, the most with gradients
    already there, and (last stage) the last one, when every micro-batch's logits are kept.

    A zero-bubble input-backward (I) keeps the graph, and so the activations, until its weight-backward (W)."""
    return _pipe_states(x.schedule, x.pp, x.v, x.m, rank)


@lru_cache(maxsize=8192)
def _pipe_states(schedule: str, pp: int, v: int, m: int, rank: int) -> list[_PipeState]:
    # The schedules are periodic after the warm-up: simulate at most 8 rounds of micro-batches (keeping m's
    # residue mod pp, which the interleaved warm-up reads) and let the head rank's kept logits count all m.
    m_sim = m if m <= 8 * pp * v else 8 * pp * v + m % pp
    states = _simulate_pipe(schedule, pp, v, m_sim, rank)
    if m_sim == m:
        return states
    return [_PipeState(s_.held, s_.grads, m, s_.chunk) if s_.head_fwds and i else s_ for i, s_ in enumerate(states)]


def _simulate_pipe(schedule: str, pp: int, v: int, m: int, rank: int) -> list[_PipeState]:
    x = _PipeKey(schedule=schedule, pp=pp, v=v, m=m)
    stages = stage_ids(x, rank)  # type: ignore[arg-type]
    n_chunks = len(stages)
    head = stages.index(pp * v - 1) if pp * v - 1 in stages else -1
    held = [0] * n_chunks
    has_grads = [False] * n_chunks
    fwd_head, n_grads = 0, 0
    most = with_grads = last = None
    most_key = wg_key = (-1, -1.0)
    for kind, c in _actions(x, rank):  # type: ignore[arg-type]
        if kind == "F":
            held[c] += 1
            fwd_head += c == head
            continue
        if kind in ("B", "I"):
            total, g = sum(held), n_grads / n_chunks
            if (total, g) > most_key or (g, total) > wg_key:
                state = _PipeState(tuple(held), g, fwd_head, c)
                if (total, g) > most_key:
                    most, most_key = state, (total, g)
                if (g, total) > wg_key:
                    with_grads, wg_key = state, (g, total)
            last = (tuple(held), n_grads / n_chunks, fwd_head, c)
        if kind in ("B", "W"):
            held[c] -= 1
            if not has_grads[c]:
                has_grads[c] = True
                n_grads += 1
    if most is None:
        return [_PipeState(tuple(held), 0.0, fwd_head, 0)]
    out = [most] + ([with_grads] if with_grads != most else [])
    if head >= 0 and last is not None:
        last_state = _PipeState(*last)
        if last_state not in out:
            out.append(last_state)
    return out


@dataclass(frozen=True)
class _PipeKey:
    """The fields of _Layout the schedule simulation reads."""

    schedule: str
    pp: int
    v: int
    m: int


def in_flight(x: _Layout, rank: int) -> tuple[list[int], int]:
    """(per local chunk: micro-batches held at the fullest backward start, their total)."""
    s_ = max(pipe_states(x, rank), key=lambda q: sum(q.held))
    return list(s_.held), sum(s_.held)


def bubble_fraction(x: _Layout) -> float:
    """Idle fraction of a pipeline step (estimation-formulas.md §3): (p-1)/m for GPipe and 1F1B, divided by
    v for interleaving, and about a third of that again for zero bubble (B/W split fills most of it)."""
    if x.pp == 1:
        return 0.0
    f = (x.pp - 1) / (x.m * (x.v if x.schedule in ("interleaved_1f1b", "zero_bubble") else 1))
    return f / 3 if x.schedule == "zero_bubble" else f


# ----------------------------------------------------------------------------------------------- activations


@dataclass
class _Acts:
    """Bytes of one micro-batch on this rank (n = b * T / cp tokens), by what holds them."""

    layer_saved: int  # per layer, kept from forward to backward (after recompute's dropping)
    layer_full: int  # per layer without recompute (what a recomputed block materialises in backward)
    ffn_saved: int  # the FFN's share of layer_full (its input copies and SwiGLU / expert intermediates)
    prod: int  # the SwiGLU product w2 saves (freed by the first op of a block's backward)
    ffn_bwd: int  # the FFN backward's working set: dprod + dsilu + dup (three [n, F] gradients)
    pcopy_layer: int  # autocast: bf16 copies of one layer's weights (memory.py: param_copies)
    pcopy_head: int  # autocast: bf16 copy of the LM head weight
    embed: int  # token ids (+ TP's masked ids and mask)
    head: int  # final norm's saved tensors and the head's input
    lsm: int  # fp32 log_softmax output saved by the loss
    targets: int  # target ids the loss keeps
    logits: int  # [tokens, V/tp] in the compute dtype, alive until the micro-batch's backward ends
    grad_logits: int  # the logits' gradient (compute dtype)
    dy_head: int  # gradient of the head's input [n, D]
    rope: int  # cos/sin rows indexed per forward call, shared by a chunk's layers
    stream: int  # one hidden state [n_local, D] in the residual dtype
    d_stream: int  # its gradient
    lin_out_grads: int  # gradients of one layer's linear outputs (zero bubble keeps them for the W pass)
    ring_bwd: int  # context_parallel.RingAttention.backward's working set
    post_attn: int  # wo's input and the FFN norm's saved tensors (freed before the attention core's backward)


@lru_cache(maxsize=8192)
def _acts(x: _Layout) -> _Acts:
    t, sp = x.tp, x.sp
    T = x.s // x.cp
    n = x.b * T  # tokens per micro-batch on this rank
    nn_ = n // t if sp else n  # tokens in the norm/residual region (SP shards the sequence)
    D, Dh = x.D, x.Dh
    Hl, Gl = x.H // t, x.G // t
    Dq, Dkv = Hl * Dh, Gl * Dh
    rep = x.H // x.G
    Fl = x.F // t
    Vl = x.V // t
    path = x.path
    c = 4 if path == "fp32" else 2  # compute bytes
    r = 2 if path == "mp" else 4  # residual-stream bytes
    cp_ring = x.cp > 1
    # attention core: SDPA saves q, k, v (repeated for GQA), out, lse; ring attention (CP) saves q, the
    # un-repeated k, v, an fp32 out and the lse.
    if cp_ring:
        attn = n * (Dq * c + 2 * Dkv * c + Dq * 4 + Hl * 4)
    else:
        Dk = Dq if rep > 1 else Dkv
        attn = n * ((2 * Dq + 2 * Dk) * c + Hl * 4)
    wo_in = n * Dq * c
    if path == "fp32":
        norms = 4 * nn_ * (4 * D + 2)  # x, normed, rsqrt (x2 norms)
        y1, y2 = 4 * n * D, 4 * n * D  # q/k/v input, w1/w3 input
    elif path == "autocast":
        norms = 4 * nn_ * (4 * D + 2)
        y1, y2 = 3 * 2 * n * D, 2 * 2 * n * D  # bf16 casts: one per wq, wk, wv; one per w1, w3
    else:  # mp
        norms = nn_ * (4 * 2 * D + 2 * 2 * D + 4 * 2)  # fp32 upcast + bf16 normalised, rsqrt (x2)
        y1, y2 = 2 * n * D, 2 * n * D
    if x.E:
        ffn = _moe_saved(x, n, path) + (y2 if path != "autocast" else 0)
        _, Sk = _moe_slots(x, n)
        prod = Sk * x.F * c
        # Experts.forward indexes w[e] per expert: each SelectBackward returns a zero-filled [El, D, F] gradient
        # that is summed into the running one (three params: w1, w3, w2), two more in flight (measured)
        El = x.E // x.ep
        ffn_bwd = 5 * El * D * x.F * (2 if path == "mp" else 4) + 3 * (Sk // El) * x.F * c
    else:
        ffn = y2 + n * 4 * Fl * c
        prod = n * Fl * c
        ffn_bwd = 3 * prod
    full = norms + y1 + attn + wo_in + ffn
    stream = nn_ * D * r
    if x.recompute == "full":
        saved = stream
    elif x.recompute == "selective":
        mm = n * (Dq + 2 * Dkv + D) * c + (n * (2 * Fl + D) * c if not x.E else _moe_mm(x, n, c))
        core = n * (Dq * (4 if cp_ring else c) + Hl * 4)
        rs = 2 * nn_ * D * c if sp else 0
        saved = stream + mm + core + rs
    else:
        saved = full
    pcopy = 0
    if path == "autocast":
        lin = sum(d0 * rest for d0, rest, _, _ in _block_tensors(x) if rest > 1)
        if x.E:  # the router runs in fp32 (no cast); expert slices are cast one by one, all kept
            lin -= x.E * D
        pcopy = 2 * lin
    embed = n * 8 + (n * 9 if t > 1 else 0)  # ids; TP's vocab-parallel lookup keeps masked ids and a mask
    if path == "fp32":
        head = 4 * nn_ * (2 * D + 1) + 4 * n * D
    elif path == "autocast":
        head = 4 * nn_ * (2 * D + 1) + 2 * n * D
    else:
        head = nn_ * (4 * D + 2 * D + 4) + 2 * n * D
    return _Acts(layer_saved=saved, layer_full=full, ffn_saved=ffn, prod=prod, ffn_bwd=ffn_bwd, pcopy_layer=pcopy,
                 pcopy_head=2 * Vl * D if path == "autocast" else 0, embed=embed, head=head, lsm=4 * n * Vl,
                 targets=n * 8, logits=c * n * Vl, grad_logits=c * n * Vl, dy_head=c * n * D,
                 rope=2 * T * (Dh // 2) * 4, stream=stream, d_stream=stream,
                 lin_out_grads=n * (Dq + 2 * Dkv + 2 * D + (2 * Fl if not x.E else 0)) * c,
                 ring_bwd=_ring_backward(x, n, Dq, Dkv, Hl, c) if cp_ring else 0, post_attn=wo_in + norms // 2)


def _ring_backward(x: _Layout, n: int, Dq: int, Dkv: int, Hl: int, c: int) -> int:
    """RingAttention.backward (context_parallel.py) on one rank: fp32 q, dout and dq [n, Dq]; the K/V stack and
    the ring's receive buffer [2, n, Dkv] in the compute dtype; fp32 dK/dV and its shift buffer; fp32 copies of
    the K/V block in hand; the row sums; and a block's fp32 score / probability / gradient tiles (head-tail
    layout: blocks of T/(2 cp) x T/(2 cp) per head): the loop's variables keep the previous block's four tiles
    alive while the next block's first two are made (measured)."""
    up = 0 if c == 4 else 1  # .float() copies only when the compute dtype is bf16
    Tb = x.s // (2 * x.cp)
    tiles = 6 * x.b * Hl * Tb * Tb * 4
    return (n * Dq * 4 * (1 + 2 * up) + n * Hl * 4 + 2 * (2 * n * Dkv * c) + 2 * (2 * n * Dkv * 4)
            + up * 2 * n * Dkv * 4 + tiles)


def _moe_slots(x: _Layout, n: int) -> tuple[int, int]:
    """(routing slots S = n*K, kept slots) of one micro-batch on this rank (uniform routing)."""
    S = n * x.K
    if x.cf > 0:
        cap = math.ceil(x.cf * n * x.K / x.E)
        return S, min(S, cap * x.E)
    return S, S


def _moe_saved(x: _Layout, n: int, path: str) -> int:
    """moe.MoE's saved tensors per micro-batch (measured on torch 2.13 CPU): router probs, top-k ids and
    gates, the dispatched rows [S_kept, D] (and a second [S_kept, D] the combine keeps), every expert's SwiGLU
    intermediates (4 F per kept slot), the combine's rows [S, D] and weights. EP trades rows, it does not
    remove them (uniform routing assumed: each rank receives as many rows as it sends). The router runs in
    fp32 whatever the compute dtype, so under autocast it keeps the fp32 norm output."""
    S, Sk = _moe_slots(x, n)
    D, F, E, K = x.D, x.F, x.E, x.K
    router = n * E * 4 + n * K * (8 + 4 + 4) + n * 4 + (n * E * 4 if x.has_z else 0)
    idx = 2 * Sk * 8
    c = 4 if path == "fp32" else 2
    rows = 2 * Sk * D * c + Sk * 4 * F * c + S * D * c
    if x.ep > 1:  # received rows are permuted into expert order and back: index_copy keeps one more [R, D]
        rows += Sk * D * c
    if path == "autocast":
        rows += Sk * D * c + n * K * c + n * D * 4  # each expert casts its rows twice (w1, w3); fp32 router input
    elif path == "mp":
        rows += n * D * 4 + E * D * 4 + n * K * c  # the router's fp32 upcasts of its input and weight
    return router + idx + rows


def _moe_mm(x: _Layout, n: int, c: int) -> int:
    _, Sk = _moe_slots(x, n)
    return n * x.E * 4 + Sk * (2 * x.F + x.D) * c


# ----------------------------------------------------------------------------------------------- model states


@lru_cache(maxsize=4096)
def _zero1_max_share(numels: tuple[int, ...], local: tuple[int, ...], world: int) -> int:
    """Largest per-rank sum of `local` sizes under ZeroRedundancyOptimizer's partition: parameters sorted by
    (global) numel, largest first, each to the rank with the smallest total so far (first such rank)."""
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    heap = [(0, r) for r in range(world)]
    owned = [0] * world
    for i in order:
        size, r = heapq.heappop(heap)
        owned[r] += local[i]
        heapq.heappush(heap, (size + numels[i], r))
    return max(owned)


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


def _states(x: _Layout, stages: list[int]) -> _States:
    return _states_cached(x, tuple(stages))


@lru_cache(maxsize=8192)
def _states_cached(x: _Layout, stages: tuple[int, ...]) -> _States:
    """Parameters, gradients and AdamW state of one pipeline rank (blocks are identical: sums per block)."""
    n_stages = x.pp * x.v
    n_blocks = (x.L // n_stages) * len(stages)
    blk = _block_tensors(x)
    root = _root_tensors(x, 0 in stages, n_stages - 1 in stages)
    blk_local = sum(d0 * r for d0, r, _, _ in blk)
    root_local = sum(d0 * r for d0, r, _, _ in root)
    n_local = n_blocks * blk_local + root_local
    n_tensors = n_blocks * len(blk) + len(root)
    cbytes = 2 if x.path == "mp" else 4
    edp = (x.dp // x.ep) * x.cp

    def group(tn: _Tensor) -> int:
        return edp if (tn[3] == "expert" and x.ep > 1) else x.dpcp

    def shard(tn: _Tensor) -> int:  # FSDP2: dim 0 split in ceil(d0 / d) rows, rank 0 holds the most
        return -(-tn[0] // group(tn)) * tn[1]

    step_bytes = 4 if x.device == "cpu" else 0
    if x.fsdp:
        blk_shard, root_shard = sum(shard(tn) for tn in blk), sum(shard(tn) for tn in root)
        stored = n_blocks * blk_shard + root_shard
        unit = sum(shard(tn) * group(tn) for tn in blk)  # padded unsharded block (experts nested: same sum)
        root_sz = sum(shard(tn) * group(tn) for tn in root)
        largest = max([shard(tn) for tn in blk + root], default=0)
        return _States(params=4 * stored, grads_full=4 * stored, opt=8 * stored +
                       step_bytes * n_tensors, ddp_buckets=0, unit_max=cbytes * unit, root_unit=cbytes * root_sz,
                       all_units=cbytes * (n_blocks * unit + root_sz), rs_buffer=4 * unit,
                       step_transient=_step_transient(x, 4 * largest, 4 * stored), n_local=n_local,
                       n_stored=stored, largest_tensor=largest, root_stored=root_shard)
    if x.zero == 1 and x.dpcp > 1:
        every = blk * n_blocks + root
        owned = _zero1_max_share(tuple(g if r > 1 else d0 for d0, r, g, _ in every),
                                 tuple(d0 * r for d0, r, _, _ in every), x.dpcp)
        opt = 8 * owned + step_bytes * -(-n_tensors // x.dpcp)
        owned_bytes = 4 * owned
    else:
        opt = 8 * n_local + step_bytes * n_tensors
        owned_bytes = 4 * n_local
    ddp_params = n_local
    if x.E and x.ep > 1:  # expert shards are on DDP's ignore list (synced by expert_parallel.sync_expert_grads)
        ddp_params -= n_blocks * sum(d0 * r for d0, r, _, k in blk if k == "expert")
    largest = max([d0 * r for d0, r, _, _ in blk + root], default=0)
    grads = 4 * n_local
    if x.tp > 1 and 0 in stages:
        # The vocab-parallel embedding's gradient comes back as a full [V, D] local tensor (measured, torch
        # 2.13 RowwiseParallel on nn.Embedding), not the [V/tp, D] shard the parameter is.
        grads += 4 * (x.V - x.V // x.tp) * x.D
    return _States(params=4 * n_local, grads_full=grads, opt=opt,
                   ddp_buckets=4 * ddp_params if x.ddp else 0, unit_max=0, root_unit=0, all_units=0, rs_buffer=0,
                   step_transient=_step_transient(x, 4 * largest, owned_bytes),
                   n_local=n_local, n_stored=n_local, largest_tensor=largest)


def _step_transient(x: _Layout, largest_bytes: int, owned_bytes: int) -> int:
    """AdamW step temporaries: the CPU default (foreach=False) makes sqrt(v) and its quotient for one tensor at
    a time; CUDA's foreach path materialises sqrt(v) for every owned tensor at once (+4 B/param)."""
    return 2 * largest_bytes if x.device == "cpu" else owned_bytes


# ----------------------------------------------------------------------------------------------- the peak


def _data_bytes(x: _Layout) -> int:
    """Token ids alive for the whole step: every rank builds the whole global batch (inputs and targets,
    data.global_batch) and its positions; a pipeline also concatenates its micro-batches (pipeline.py)."""
    T = x.s // x.cp
    out = 2 * x.gb * x.s * 8 + T * 8
    if x.pp > 1:
        out += 2 * x.m * x.b * T * 8  # the torch.cat of every micro-batch's x and y (the schedule slices views)
    return out


@lru_cache(maxsize=8192)
def _peak(x: _Layout, pp_rank: int) -> _Peak:
    """The peak of one pipeline rank: the largest of a few moments of the step, each split into the components
    memory.py measures (bench folds param copies into params, DDP buckets / FSDP unsharded gradients into
    grads). Moments: the loss backward, the LM head's backward, the backward of the last and of the first
    block (at the SwiGLU product's gradient or in RMSNorm's backward), the optimizer step. With a pipeline they
    are evaluated at the backward starts where the most micro-batches are in flight (pipe_states)."""
    stages = stage_ids(x, pp_rank)
    st = _states(x, stages)
    a = _acts(x)
    n_stages = x.pp * x.v
    per_stage = x.L // n_stages
    has_embed, has_head = 0 in stages, n_stages - 1 in stages
    head_chunk = stages.index(n_stages - 1) if has_head else -1
    m = x.m
    fsdp, zero3 = x.fsdp, x.fsdp and x.zero == 3
    fsdp_accum = fsdp and x.pp > 1 and FSDP_ACCUMULATES_UNSHARDED_UNDER_PP
    cb = 2 if x.path == "mp" else 4
    buffers = 2 * x.s * (x.Dh // 2) * 4 * len(stages)  # RoPE tables: persistent module buffers
    data = _data_bytes(x)
    other0 = buffers
    detail: dict[str, int] = {"rope_buffers": buffers}
    if x.pp > 1:
        # torch.distributed.pipelining allocates one receive buffer per micro-batch per stage: activations
        # into every non-first stage, gradients into every non-last stage.
        recv = sum((m if s_ != 0 else 0) + (m if s_ != n_stages - 1 else 0) for s_ in stages) * a.stream
        detail["pp_recv_buffers"] = recv
        other0 += recv
    tp_embed = 4 * (x.V - x.V // x.tp) * x.D if (x.tp > 1 and has_embed) else 0  # full-size embedding grad
    rec = a.layer_full - a.layer_saved if x.recompute != "none" else 0
    if x.recompute == "selective":
        # SAC keeps one of its cached [n, D] matmul outputs until the block's backward ends (measured)
        rec += x.b * (x.s // x.cp) * x.D * (4 if x.path == "fp32" else 2)
    blk_local = sum(d0 * r_ for d0, r_, _, _ in _block_tensors(x))
    w2 = x.D * (x.F // x.tp) if not x.E else (x.E // x.ep) * x.F * x.D
    gb_ = cb if fsdp else 4
    vd = (x.V // x.tp) * x.D + x.D

    if x.pp > 1:
        states = pipe_states(x, pp_rank)
    else:
        states = [_PipeState((1,), 1.0 if m > 1 else 0.0, m, 0)]
    moments: list[tuple[str, int, int, int, int, dict[str, int]]] = []  # phase, params+, grads, acts, other
    for ps in states:
        held = ps.held
        k_total = sum(held)
        # forward-created tensors of every in-flight micro-batch
        acts = sum(k * (per_stage * a.layer_saved + a.rope) for k in held) + data
        if has_embed:  # (a pipeline's ids are views of the concatenated batch: only TP's masks are new)
            acts += held[stages.index(0)] * (a.embed - (x.b * (x.s // x.cp) * 8 if x.pp > 1 else 0))
        if x.pp > 1:  # a stage's output stays in the schedule's fwd_cache until its backward (+1, measured)
            outs = sum(k for ci, k in enumerate(held) if stages[ci] != n_stages - 1)
            acts += (outs + (1 if outs else 0)) * a.stream
        # autocast caches its weight casts for the whole `with autocast()` region: one set per micro-batch
        # (train.forward_backward), or one for the whole pipeline step (all micro-batches inside one region)
        pcopies = (len(stages) if x.pp > 1 else k_total) * per_stage * a.pcopy_layer + (a.pcopy_head if has_head
                                                                                      else 0)
        if has_head and x.pp > 1:
            k_head = held[head_chunk]
            logits_alive = (ps.head_fwds if PP_KEEPS_OUTPUTS else k_head) * a.logits
            head_acts = acts + k_head * (a.head + a.lsm) + logits_alive  # targets: views of the batch
        else:
            logits_alive = a.logits if has_head else 0
            head_acts = acts + a.head + a.lsm + a.targets + logits_alive
        # gradients alive when this backward starts
        if fsdp_accum:
            grads_prev = int(ps.grads * (4 * st.n_local + tp_embed))
        else:  # DDP / ZeRO-1 .grad, or FSDP's sharded grads (reduce-scattered every micro-step)
            grads_prev = int(ps.grads * st.grads_full)
        grads_prev += st.ddp_buckets
        # New gradients are fresh tensors until the first backward has run (then autograd adds into .grad in
        # place), except under FSDP: each micro-step's unsharded grads are new (reduce-scattered away, or, under
        # mixed precision, folded into the fp32 accumulator only at the unit's post-backward).
        fresh = ps.grads < 1 or (fsdp and (not fsdp_accum or x.path == "mp"))
        gathered_fwd = st.all_units if (fsdp and not zero3) else 0  # zero 2 keeps every unit (root included)

        if has_head and ps.chunk == head_chunk:
            # the loss backward: log_softmax's gradient next to the nll gradient (two fp32 [n, V/tp]); under
            # TP's loss_parallel: the nll gradient, exp(log_softmax) and their sum, plus index masks
            loss_grads = 3 * a.lsm + 4 * a.targets if x.tp > 1 and not x.E else 2 * a.lsm
            moments.append(("loss backward", pcopies + gathered_fwd, grads_prev, head_acts, other0 + loss_grads,
                            {"loss_grads": loss_grads}))
            # the LM head's backward: d(logits), dW_out, d(head input); zero 3 re-gathers the root and
            # prefetches the last block (its flat all-gather output waits in a staging buffer)
            w_out = gb_ * (x.V // x.tp) * x.D
            p2, o2 = pcopies + gathered_fwd, other0 + a.grad_logits + a.dy_head + w_out
            if zero3:
                p2 += st.root_unit
                o2 += st.unit_max
            moments.append(("LM head backward", p2, grads_prev, head_acts - a.lsm, o2,
                            {"head_grads": a.grad_logits + a.dy_head + w_out}))
        # the backward of the chunk's last block. New gradients of the head and of w2 are fresh tensors until
        # the first backward has run; then autograd adds into .grad in place, except FSDP mixed precision,
        # whose bf16 unsharded grads join the fp32 accumulator only at the unit's post-backward.
        head_grads = gb_ * vd if has_head and ps.chunk == head_chunk and fresh else 0
        g3 = grads_prev + head_grads + (gb_ * w2 if fresh else 0)
        p3 = pcopies + ((st.all_units if not zero3 else st.root_unit + st.unit_max) if fsdp else 0)
        o3 = other0 + a.d_stream + (st.unit_max if zero3 else 0)  # + the prefetched block's staging buffer
        acts3 = acts + logits_alive + rec
        if x.pp > 1 and x.schedule == "zero_bubble":
            # input-backward (I) retains the graph for the weight-backward (W): nothing is freed, and every
            # linear's output gradient of the chunk is kept for W
            o3 += per_stage * a.lin_out_grads
            if has_head and ps.chunk == head_chunk:  # the loss part of the graph is retained too
                acts_i, o_i = head_acts + rec, o3 + a.grad_logits
            else:
                acts_i, o_i = acts3, o3
            moments.append(("input backward (zero bubble)", p3, g3, acts_i, o_i + 5 * a.stream, {}))
        moments.append(("block backward (SwiGLU)", p3, g3, acts3 - a.prod, o3 + a.ffn_bwd, {}))
        moments.append(("block backward (norm)", p3, g3, acts3 - a.ffn_saved, o3 + 5 * a.stream, {}))
        if x.cp > 1:  # inside ring attention's backward (its fp32 working set, see _ring_backward)
            g_attn = g3 + (gb_ * blk_local - gb_ * w2 if fresh and not x.E else 0)
            moments.append(("ring attention backward", p3, g_attn, acts3 - a.ffn_saved - a.post_attn,
                            o3 + a.ring_bwd, {}))

    # the step's last block backward (first layer of the first chunk): gradients are nearly all there; with
    # full recompute or small batches this is where the peak is
    acc = m > 1 or x.pp > 1
    logits_end = (m if (has_head and x.pp > 1 and PP_KEEPS_OUTPUTS) else (1 if has_head and x.pp == 1 else 0))
    if fsdp:
        blk_shard = st.n_stored - st.root_stored
        root_local = st.n_local - blk_local * per_stage * len(stages)
        g4 = 4 * (blk_shard - blk_shard // max(per_stage * len(stages), 1))  # reduced blocks: sharded grads
        if fsdp_accum:
            g4 += 4 * (root_local + blk_local)  # accumulators of the root and of this block
            if x.path == "mp":
                g4 += cb * (root_local + w2)
        else:
            if m > 1:  # sharded grads of this block and the root from the earlier micro-steps
                g4 += 4 * (st.n_stored - (blk_shard - blk_shard // max(per_stage * len(stages), 1)))
            g4 += cb * (root_local - ((x.V // x.tp) * x.D if has_embed else 0) + w2)
        p4, o4 = st.root_unit + st.unit_max, st.rs_buffer
    else:
        embed_grad = 4 * x.V * x.D if (has_embed and x.tp > 1) else (4 * (x.V // x.tp) * x.D if has_embed else 0)
        g4 = (st.grads_full if acc else st.grads_full - 4 * blk_local - embed_grad + 4 * w2) + st.ddp_buckets
        p4, o4 = 0, 0
    acts4 = data + a.rope + (a.embed if has_embed else 0) + a.layer_saved + rec + logits_end * a.logits - a.prod
    if x.pp > 1 and min(stages) != n_stages - 1:
        acts4 += a.stream
    moments.append(("block backward (first)", p4 + a.pcopy_layer, g4, acts4, other0 + a.d_stream + a.ffn_bwd + o4,
                    {}))
    # the optimizer step (AdamW temporaries); a pipeline's last stage still holds the logits step() returned
    moments.append(("optimizer step", 0, st.grads_full + st.ddp_buckets,
                    m * a.logits if (has_head and x.pp > 1 and PP_KEEPS_OUTPUTS) else 0,
                    other0 + st.step_transient, {"adamw_step": st.step_transient}))

    phase, p_extra, grads, acts_, other, extra = max(moments, key=lambda q: q[1] + q[2] + q[3] + q[4])
    d = {**detail, **{k: v for k, v in extra.items() if v}}
    if st.ddp_buckets:
        d["ddp_buckets"] = st.ddp_buckets
    if p_extra:
        d["param_copies"] = p_extra
    return _Peak(st.params + p_extra, grads, st.opt, acts_, other, phase, d)


@dataclass(frozen=True)
class _Peak:
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    phase: str
    detail: dict

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other


def _breakdown(x: _Layout, pp_rank: int) -> MemoryBreakdown:
    pk = _peak(x, pp_rank)
    return MemoryBreakdown(params=pk.params, grads=pk.grads, optimizer=pk.optimizer, activations=pk.activations,
                           other=pk.other, total=pk.total, pp_rank=pp_rank, phase=pk.phase, detail=dict(pk.detail))


def memory_per_pp_rank(cfg: Config) -> list[MemoryBreakdown]:
    """Peak breakdown of every pipeline rank (rank 0 alone without PP)."""
    x = _layout(cfg)
    return [_breakdown(x, r) for r in range(x.pp)]


def reserve_bytes(cfg: Config) -> int:
    """What the estimate keeps free of the budget: on CUDA the context/NCCL workspaces (2 GiB) plus 5% for
    fragmentation; on CPU nothing (the measurement counts live tensor bytes exactly)."""
    return _reserve(_layout(cfg))


def _reserve(x: _Layout) -> int:
    if x.device == "cpu":
        return 0
    return int(CUDA_CONTEXT_RESERVE_GIB * GiB + FRAGMENTATION_RESERVE * x.budget_gib * GiB)


# ----------------------------------------------------------------------------------------------- FLOPs


def active_params(cfg: Config | _Layout) -> int:
    """Matmul parameters one token passes through: attention, the FFN (MoE: router + top-k experts), the head.
    The embedding is a lookup, not a matmul."""
    x = cfg if isinstance(cfg, _Layout) else _layout(cfg)
    D, Dh = x.D, x.Dh
    attn = D * x.H * Dh * 2 + D * x.G * Dh * 2
    ffn = (x.E * D + x.K * 3 * D * x.F) if x.E else 3 * D * x.F
    return x.L * (attn + ffn) + x.V * D


def flops_per_token(cfg: Config | _Layout) -> float:
    """Model FLOPs per token for forward + backward, PaLM convention (Chowdhery et al. 2022, App. B):
    6 N_active + 12 L H Dh s, attention counted without the causal half (as torchtitan and PaLM MFU do)."""
    x = cfg if isinstance(cfg, _Layout) else _layout(cfg)
    return 6.0 * active_params(x) + 12.0 * x.L * x.H * x.Dh * x.s


def hardware_flops_per_token(cfg: Config | _Layout) -> float:
    """FLOPs the kernels execute: causal attention does half the QK^T and PV work; full recompute reruns each
    block's forward (+1/3 of the block FLOPs), selective reruns only the cheap element-wise ops."""
    x = cfg if isinstance(cfg, _Layout) else _layout(cfg)
    blocks = 6.0 * (active_params(x) - x.V * x.D) + 6.0 * x.L * x.H * x.Dh * x.s
    head = 6.0 * x.V * x.D
    if x.recompute == "full":
        blocks *= 4.0 / 3.0
    return blocks + head


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a device by its name ('NVIDIA H100 80GB HBM3'); None when unknown."""
    prof = from_device_name(device_name)
    return prof.peak_flops(dtype) if prof is not None and prof.name != "CPU" else None


# ----------------------------------------------------------------------------------------------- communication


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
        add("fsdp", "all_gather", x.dpcp, units * ag_per_mb * m, n_units * ag_per_mb * m, dp_link,
            t_compute * 0.9)
        rs = 1 if x.pp > 1 else m  # every micro-step (parallelize._grad_sync_fn), once per step under PP
        add("fsdp", "reduce_scatter", x.dpcp, 4 * units // cb * rs, n_units * rs, dp_link, t_bwd * 0.9)
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


# ----------------------------------------------------------------------------------------------- public API


def resolve_hardware(cfg: Config, hardware: str | HardwareProfile | None = None,
                     probe: dict[str, Any] | None = None) -> HardwareProfile:
    """The profile to time a config on: explicit name/profile, else guessed from hardware.device and
    gpu_memory_gib; a probe result (HardwareReport dict or flat fields) overrides it."""
    if isinstance(hardware, HardwareProfile):
        base = hardware
    elif isinstance(hardware, str) and hardware:
        base = get_profile(hardware)
    else:
        dev = cfg.hardware.device if cfg.hardware.device != "auto" else "cuda"
        base = guess_profile(dev, cfg.hardware.gpu_memory_gib)
    return from_probe(base, probe)


def dtype_policy(cfg: Config) -> str:
    x = _layout(cfg)
    mech = {"fp32": "fp32 compute", "autocast": "bf16 compute via torch.autocast (fp32 residual stream, bf16 "
            "copies of each Linear's input and weight saved)", "mp": "bf16 compute via FSDP2 MixedPrecisionPolicy "
            "(bf16 gathered params and stream, fp32 reduce-scatter)"}[x.path]
    return f"fp32 master params, fp32 grads, AdamW fp32 exp_avg + exp_avg_sq (16 B/param); {mech}"


def estimate(cfg: Config, *, hardware: str | HardwareProfile | None = None,
             probe: dict[str, Any] | None = None) -> Estimate:
    """Per-rank memory, communication, FLOPs and step time for a validated config."""
    x = _layout(cfg)
    hw = resolve_hardware(cfg, hardware, probe)
    per = [_breakdown(x, r) for r in range(x.pp)]
    worst = max(per, key=lambda b: b.total)
    budget = int(x.budget_gib * GiB)
    reserve = reserve_bytes(cfg)
    usable = budget - reserve
    step, items = _step_time(x, hw)
    st = _states(x, stage_ids(x, worst.pp_rank))
    states = st.params + st.grads_full + st.opt
    notes = [
        "peak = max over: loss backward, last/first block backward, optimizer step (steady state, step >= 2)",
        "MoE routing assumed uniform (EP ranks receive as many rows as they send)" if x.E else "",
        f"reserve = {CUDA_CONTEXT_RESERVE_GIB} GiB context/NCCL + {int(FRAGMENTATION_RESERVE * 100)}% "
        "fragmentation" if x.device != "cpu" else "CPU: no reserve (live tensor bytes are measured exactly)",
        "FSDP under a pipeline keeps unsharded fp32 grads between micro-batches (the schedule's no-sync)"
        if x.fsdp and x.pp > 1 else "",
        "pipeline step() keeps every micro-batch's logits on the last stage (return_outputs=True)"
        if x.pp > 1 and PP_KEEPS_OUTPUTS else "",
    ]
    return Estimate(memory=worst, per_pp_rank=per, budget_bytes=budget, reserve_bytes=reserve, usable_bytes=usable,
                    fits=worst.total <= usable, headroom_bytes=usable - worst.total, param_count=param_count(cfg),
                    params_per_rank=st.n_stored, model_state_bytes=states,
                    model_state_bytes_per_param=states / max(param_count(cfg), 1),
                    active_params_per_token=active_params(cfg),
                    flops_per_token=flops_per_token(cfg), hardware_flops_per_token=hardware_flops_per_token(cfg),
                    communication=items, step_time=step, hardware=hw, dtype_policy=dtype_policy(cfg),
                    assumptions=[n for n in notes if n])


def load_any(config: str | Path | dict[str, Any] | Config, overrides: dict[str, Any] | None = None, *,
             root: str | Path | None = None, validate: bool = True) -> Config:
    """A Config from a name in configs/ ('llama3-8b'), a YAML path, a raw dict or a Config, plus dotted
    overrides."""
    if isinstance(config, Config):
        if not overrides:
            return config
        return from_dict(config.to_dict(), overrides, validate=validate)
    if isinstance(config, dict):
        return from_dict(config, overrides, validate=validate)
    from .paths import resolve_config_arg

    path = resolve_config_arg(str(config), root)
    if not path.is_file():
        from .paths import configs_dir

        have = ", ".join(sorted(p.stem for p in configs_dir(root).glob("*.yaml")))
        raise FileNotFoundError(f"no config {str(config)!r}; available: {have or '(none)'}")
    return from_dict(load_yaml(path), overrides, validate=validate)


def estimate_memory(config: str | Path | dict[str, Any] | Config, overrides: dict[str, Any] | None = None, *,
                    hardware: str | HardwareProfile | None = None, probe: dict[str, Any] | None = None,
                    root: str | Path | None = None) -> Estimate:
    """`estimate` for a config name/path/dict with dotted overrides (the MCP tool's core)."""
    return estimate(load_any(config, overrides, root=root), hardware=hardware, probe=probe)


@dataclass
class Quick:
    """The planner's fast path: the worst rank's peak and the step time, without the pydantic result."""

    total: int
    usable: int
    step_s: float
    comm_fraction: float
    mfu: float


def quick_layout(x: _Layout, hw: HardwareProfile) -> Quick:
    ranks = [0, x.pp - 1] if x.pp > 1 else [0]
    if x.pp > 1 and x.schedule == "zero_bubble" and x.v == 2:
        ranks.append(x.pp // 2)
    total = max(_peak(x, r).total for r in ranks)
    step, _ = _step_time(x, hw)
    usable = int(x.budget_gib * GiB) - _reserve(x)
    return Quick(total=total, usable=usable, step_s=step.total_s, comm_fraction=step.comm_fraction, mfu=step.mfu)


def quick(cfg: Config, hw: HardwareProfile) -> Quick:
    """quick_layout for a Config."""
    return quick_layout(_layout(cfg), hw)


def model_states(cfg: Config, pp_rank: int = 0) -> dict[str, int]:
    """Persistent parameter bytes, the gradients the optimizer reads, and AdamW state on one pipeline rank
    (memory.py's `params`, `grads` and `optimizer` categories)."""
    x = _layout(cfg)
    st = _states(x, stage_ids(x, pp_rank))
    return {"params": st.params, "grads": st.grads_full, "optimizer": st.opt}
