"""Plan a layout for a model on a cluster: climb the ladder rung by rung, and rank every valid N-D layout.

    curry-train plan --model llama3-70b --gpus-per-node 8 --nodes 4 --gpu-memory-gib 80 --seq-len 4096 --json
    python -c "from curry_train.advice.planner import plan; print(plan('llama3-8b', 8, 1, 80.0, 8192, 512).final)"

`plan()` starts from plain data parallelism over the cluster (DDP, no recompute, micro-batch 1) and asks the
advisor for one rung at a time, recording each rung with its estimate, until the layout fits (within the
estimator's reserve, and `margin` more if asked) and is not communication-bound. It then enumerates every valid
layout of the same cluster (tp x cp x pp x dp = GPUs, each pipeline schedule, ZeRO stage, recompute mode and,
for MoE, expert-parallel size; the config's own validation rules) and ranks the ones that fit by estimated step
time. Pure arithmetic on the estimator's fast path: well under a second for 16,384 GPUs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.config import Config, ConfigError, ModelConfig, ParallelConfig, check, from_dict, load_yaml
from curry_train.estimator import (
    GiB,
    _layout,
    _replace,
    _states,
    estimate,
    quick_layout,
    reserve_bytes,
    resolve_hardware,
    stage_ids,
)


class Rung(BaseModel):
    """One step of the climb: the layout after it and what the estimator says about it."""

    step: int
    primitive: str = Field(description="What this rung added (baseline for the start).")
    reason: str
    parallel: dict[str, Any] = Field(description="The parallel section after this rung.")
    memory_gib: dict[str, float] = Field(description="Per-rank peak by component (largest rank).")
    total_bytes: int
    fits: bool
    step_time_s: float
    mfu: float
    comm_fraction: float


class RankedLayout(BaseModel):
    parallel: dict[str, Any]
    total_gib: float = Field(description="Estimated per-rank peak (largest rank).")
    step_time_s: float
    mfu: float
    comm_fraction: float


class Plan(BaseModel):
    """The climb, the chosen parallel section, and the ranking of every layout that fits."""

    model: str
    gpus: int
    gpus_per_node: int
    nodes: int
    gpu_memory_gib: float
    seq_len: int
    global_batch: int
    micro_batch: int
    rungs: list[Rung]
    final: dict[str, Any] = Field(description="The parallel section the climb ends on (config keys).")
    fits: bool = Field(description="Whether the final layout fits with margin.")
    more_gpus_needed: bool
    ranked: list[RankedLayout] = Field(description="The fastest layouts that fit, best first.")
    layouts_valid: int = Field(description="Valid layouts enumerated (config rules).")
    layouts_fitting: int
    seconds: float = Field(description="Wall time of this plan.")


# ----------------------------------------------------------------------------------------------- inputs


def _model_section(model: str | dict[str, Any], root: str | Path | None) -> tuple[str, dict[str, Any], dict]:
    """(name, model section, train section) from a config name / YAML path or an inline model dict."""
    if isinstance(model, dict):
        raw = model.get("model", model)
        ModelConfig.model_validate(raw)  # unknown keys and bad values are errors here
        return "inline", dict(raw), dict(model.get("train") or {})
    from curry_train.paths import resolve_config_arg

    path = resolve_config_arg(str(model), root)
    if not path.is_file():
        from curry_train.paths import configs_dir

        have = ", ".join(sorted(p.stem for p in configs_dir(root).glob("*.yaml")))
        raise FileNotFoundError(f"no config {model!r}; available: {have or '(none)'}")
    raw = load_yaml(path)
    return path.stem, dict(raw.get("model") or {}), dict(raw.get("train") or {})


def _base(model_sec: dict[str, Any], train_sec: dict[str, Any], gpus_per_node: int, nodes: int,
          gpu_memory_gib: float, seq_len: int | None, global_batch: int | None, micro_batch: int,
          dtype: str) -> Config:
    """Plain data parallelism over as many of the GPUs as the global batch can feed."""
    world = gpus_per_node * nodes
    seq = int(seq_len or train_sec.get("seq_len") or 4096)
    gb = int(global_batch or train_sec.get("global_batch") or world)
    fits = [d for d in range(1, world + 1) if world % d == 0 and gb % (d * micro_batch) == 0]
    if not fits:
        raise ValueError(f"global_batch={gb} is not a multiple of micro_batch={micro_batch}")
    dp = max(fits)
    raw = {"model": model_sec,
           "train": {"seq_len": seq, "global_batch": gb, "micro_batch": micro_batch, "dtype": dtype,
                     "lr": train_sec.get("lr", 3e-4), "weight_decay": train_sec.get("weight_decay", 0.0)},
           "parallel": {"dp": dp},
           "hardware": {"device": "cuda", "gpus_per_node": gpus_per_node, "nodes": nodes,
                        "gpu_memory_gib": gpu_memory_gib}}
    return from_dict(raw)


# ----------------------------------------------------------------------------------------------- enumeration


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg: Config, *, hardware: Any = None, margin: float = 0.0, top: int = 10,
                      probe: dict[str, Any] | None = None) -> tuple[list[RankedLayout], int, int]:
    """(the `top` fastest fitting layouts, valid layouts, fitting layouts) over all GPUs of cfg.hardware.

    Shapes tp x cp x pp x dp = GPUs (tp within a node); per shape every schedule (pp > 1), ZeRO stage and, for
    MoE, ep; recompute is tried none -> selective -> full and the first that fits is kept (recompute only adds
    FLOPs, so a later mode that fits is never faster). Validity: config.check's rules."""
    hw = resolve_hardware(cfg, hardware, probe)
    x0 = _layout(cfg)
    m, t = cfg.model, cfg.train
    world = cfg.hardware.gpus_per_node * cfg.hardware.nodes
    tps = [d for d in _pow2_upto(cfg.hardware.gpus_per_node)
           if d == 1 or all(v % d == 0 for v in (m.n_heads, m.n_kv_heads, m.vocab_size, m.d_ff))]
    if m.num_experts:
        tps = [1]  # TP only splits attention on a MoE model (experts stay replicated): EP is the rung
    cps = [c for c in _pow2_upto(world) if t.seq_len % (2 * c) == 0 or c == 1]
    # PP only across nodes (stage-4 anti-pattern "PP at single-node": the bubble is not worth it over NVLink)
    pps = [p for p in _divisors(m.n_layers) if world % p == 0] if cfg.hardware.nodes > 1 else [1]
    probe_cfg = cfg.model_copy()  # its parallel section is swapped per candidate, without re-validation
    usable = int(cfg.hardware.gpu_memory_gib * GiB) - reserve_bytes(cfg)
    valid = fitting = 0
    found: list[tuple[float, RankedLayout]] = []
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                if t.global_batch % (dp * t.micro_batch):
                    continue
                mcount = t.global_batch // (dp * t.micro_batch)
                schedules = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)]
                if pp > 1 and m.n_layers % (2 * pp) == 0 and mcount % pp == 0:
                    schedules += [("interleaved_1f1b", 2), ("zero_bubble", 2)]
                if pp > 1 and mcount < pp:
                    continue
                eps = [1]
                if m.num_experts:
                    eps = [e for e in _divisors(m.num_experts) if dp % e == 0]
                for sched, v in schedules:
                    for ep in eps:
                        for zero in (0, 1, 2, 3):
                            sp = tp > 1 and cp == 1  # SP with TP, except under CP (both shard the sequence)
                            par = {"dp": dp, "zero": zero, "recompute": "none", "tp": tp, "sp": sp, "pp": pp,
                                   "pp_schedule": sched, "pp_virtual": v, "ep": ep, "cp": cp}
                            # config.check's rules decide validity (recompute never changes it)
                            object.__setattr__(probe_cfg, "parallel", ParallelConfig.model_construct(**par))
                            if check(probe_cfg):
                                continue
                            valid += 1
                            x = _replace(x0, dp=dp, zero=zero, recompute="none", tp=tp, sp=sp, pp=pp,
                                         schedule=sched, v=v, ep=ep, cp=cp)
                            st = _states(x, stage_ids(x, 0))
                            if st.params + st.opt > usable:  # model states alone overflow: no recompute helps
                                continue
                            for rc in ("none", "selective", "full"):
                                x = _replace(x0, dp=dp, zero=zero, recompute=rc, tp=tp, sp=sp, pp=pp,
                                             schedule=sched, v=v, ep=ep, cp=cp)
                                q = quick_layout(x, hw)
                                if q.total <= q.usable * (1 - margin):
                                    fitting += 1
                                    # ties (compute-bound layouts) go to the simpler layout: fewer and lighter
                                    # primitives, CP and PP last (the ladder's order)
                                    simple = (cp > 1) * 8 + (pp > 1) * 4 + (ep > 1) * 2 + (tp > 1) * 2 + zero \
                                        + {"none": 0, "selective": 1, "full": 2}[rc]
                                    found.append(((round(q.step_s, 3 - len(str(int(q.step_s)))), simple),
                                                  RankedLayout(parallel={**par, "recompute": rc},
                                                               total_gib=round(q.total / GiB, 3),
                                                               step_time_s=q.step_s, mfu=round(q.mfu, 4),
                                                               comm_fraction=round(q.comm_fraction, 4))))
                                    break  # a heavier recompute mode only adds FLOPs
    found.sort(key=lambda f: f[0])
    return [f[1] for f in found[:top]], valid, fitting


# ----------------------------------------------------------------------------------------------- the plan


def _rung(step: int, primitive: str, reason: str, cfg: Config, hardware: Any, probe: Any, margin: float) -> Rung:
    e = estimate(cfg, hardware=hardware, probe=probe)
    return Rung(step=step, primitive=primitive, reason=reason, parallel=cfg.parallel.model_dump(),
                memory_gib=e.memory.gib(), total_bytes=e.memory.total,
                fits=e.memory.total <= e.usable_bytes * (1 - margin), step_time_s=e.step_time.total_s,
                mfu=e.step_time.mfu, comm_fraction=e.step_time.comm_fraction)


def plan(model: str | dict[str, Any], gpus_per_node: int = 8, nodes: int = 1, gpu_memory_gib: float = 80.0,
         seq_len: int | None = None, global_batch: int | None = None, *, micro_batch: int = 1,
         dtype: str = "bfloat16", margin: float = 0.0, hardware: str | None = None, top: int = 10,
         max_rungs: int = 16, probe: dict[str, Any] | None = None, root: str | Path | None = None) -> Plan:
    """Climb from plain DP to a layout that fits and is not comm-bound, and rank every valid layout.

    `model` names a config in configs/ (its model section, and its seq_len/global_batch when not given) or is
    an inline model section dict. `margin` keeps that fraction of the usable memory free on top of the
    estimator's reserve."""
    from curry_train.advice.advisor import recommend_next

    t0 = time.perf_counter()
    name, model_sec, train_sec = _model_section(model, root)
    world = gpus_per_node * nodes
    gb = int(global_batch or train_sec.get("global_batch") or world)
    if gb < micro_batch:
        raise ValueError(f"global_batch={gb} is smaller than micro_batch={micro_batch}")
    cfg = _base(model_sec, train_sec, gpus_per_node, nodes, gpu_memory_gib, seq_len, gb, micro_batch, dtype)
    rungs = [_rung(0, "baseline", f"plain data parallel over {cfg.parallel.dp} of {world} GPUs (DDP, no "
                   "recompute)", cfg, hardware, probe, margin)]
    more = False
    for step in range(1, max_rungs + 1):
        last = rungs[-1]
        symptom = None if last.fits else "oom"
        rec = recommend_next(cfg, symptom, hardware=hardware, probe=probe)
        if not rec.config_patch:
            more = rec.more_gpus_needed and not last.fits
            break
        try:
            cfg = from_dict(cfg.to_dict(), rec.config_patch)
        except ConfigError:
            break
        rungs.append(_rung(step, rec.primitive, rec.reason, cfg, hardware, probe, margin))
        if rungs[-1].fits and not estimate(cfg, hardware=hardware, probe=probe).step_time.comm_bound:
            break
    ranked, valid, fitting = enumerate_layouts(cfg, hardware=hardware, margin=margin, top=top, probe=probe)
    final = rungs[-1]
    return Plan(model=name, gpus=world, gpus_per_node=gpus_per_node, nodes=nodes, gpu_memory_gib=gpu_memory_gib,
                seq_len=cfg.train.seq_len, global_batch=gb, micro_batch=micro_batch, rungs=rungs,
                final=final.parallel, fits=final.fits, more_gpus_needed=more and not final.fits, ranked=ranked,
                layouts_valid=valid, layouts_fitting=fitting, seconds=time.perf_counter() - t0)
