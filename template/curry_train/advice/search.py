"""The planner's search: every layout of a cluster that may launch, its estimate, its anti-patterns, and the
layout a careful engineer would run (`choose`).

    python -c "from curry_train.advice.planner import plan; print(plan('llama3-70b', 8, 32, 80.0, 8192, 1024).final)"

Search space: tp x cp x pp x dp over the cluster with
  tp   every divisor of gpus_per_node that divides the heads, kv heads, the TP-split FFN widths and the vocabulary
       (rules.tp_sizes; a MoE's routed experts stay whole, expert-parallel over dp x tp);
  cp   every cp with seq_len % (2*cp) == 0 (rules.cp_sizes); below 32k tokens only when no layout without CP
       fits (the seed's "CP only with proven need");
  pp   sizes whose stages are whole nodes and hold at least one layer each (rules.pp_sizes; pp need not divide
       the layers: pipeline_split.py splits them unevenly by cost, so BLOOM's 70 layers take PP12), with 1F1B,
       interleaved 1F1B and zero-bubble at 2 (and 4) virtual stages; GPipe is left out: it has 1F1B's bubble
       and holds every micro-batch's activations (Narayanan et al. 2021), so it never wins;
  dp   the rest of the cluster, lowered to the largest size the global batch feeds (GPUs then idle);
  ep   (MoE) divisors of the experts that divide dp, or dp x tp under TP (rules.ep_domain);
  zero 0-3 (one row at dp*cp == 1: the stages are the same layout there, so duplicates collapse); zero 1 with
       tp > 1 is Megatron's distributed optimizer (FSDP2 holding the step, wrapping.py); under PP zero 3 is searched
       with fsdp_reshard=always (default keeps its units gathered there: the zero-2 row, or zero 1 with tp);
  keep zero 2 without PP also with parallel.fsdp_keep_gathered (units gathered across the micro-batches: one
       all-gather per step, so accumulation no longer costs a gather per micro-batch), at 2+ micro-batches;
  hsdp at zero 2/3 whose dp*cp group spans nodes, also parallel.dp_replicate = rules.hsdp_replicas (the fewest
       replicas whose shard group fits one node: gathers on the node's link, one all-reduce across);
  recompute the lightest mode that fits (a heavier one only adds FLOPs); micro-batch the powers of two (and the
       given one) that divide the per-rank batch, from 1 up to the largest that fits (memory grows with it, so
       the loop stops there).
An axis is one more loop and one more key in the row's `parallel` (dp_replicate for HSDP; uneven stages need
none: parallel.pp_layers stays unset, so the template and the estimator split by cost alike): the rest (fit,
anti-patterns, choice) reads rows only.

`choose`: among the fitting rows without an anti-pattern, those within WITHIN (10%) of the fastest;
of these the one with the fewest and lightest primitives in the ladder's order (CP, EP, PP, TP heaviest first,
then recompute, then the ZeRO stage, then HSDP), preferring rows that use every GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from curry_train.config import Config, ParallelConfig
from curry_train.estimator import GiB, _states, layout_need, layout_of, replace_layout, reserve_bytes, stage_ids
from curry_train.estimator.comm import _step_time
from curry_train.estimator.profiles import HardwareProfile
from curry_train.estimator.reserve import reserve_of
from curry_train.rules import (
    LONG_CONTEXT,
    WITHIN,
    RuleContext,
    anti_patterns,
    check,
    cp_sizes,
    divisors,
    ep_domain,
    hsdp_replicas,
    pp_sizes,
    tp_sizes,
)

RC = ("none", "selective", "full")
MAX_MICRO_BATCH = 64  # beyond this the GEMMs are long saturated; bounds the loop on small models
# The estimator's stated error on the per-rank peak: benchmarks/estimator_accuracy.py's target for the total
# against the exact live-tensor tracker (BENCHMARKS.md: <= 3%, 1.73% the largest measured). A layout whose
# estimate is inside this fraction of the usable budget may not fit in fact: the search takes a larger
# micro-batch into the band only for at least MB_GAIN, and `choose` keeps `final` out of the band unless it pays.
# PEAK_ERROR_MEASURED is the largest error that benchmark measures where the tracker is exact (2.13%, rounded up;
# one PP + FSDP bf16 config's measured peak moves run to run by one unit's async reduce-scatter buffer,
# BENCHMARKS.md): a row with less headroom than that is never final while another row exists; between it and the
# band only for a gain over WITHIN.
PEAK_ERROR_BAND = 0.03
PEAK_ERROR_MEASURED = 0.022
MB_GAIN = 0.02


@dataclass
class Row:
    """One layout that fits: its parallel section, micro-batch and estimate."""

    parallel: dict[str, Any]
    micro_batch: int
    total: int
    step_s: float
    mfu: float
    comm_fraction: float
    gpus_used: int
    anti: list[str] = field(default_factory=list)
    anti_text: list[str] = field(default_factory=list)
    usable: float | None = None  # this layout's own budget - reserve (reserve.reserve_of), after the margin

    def in_band(self, band: float = PEAK_ERROR_BAND) -> bool:
        """Whether the peak is inside `band` of this row's own usable budget (unknown usable: never)."""
        return self.usable is not None and self.total > self.usable * (1 - band)

    @property
    def weight(self) -> tuple:
        """Fewest and lightest primitives, heaviest first (the ladder read from the top), then the sizes."""
        p = self.parallel
        return (p["cp"] > 1, p["ep"] > 1, p["pp"] > 1, p["tp"] > 1, RC.index(p["recompute"]), p["zero"],
                p.get("fsdp_keep_gathered", False), p.get("dp_replicate", 1) > 1, p["cp"], p["ep"], p["pp"],
                p["pp_virtual"], p["tp"])


@dataclass
class Search:
    rows: list[Row]  # fitting rows
    valid: int
    cp_fallback: bool  # CP below 32k was searched because nothing without CP fits


def _dp_for(gb: int, dp_max: int) -> int:
    """The largest dp <= dp_max that splits the global batch (micro-batch 1): the rest of the GPUs idle."""
    return max(d for d in range(1, dp_max + 1) if gb % d == 0) if dp_max >= 1 else 0


def _shapes(cfg: Config, with_cp: bool, mb: int = 1) -> list[tuple[int, int, int, int, int]]:
    """(tp, cp, pp, dp, gpus) over the cluster; cp > 1 only when `with_cp`; dp splits the global batch into
    micro-batches of `mb` (1 when the micro-batch is searched)."""
    m, t, h = cfg.model, cfg.train, cfg.hardware
    world = h.gpus_per_node * h.nodes
    out = []
    for tp in tp_sizes(m, h.gpus_per_node):
        for cp in (cp_sizes(t.seq_len, world) if with_cp else [1]):
            for pp in pp_sizes(m.n_layers, world, h.nodes):
                if world % (tp * cp * pp):
                    continue
                dp = _dp_for(t.global_batch // mb, world // (tp * cp * pp))
                if dp:
                    out.append((tp, cp, pp, dp, dp * tp * cp * pp))
    return out


def _schedules(n_layers: int, pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]  # every stage needs a layer (pp * v <= n_layers); the split may be uneven
    for v in (2, 4):
        if n_layers >= v * pp:
            out.append(("interleaved_1f1b", v))
    if n_layers >= 2 * pp:
        out.append(("zero_bubble", 2))
    return out


def search(cfg: Config, hw: HardwareProfile, *, margin: float = 0.0, first_fit: bool = False,
           search_micro_batch: bool = True) -> Search:
    """Every valid layout of cfg's cluster that fits (the lightest recompute per micro-batch); `first_fit` stops at
    the first fitting row (for min_nodes_to_fit). Without `search_micro_batch` every row keeps
    cfg.train.micro_batch."""
    short = cfg.train.seq_len < LONG_CONTEXT
    rows, valid = _search(cfg, hw, margin, with_cp=not short, first_fit=first_fit, search_mb=search_micro_batch)
    fallback = False
    if short and not rows:  # CP below 32k only when nothing else fits
        rows, more = _search(cfg, hw, margin, with_cp=True, first_fit=first_fit, search_mb=search_micro_batch)
        valid += more
        fallback = True
    return Search(rows=rows, valid=valid, cp_fallback=fallback)


def _search(cfg: Config, hw: HardwareProfile, margin: float, *, with_cp: bool,
            first_fit: bool, search_mb: bool = True) -> tuple[list[Row], int]:
    x0 = layout_of(cfg)
    m, t = cfg.model, cfg.train
    budget = int(cfg.hardware.gpu_memory_gib * GiB)
    probe_cfg = cfg.model_copy()  # its parallel and train sections are swapped per candidate, unvalidated
    rows: list[Row] = []
    valid = 0
    for tp, cp, pp, dp, used in _shapes(cfg, with_cp, 1 if search_mb else t.micro_batch):
        per_rank = t.global_batch // dp
        mbs = [b for b in divisors(per_rank) if (b <= MAX_MICRO_BATCH and b & (b - 1) == 0 and search_mb
                                                 or b == t.micro_batch) and (pp == 1 or per_rank // b >= pp)]
        # EP is carved from dp, or from dp x tp under TP (rules.ep_domain: Megatron's expert-tensor-parallel 1)
        eps = [e for e in divisors(m.num_experts) if ep_domain(dp, tp, e, m.num_experts) % e == 0] \
            if m.num_experts else [1]
        zeros = (0,) if dp * cp == 1 else (0, 1, 2, 3)
        for sched, v in _schedules(m.n_layers, pp):
            for ep in eps:
                over: set[int] = set()  # ZeRO stages whose FSDP row overflows: HSDP (smaller shards) does too
                plain: dict[tuple[int, int, str], float] = {}  # zero-2 step times by (replicas, micro-batch, rc)
                for zero, dpr, keep in [(z, r, k) for z in zeros
                                        for r in (1, hsdp_replicas(dp, cp, tp, cfg.hardware.gpus_per_node, z, ep)) if r
                                        for k in ((False, True) if z == 2 and pp == 1 else (False,))]:
                    if keep and zero in over:
                        continue  # units held across micro-batches need at least the plain ZeRO-2 row's memory
                    if zero == 2 and tp > 1 and pp > 1:
                        continue  # = ZeRO-1 there: the schedule holds the units and reduces once for both
                        # (parallel/fsdp.py docstring; the estimator's numbers are the same), so one row, zero 1
                    # under PP fsdp_reshard=default keeps ZeRO-3's units gathered (curry_train/fsdp_units.py,
                    # torchtitan's policy): that is the zero-2 / zero-1 row, so the zero-3 row there reshards
                    # after each micro-batch's forward (always), the distinct, lighter layout
                    reshard = "always" if zero == 3 and pp > 1 else "default"
                    sp = tp > 1 and cp == 1  # SP with TP, except under CP (both shard the sequence)
                    par = {"dp": dp, "zero": zero, "recompute": "none", "tp": tp, "sp": sp, "pp": pp,
                           "pp_schedule": sched, "pp_virtual": v, "ep": ep, "cp": cp, "dp_replicate": dpr,
                           "fsdp_keep_gathered": keep, "fsdp_reshard": reshard}
                    object.__setattr__(probe_cfg, "parallel", ParallelConfig.model_construct(**par))
                    object.__setattr__(probe_cfg, "train", t.model_copy(update={"micro_batch": mbs[0] if mbs else 1}))
                    if not mbs or check(probe_cfg):
                        continue
                    valid += len(mbs)  # one layout per micro-batch
                    if dpr > 1 and zero in over:
                        continue
                    x = replace_layout(x0, dp=dp, zero=zero, recompute="none", tp=tp, sp=sp, pp=pp,
                                       pp_schedule=sched, pp_virtual=v, ep=ep, cp=cp, micro_batch=mbs[0],
                                       dp_replicate=dpr, pp_layers=None, fsdp_keep_gathered=keep,
                                       fsdp_reshard=reshard)
                    # the reserve depends on the layout (one NCCL communicator per group it uses, reserve.py)
                    usable = budget - reserve_of(x)
                    limit = int(usable * (1 - margin))
                    edge = usable * (1 - margin) * (1 - PEAK_ERROR_BAND)
                    st = _states(x, stage_ids(x, 0))
                    if st.params + st.opt > usable or layout_need(replace_layout(x, recompute="full"), limit) > limit:
                        over.add(zero)  # model states alone, or the lightest mode at the smallest micro-batch,
                        continue  # overflow: no recompute and no larger micro-batch fits
                    start, prev = 0, float("inf")
                    for b in mbs:
                        if v > 1 and (per_rank // b) % pp or keep and per_rank == b:
                            continue  # (one micro-batch: holding the units changes nothing, the plain row has it)
                        fit = None
                        # memory first (the step time, a pipeline simulation, only for a fit); the lightest mode
                        # that fits never gets lighter as the micro-batch grows, so the search starts at the last
                        for rc in RC[start:]:
                            xr = replace_layout(x, recompute=rc, micro_batch=b)
                            total = layout_need(xr, limit)
                            if total <= limit:
                                fit = (rc, xr, total)
                                break
                        if fit is None:
                            break  # a larger micro-batch only holds more activations
                        rc, xr, total = fit
                        st, _items = _step_time(xr, hw)
                        if st.total_s >= prev:  # slower and no lighter than the smaller micro-batch: dominated
                            break
                        if prev < float("inf") and total > edge and st.total_s > prev * (1 - MB_GAIN):
                            break  # into the estimator's error band of the limit for under MB_GAIN: not worth it
                        if zero == 2 and not keep:
                            plain[dpr, b, rc] = st.total_s
                        elif keep and plain.get((dpr, b, rc), float("inf")) <= st.total_s:
                            continue  # its gathers were hidden anyway: the plain zero-2 row, no faster, is the row
                        start, prev = RC.index(rc), st.total_s
                        rows.append(Row(parallel={**par, "recompute": rc}, micro_batch=b, total=total,
                                        step_s=st.total_s, mfu=st.mfu, comm_fraction=st.comm_fraction,
                                        gpus_used=used, usable=usable * (1 - margin)))
                        if first_fit:
                            return rows, valid
    return rows, valid


def label(cfg: Config, rows: list[Row], cp_fallback: bool) -> None:
    """Each row's anti-patterns (rules.anti_patterns with the ranking's numbers: the fastest FSDP-alone layout and
    whether any layout without CP fits)."""
    fsdp = [r.step_s for r in rows if r.parallel["tp"] == r.parallel["pp"] == r.parallel["cp"] == r.parallel["ep"] == 1]
    fsdp_best = min(fsdp) if fsdp else None
    non_cp = not cp_fallback and any(r.parallel["cp"] == 1 for r in rows)
    probe_cfg = cfg.model_copy()
    for r in rows:
        object.__setattr__(probe_cfg, "parallel", ParallelConfig.model_construct(**r.parallel))
        ctx = RuleContext(step_s=r.step_s, fsdp_step_s=fsdp_best, non_cp_fits=non_cp)
        found = anti_patterns(probe_cfg, context=ctx)
        r.anti = [a.id for a in found]
        r.anti_text = [a.message for a in found]


def choose(rows: list[Row], world: int, band: float | None = PEAK_ERROR_BAND,
           measured: float = PEAK_ERROR_MEASURED) -> tuple[Row | None, float | None]:
    """(the final row, the fastest clean step time): the lightest clean row within WITHIN of the fastest clean
    one, preferring rows that use every GPU; without a clean row, the fitting row with the fewest anti-patterns.
    Rows whose peak is inside `band` of their own usable budget (each layout has its own reserve: reserve_of, the
    communicators it opens) stay candidates only when no other row is left, or when their headroom is above the
    largest error measured (`measured`) and they are more than WITHIN faster than every row outside the band that
    could be final (the clean ones, or all when none is clean: a row with an anti-pattern is no alternative to
    choose instead; the planner's tie band: a gain that size is worth a measurement; planner.py then says to
    measure before committing). `band` None: no band."""
    if band is not None and any(not r.in_band(band) for r in rows):
        safe = [r for r in rows if not r.in_band(band)]
        outside = min(r.step_s for r in ([r for r in safe if not r.anti] or safe))
        rows = [r for r in rows
                if not r.in_band(band) or not r.in_band(measured) and r.step_s < outside * (1 - WITHIN)]
    clean = [r for r in rows if not r.anti]
    if not clean:
        if not rows:
            return None, None
        fewest = min(len(r.anti) for r in rows)
        clean = [r for r in rows if len(r.anti) == fewest]
    best = min(r.step_s for r in clean)
    pool = [r for r in clean if r.step_s <= best * (1 + WITHIN)]
    return min(pool, key=lambda r: (-r.gpus_used, r.weight, r.step_s)), best


def plan_final(cfg: Config, hw: HardwareProfile, margin: float = 0.0,
               search_micro_batch: bool = True) -> tuple[Search, Row | None, float | None]:
    """What `plan` decides for cfg's cluster (advice/planner.py, and advice/agree.py asks the same): every fitting
    row, labelled with its anti-patterns, and `choose`'s final row and fastest clean step time."""
    found = search(cfg, hw, margin=margin, search_micro_batch=search_micro_batch)
    label(cfg, found.rows, found.cp_fallback)
    final_row, best = choose(found.rows, cfg.hardware.gpus_per_node * cfg.hardware.nodes)
    return found, final_row, best


def any_fits(cfg: Config, hw: HardwareProfile, margin: float = 0.0) -> bool:
    return bool(search(cfg, hw, margin=margin, first_fit=True).rows)


def with_nodes(cfg: Config, nodes: int) -> Config:
    return cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"nodes": nodes})})


def min_nodes_to_fit(cfg: Config, hw: HardwareProfile, margin: float = 0.0, limit_gpus: int = 131072) -> int | None:
    """The smallest node count of the same node type on which some layout fits (doubling, then bisection: more
    nodes shard more); None when even `limit_gpus` GPUs do not hold it."""
    if int(cfg.hardware.gpu_memory_gib * GiB) - reserve_bytes(cfg) <= 0:
        return None  # the reserve alone exceeds the budget: no node count helps
    lo, hi = cfg.hardware.nodes, cfg.hardware.nodes * 2
    cap = max(1, limit_gpus // cfg.hardware.gpus_per_node)
    while not any_fits(with_nodes(cfg, hi), hw, margin):
        if hi >= cap:
            return None
        lo, hi = hi, min(hi * 2, cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if any_fits(with_nodes(cfg, mid), hw, margin):
            hi = mid
        else:
            lo = mid
    return hi
