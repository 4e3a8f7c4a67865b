"""Analytical per-rank memory, communication, FLOPs and step time of *this template's* implementation.

    curry-train estimate --config llama3-8b --set parallel.dp=8 --set parallel.zero=3 --json
    python -c "from curry_train.estimator import estimate_memory; print(estimate_memory('tiny').memory)"

Pure arithmetic (no tensor is allocated; 405B takes milliseconds). It models what the template does, not a
textbook transformer (docs/ESTIMATION.md gives the textbook formulas and their sources):

Dtype policy (train.dtype = float32 | bfloat16):
  master params fp32 (4 B), grads fp32 (4 B), AdamW exp_avg + exp_avg_sq fp32 (8 B), plus a 4-byte `step`
  tensor per parameter tensor (counted on CPU only: AdamW keeps it on the host unless capturable/fused).
  compute fp32: every activation 4 B.
  compute bf16: every layout is FSDP2 with MixedPrecisionPolicy(bf16 params, fp32 reduce) (wrapping.py: ZeRO-0
    as dp*cp replicas of one shard, ZeRO-1 holding the step, one dp*cp rank at degree 1; no autocast). The
    stream is bf16, RMSNorm saves its bf16 input and the fp32 rstd, weights are gathered in bf16.
  logits: compute dtype; the model computes the loss in its forward, in train.loss_chunks token chunks (0 =
    auto, ceil(V/D): model/gpt.py chunked_lm_loss), each an activation checkpoint: only one chunk's fp32
    log_softmax and its two fp32 gradients exist at a time; the logits themselves are never kept.

Per op, what autograd saves (measured on torch 2.13 CPU with saved-tensor hooks, exact to the byte):
  RMSNorm: input, rsqrt [tokens, 1] fp32, normalised x; wq/wk/wv: their input; RoPE: only cos/sin;
  GQA repeat_interleave: the repeated k, v are new tensors [B, H, T, Dh]; SDPA (CPU flash and CUDA flash):
  q, k, v, out and the fp32 logsumexp [B, H, T]; the transpose+reshape before wo copies out (wo saves the copy);
  SwiGLU: w1 and w3 outputs, silu(w1 x), and the product (w2's input); MoE: router probs and gates, dispatched
  and combined rows, per-expert SwiGLU intermediates (and each SelectBackward's full-size expert gradient in
  backward); ring attention (CP): q, the un-repeated k/v, an fp32 out and lse; TP's loss_parallel: an fp32
  log_softmax of the local vocabulary slice; the vocab-parallel embedding's gradient is full-size.
Implementation buffers modelled: DDP's flat gradient buckets (gradient_as_bucket_view=True: the .grad tensors
are views into them, so they are the gradients, alive from the wrap on), ZeroRedundancyOptimizer's greedy
whole-tensor partition, FSDP2's padded dim-0 shards, the
gathered units (zero 2: all of them from forward to backward; zero 3: root + current + prefetched block, and
under a pipeline every unit of a chunk from its backward to its next forward: pipeline._kept_units), the
unsharded fp32 gradients FSDP2 accumulates under a pipeline (its schedule turns sync off for all micro-batches
but the last; without PP the template reduce-scatters every micro-step), the reduce-scatter input kept in
flight, the pipeline's receive buffers (one per micro-batch), the loss's transients (two fp32 [chunk tokens, V]
gradients; with chunks, the head-weight gradient summed out of place, three [V, D] at that add, and the chunks'
input gradients), AdamW's step temporaries. Not modelled yet: FSDP's reduce-scatter of the root unit at the end
of the backward (fp32 input of the [V, D] head and embedding), which a vocab-heavy ZeRO-3 bf16 run peaks in once
the loss is chunked (benchmarks/estimator_accuracy.py "vocab-zero3-dp2-bf16").

The peak is the largest of a few moments of the step (the loss and LM-head backward, a block's backward at the
SwiGLU gradient or in RMSNorm's backward, the step's last block backward, the optimizer step; with a pipeline, at
the schedule's fullest backward starts); `memory` reports the categories live at that moment (filed by
curry_train/breakdown.py's contract, as the measurement files them), for the pipeline rank with the largest total
(every other axis is symmetric; ZeRO-1 and FSDP padding take rank 0's share, the largest). Checked against
curry_train.measure.memory on the tiny layouts of benchmarks/estimator_accuracy.py: model states exact, the total
and every category at the run's peak moment within 3% of the peak, but for three named gaps (docs/ESTIMATION.md).
Communication uses ring factors and alpha-beta times per link (intra vs inter node); step time = compute
(compute.py: GEMMs by shape, attention, element-wise bytes) + bubble + exposed communication + optimizer.

Files, in the one direction they compute (each imports only files above it; tests/test_architecture.py checks
it); this one holds the public API and the result models and re-exports the others:
  mla.py        multi-head latent attention's tensors, matmuls and saved bytes (read by layout, acts, compute)
  layout.py     Layout, the flat view of a config the arithmetic reads (its fields named as the Config's), the
                parameter tensors a rank holds, counts, FLOPs
  states.py     model states: params, gradients, AdamW state and the DDP / ZeRO-1 / FSDP buffers around them
  acts.py       activation bytes of one micro-batch, per op and dtype path
  pipeline.py   stage placement, each rank's schedule order, the schedule states (micro-batches in flight)
  moments.py    what one rank holds at a schedule state (RankView, StateView) and the implementation facts read
  phases.py     one function per moment of the step (loss / LM-head / block backwards, the optimizer step ...)
  peak.py       the per-rank peak: the largest moment
  init.py       the init peak (meta-device build, then local shards one parameter at a time)
  need.py       what a layout needs per rank (step and init peak), every pipeline rank: what `fits` reads
  reserve.py    what a GPU budget keeps free: context, fragmentation, a term per NCCL communicator
  datasheets.py where each hardware profile's numbers come from (one source string per profile)
  profiles.py   hardware profiles (peak FLOP/s, bandwidths, GEMM and attention ceilings) for the time model; the one
                GPU-name resolver
  compute.py    per-rank compute time: GEMMs by TP-local shape, fused attention by block, element-wise bytes
  makespan.py   the step's makespan: each rank's schedule order run with per-stage costs, the bubble
  comm_ep.py    expert parallel's collectives: the all-to-alls (the combine behind the shared expert), the router's
                over tp
  comm.py       collectives per step and the step time (CommItem, StepTime)
`fits` needs both the step peak and the init peak under the usable budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.breakdown import CATEGORIES, Breakdown
from curry_train.config import Config, from_dict, load_yaml
from curry_train.estimator.comm import CP_RING_KERNEL, CommItem, StepTime, _step_time, ring_attention_dtype
from curry_train.estimator.compute import from_probe
from curry_train.estimator.init import init_peak
from curry_train.estimator.layout import (
    GiB,
    Layout,
    active_params,
    flops_per_token,
    hardware_flops_per_token,
    layout_of,
    param_count,
    replace_layout,
    stage_split,
)
from curry_train.estimator.need import layout_need, layout_need_every_rank, rank_classes, rank_need
from curry_train.estimator.peak import DDP_GRADS_ARE_BUCKET_VIEWS, PP_KEEPS_OUTPUTS, _Peak, _peak, moment_peaks
from curry_train.estimator.pipeline import bubble_fraction, in_flight, pipe_states, stage_ids
from curry_train.estimator.profiles import (
    GPU_NAMES,
    HardwareProfile,
    UnknownGpu,
    bf16_note,
    check_cluster,
    from_device_name,
    get_profile,
    guess_profile,
    resolve_gpu,
)
from curry_train.estimator.reserve import (
    CUDA_CONTEXT_RESERVE_GIB,
    FRAGMENTATION_RESERVE,
    NCCL_COMMUNICATOR_MIB,
    communicators,
    reserve_of,
)
from curry_train.estimator.states import _states
from curry_train.layout_warnings import layout_warnings

__all__ = [  # the public API; planner.py and the tests also reach into layout_of, replace_layout and _states
    "GPU_NAMES", "CommItem", "Estimate", "GiB", "UnknownGpu", "check_cluster", "resolve_gpu", "with_gpu",
    "Layout", "MemoryBreakdown", "Quick", "StepTime", "layout_of", "replace_layout", "_states",
    "active_params", "bubble_fraction", "dtype_policy", "estimate", "estimate_memory", "flops_per_token",
    "hardware_flops_per_token", "in_flight", "layout_need", "layout_need_every_rank", "load_any",
    "memory_per_pp_rank", "moment_breakdowns", "rank_classes", "rank_need", "model_states", "param_count",
    "peak_flops", "pipe_states", "quick", "quick_layout", "reserve_bytes", "resolve_hardware", "stage_ids",
]



# ----------------------------------------------------------------------------------------------- results


class MemoryBreakdown(Breakdown):
    """Bytes live on one rank at its peak, in the categories of curry_train/breakdown.py, the same ones bench
    measures (curry_train.measure.memory), so estimate and measurement compare category by category."""

    total: int = Field(description="Sum of the categories: the per-rank peak.")
    pp_rank: int = Field(0, description="Pipeline rank this breakdown is for.")
    phase: str = Field("", description="Moment of the step where the peak falls.")
    detail: dict[str, int] = Field(default_factory=dict, description="Named pieces of the categories.")

    def gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / GiB, 3) for k in (*CATEGORIES, "total")}


class Estimate(BaseModel):
    """The estimator's answer for one config."""

    memory: MemoryBreakdown = Field(description="The rank with the largest total.")
    per_pp_rank: list[MemoryBreakdown] = Field(description="One breakdown per pipeline rank.")
    budget_bytes: int = Field(description="hardware.gpu_memory_gib.")
    reserve_bytes: int = Field(description="Held back for the CUDA context/NCCL and fragmentation (0 on CPU).")
    usable_bytes: int = Field(description="budget - reserve: what the peak must stay under.")
    fits: bool = Field(description="Both the step peak (memory.total) and init_peak_bytes are <= usable_bytes.")
    headroom_bytes: int = Field(description="usable - max(total, init peak) (negative: over budget).")
    init_peak_bytes: int = Field(0, description="Peak while the rank builds its model: local shards + the largest "
                                               "full parameter (+ its local chunk, RoPE tables; DDP: + buckets).")
    param_count: int = Field(description="Parameters of the whole model.")
    params_per_rank: int = Field(description="Parameters stored on the largest rank (after TP/PP/EP/FSDP).")
    model_state_bytes: int = Field(description="fp32 params + final grads + AdamW state on the largest rank.")
    model_state_bytes_per_param: float = Field(
        description="model_state_bytes / param_count: 16 for DDP, 16/d under ZeRO-3 (the ZeRO paper's Fig. 1).")
    active_params_per_token: int = Field(description="Matmul parameters one token passes through (MoE: top-k).")
    flops_per_token: float = Field(description="Model FLOPs per token, fwd+bwd: 6N + 6 L H Dh s (causal half, "
                                               "no recompute; step_time.mfu_convention).")
    hardware_flops_per_token: float = Field(description="Executed FLOPs per token: causal attention, recompute.")
    communication: list[CommItem]
    step_time: StepTime
    hardware: HardwareProfile
    gpu_profile: str = Field("", description="Name of the hardware profile this estimate used (speed and, when "
                                             "named as gpu, the memory budget).")
    hardware_note: str = Field("", description="Which profile was used and why (assumed when no gpu was named).")
    dtype_policy: str
    assumptions: list[str]
    warnings: list[str] = Field(default_factory=list, description="Primitives this layout turns on that do nothing "
                                "(curry_train/layout_warnings.py), e.g. a ZeRO stage at dp=1; a dtype the GPU "
                                "lacks (bf16 on V100).")


# ----------------------------------------------------------------------------------------------- memory


def _breakdown(layout: Layout, pp_rank: int) -> MemoryBreakdown:
    """The peak's moment split into the shared categories (curry_train/breakdown.py's contract)."""
    return _categories(_peak(layout, pp_rank), pp_rank)


def moment_breakdowns(cfg: Config, pp_rank: int = 0) -> list[MemoryBreakdown]:
    """Every moment of one pipeline rank's step split into the shared categories, as if it were the peak (the
    largest is `memory_per_pp_rank(cfg)[pp_rank]`); benchmarks/estimator_accuracy.py reads it to tell a filing
    error from a peak at another moment of near-equal total."""
    layout = layout_of(cfg)
    return [_categories(pk, pp_rank) for pk in moment_peaks(layout, pp_rank)]


def _categories(pk: _Peak, pp_rank: int) -> MemoryBreakdown:
    """A moment split into the shared categories: peak.py files working copies with params and the loss gradients
    and pipeline buffers with other; the pieces it names in `detail` move to their own category here."""
    d = pk.detail
    copies, ppb = d.get("param_copies", 0), d.get("pp_recv_buffers", 0)
    # under gradient_as_bucket_view the .grad tensors are views into DDP's buckets: the buckets *are* the grads
    # (measure/memory.py counts them so once .grad points into them, as it does from the first backward on)
    buckets = 0 if DDP_GRADS_ARE_BUCKET_VIEWS else d.get("ddp_buckets", 0)
    loss = d.get("loss_grads", 0)
    return MemoryBreakdown(params=pk.params - copies, param_copies=copies, grads=pk.grads - buckets,
                           grad_buffers=pk.grad_buffers + buckets, optimizer=pk.optimizer, activations=pk.activations,
                           loss=loss, pp_buffers=ppb, other=pk.other - loss - ppb,
                           total=pk.total, pp_rank=pp_rank, phase=pk.phase, detail=dict(d))


def memory_per_pp_rank(cfg: Config) -> list[MemoryBreakdown]:
    """Peak breakdown of every pipeline rank (rank 0 alone without PP)."""
    layout = layout_of(cfg)
    return [_breakdown(layout, r) for r in range(layout.pp)]


def reserve_bytes(cfg: Config) -> int:
    """What the estimate keeps free of the budget (estimator/reserve.py, the one home): on CUDA the context and
    workspaces, 5% for fragmentation and a term per NCCL communicator; on CPU nothing (the measurement counts
    live tensor bytes exactly)."""
    return _reserve(layout_of(cfg))


_reserve = reserve_of


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a device by its name ('NVIDIA H100 80GB HBM3'); None when unknown."""
    prof = from_device_name(device_name)
    return prof.peak_flops(dtype) if prof is not None and prof.name != "CPU" else None


# ----------------------------------------------------------------------------------------------- public API


def resolve_hardware(cfg: Config, hardware: str | HardwareProfile | None = None,
                     probe: dict[str, Any] | None = None) -> HardwareProfile:
    """The profile to time a config on: explicit name/profile, else guessed from hardware.device and
    gpu_memory_gib; a probe result (HardwareReport dict or flat fields) overrides it."""
    if isinstance(hardware, HardwareProfile):
        base = hardware
    elif isinstance(hardware, str) and hardware:
        base = get_profile(hardware, field="hardware")
    else:
        dev = cfg.hardware.device if cfg.hardware.device != "auto" else "cuda"
        base = guess_profile(dev, cfg.hardware.gpu_memory_gib)
    return from_probe(base, probe)


def dtype_policy(cfg: Config) -> str:
    layout = layout_of(cfg)
    mech = {"fp32": "fp32 compute", "mp": "bf16 compute via FSDP2 MixedPrecisionPolicy (bf16 gathered params "
            "and stream, fp32 gradient reduction)"}[layout.precision]
    return f"fp32 master params, fp32 grads, AdamW fp32 exp_avg + exp_avg_sq (16 B/param); {mech}"


def with_gpu(cfg: Config, gpu: str) -> Config:
    """cfg held to a named GPU's memory (hardware.gpu_memory_gib = the device's; device=cpu for 'CPU').
    An unknown name raises UnknownGpu (field `gpu`, the valid names listed)."""
    prof = get_profile(gpu)
    hw = cfg.hardware.model_copy(update={"gpu_memory_gib": prof.memory_gib,
                                         **({"device": "cpu"} if prof.name == "CPU" else {})})
    return cfg.model_copy(update={"hardware": hw})


def _hardware_note(cfg: Config, gpu: str | None, hardware: str | HardwareProfile | None, hw: HardwareProfile) -> str:
    mem = cfg.hardware.gpu_memory_gib
    if gpu:
        return f"gpu={hw.name}: {mem:g} GiB budget and {hw.name} speed ({hw.source})"
    if hardware:
        return (f"hardware={hw.name}: {hw.name} speed ({hw.source}); the budget is hardware.gpu_memory_gib="
                f"{mem:g} (name gpu to set both)")
    dev = cfg.hardware.device if cfg.hardware.device != "auto" else "cuda"
    note = resolve_gpu(None, mem, dev)[2]
    return note + (f" ({hw.source})" if hw.source != "datasheet" else "")


def estimate(cfg: Config, *, hardware: str | HardwareProfile | None = None,
             probe: dict[str, Any] | None = None, gpu: str | None = None) -> Estimate:
    """Per-rank memory, communication, FLOPs and step time for a validated config. `gpu` names the accelerator
    (estimator.profiles.GPU_NAMES): it sets the memory budget and the speed; `hardware` sets the speed only."""
    if gpu:
        cfg = with_gpu(cfg, gpu)
        hardware = hardware or get_profile(gpu)
    layout = layout_of(cfg)
    hw = resolve_hardware(cfg, hardware, probe)
    per = [_breakdown(layout, r) for r in range(layout.pp)]
    worst = max(per, key=lambda b: b.total)
    init = max(init_peak(layout, r) for r in range(layout.pp))
    budget = int(layout.gpu_memory_gib * GiB)
    reserve = reserve_bytes(cfg)
    usable = budget - reserve
    need = layout_need_every_rank(layout)  # = max(worst.total, init): what quick_layout and the planner's rows read
    step, items = _step_time(layout, hw)
    st = _states(layout, stage_ids(layout, worst.pp_rank))
    states = st.params + st.grads_full + st.opt
    notes = [
        "peak = max over: loss backward, last/first block backward, optimizer step (steady state, step >= 2)",
        "MoE routing assumed uniform (EP ranks receive as many rows as they send)" if layout.num_experts else "",
        f"reserve = {CUDA_CONTEXT_RESERVE_GIB} GiB context + {int(FRAGMENTATION_RESERVE * 100)}% fragmentation + "
        f"{communicators(layout)} NCCL communicators x {NCCL_COMMUNICATOR_MIB} MiB (assumed until a GPU calibrates "
        "it)" if layout.device != "cpu" else "CPU: no reserve (live tensor bytes are measured exactly)",
        "FSDP under a pipeline keeps unsharded fp32 grads between micro-batches (the schedule's no-sync)"
        if layout.fsdp and layout.pp > 1 else "",
        "pipeline step() keeps every micro-batch's logits on the last stage (return_outputs=True)"
        if layout.pp > 1 and PP_KEEPS_OUTPUTS else "",
        f"CP ring attention: every block a {CP_RING_KERNEL} kernel with LSE (flash; memory-efficient for fp32 on "
        f"CUDA): O(T/cp) memory, its FLOPs at the {ring_attention_dtype(layout)} peak" if layout.cp > 1 else "",
        f"pipeline stages {list(stage_split(layout))} layers (pipeline_split.py)" if layout.pp > 1 else "",
    ]
    return Estimate(memory=worst, per_pp_rank=per, budget_bytes=budget, reserve_bytes=reserve, usable_bytes=usable,
                    fits=need <= usable, headroom_bytes=usable - need, init_peak_bytes=init,
                    param_count=param_count(cfg),
                    params_per_rank=st.n_stored, model_state_bytes=states,
                    model_state_bytes_per_param=states / max(param_count(cfg), 1),
                    active_params_per_token=active_params(cfg),
                    flops_per_token=flops_per_token(cfg), hardware_flops_per_token=hardware_flops_per_token(cfg),
                    communication=items, step_time=step, hardware=hw, gpu_profile=hw.name,
                    hardware_note=_hardware_note(cfg, gpu, hardware, hw), dtype_policy=dtype_policy(cfg),
                    assumptions=[n for n in notes if n],
                    warnings=layout_warnings(cfg) + [w for w in [bf16_note(hw, cfg.train.dtype)] if w])


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
    from curry_train.paths import resolve_config_arg

    path = resolve_config_arg(str(config), root)
    if not path.is_file():
        from curry_train.paths import config_names

        have = ", ".join(config_names(root))
        raise FileNotFoundError(f"no config {str(config)!r}; available: {have or '(none)'}")
    return from_dict(load_yaml(path), overrides, validate=validate)


def estimate_memory(config: str | Path | dict[str, Any] | Config, overrides: dict[str, Any] | None = None, *,
                    hardware: str | HardwareProfile | None = None, probe: dict[str, Any] | None = None,
                    root: str | Path | None = None, gpu: str | None = None) -> Estimate:
    """`estimate` for a config name/path/dict with dotted overrides (the MCP tool's core); `gpu` as in
    `estimate` (checked before the config is read: an unknown name fails first)."""
    if gpu:
        get_profile(gpu)
    return estimate(load_any(config, overrides, root=root), hardware=hardware, probe=probe, gpu=gpu)


@dataclass
class Quick:
    """The planner's fast path: the worst rank's peak and the step time, without the pydantic result."""

    total: int
    usable: int
    step_s: float
    comm_fraction: float
    mfu: float


def quick_layout(layout: Layout, hw: HardwareProfile) -> Quick:
    """The worst pipeline rank's need (need.layout_need: step and init peak, every rank) and the step time."""
    total = layout_need(layout)
    step, _ = _step_time(layout, hw)
    usable = int(layout.gpu_memory_gib * GiB) - _reserve(layout)
    return Quick(total=total, usable=usable, step_s=step.total_s, comm_fraction=step.comm_fraction, mfu=step.mfu)


def quick(cfg: Config, hw: HardwareProfile) -> Quick:
    """quick_layout for a Config."""
    return quick_layout(layout_of(cfg), hw)


def model_states(cfg: Config, pp_rank: int = 0) -> dict[str, int]:
    """Persistent parameter bytes, the gradients the optimizer reads, and AdamW state on one pipeline rank
    (memory.py's `params`, `grads` and `optimizer` categories)."""
    layout = layout_of(cfg)
    st = _states(layout, stage_ids(layout, pp_rank))
    return {"params": st.params, "grads": st.grads_full, "optimizer": st.opt}
