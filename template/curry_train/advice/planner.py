"""Plan a layout for a model on a cluster: rank every layout that may launch, pick the one a careful engineer
would run, and tell the climb to it one rung at a time.

    curry-train plan --model llama3-70b --gpus-per-node 8 --nodes 32 --gpu A100-80 --seq-len 8192 --json
    python -c "from curry_train.advice.planner import plan; print(plan('llama3-8b', 8, 1, 80.0, 8192, 512).final)"

`plan()` enumerates every valid layout of the cluster (advice/search.py: tp x cp x pp x dp, the pipeline schedule
and virtual stages, ZeRO stage, recompute, micro-batch, for MoE expert parallelism), keeps those that fit, labels
each with its anti-patterns (curry_train/rules/) and picks `final`: the layout with the fewest and lightest
primitives, in the ladder's order, among the clean fitting layouts within 10% of the fastest clean one, using
the most GPUs. `rungs` then climbs from plain data parallelism to `final`, one primitive per rung in the
ladder's order (ZeRO, recompute, TP, PP, EP, CP, then HSDP), each with its estimate. When nothing fits,
`min_nodes_to_fit` is the smallest cluster of the same node type on which the search finds a layout.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.advice.beyond import OneGpuAnswer, one_gpu_answer
from curry_train.advice.search import PEAK_ERROR_BAND, Row, min_nodes_to_fit, plan_final
from curry_train.config import Config, ModelConfig, from_dict, load_yaml
from curry_train.estimator import GiB, estimate, reserve_bytes, resolve_hardware
from curry_train.estimator.profiles import check_cluster, get_profile
from curry_train.rules import WITHIN, tp_blocked_by_vocab, vocab_pad_hint


class Rung(BaseModel):
    """One step of the climb: the layout after it and what the estimator says about it."""

    step: int
    micro_batch: int = Field(1, description="train.micro_batch of this rung (the final layout's).")
    headroom_gib: float = Field(0.0, description="Usable memory (after the margin) minus the peak, GiB.")
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
    micro_batch: int = Field(description="train.micro_batch of this layout.")
    gpus_used: int
    total_gib: float = Field(description="Estimated per-rank peak (largest rank).")
    headroom_gib: float = Field(0.0, description="Usable memory (after the margin) minus the peak, GiB.")
    final: bool = Field(False, description="True for the row that is `final`.")
    step_time_s: float
    mfu: float
    comm_fraction: float
    anti_patterns: list[str] = Field(default_factory=list, description="Ids of the anti-patterns (rules/patterns.py); "
                                     "empty when clean. A row with one is never `final`.")


class Plan(BaseModel):
    """The chosen layout, the climb to it, and the ranking of the layouts that fit."""

    model: str
    gpus: int
    gpus_per_node: int
    nodes: int
    gpu_memory_gib: float
    gpu_profile: str = Field(description="The hardware profile the estimates used (speed).")
    hardware_note: str = Field("", description="Which profile and budget, and why.")
    seq_len: int
    global_batch: int
    micro_batch: int = Field(description="The final layout's micro-batch.")
    micro_batch_given: int | None = Field(None, description="The micro-batch the caller gave (None: none given).")
    micro_batch_searched: bool = Field(description="Whether the micro-batch was searched (search_micro_batch); "
                                       "otherwise every row keeps the given one.")
    usable_gib: float = Field(0.0, description="What final's peak must stay under: budget - its reserve "
                              "(reserve_of: the communicators it opens), minus the margin; each row of `ranked` "
                              "has its own headroom.")
    rungs: list[Rung]
    final: dict[str, Any] = Field(description="The parallel section to run (config keys).")
    final_patch: dict[str, Any] = Field(default_factory=dict, description="Dotted keys (parallel.* and "
                                        "train.micro_batch) that turn a config of this model into `final`.")
    final_step_time_s: float | None = None
    fastest_clean_step_time_s: float | None = Field(None, description="The fastest fitting layout without an "
                                                    "anti-pattern; final is within 10% of it.")
    final_anti_patterns: list[str] = Field(default_factory=list)
    gpus_used: int = Field(description="GPUs the final layout uses.")
    idle_reason: str | None = Field(None, description="Why some GPUs idle, when they do.")
    fits: bool = Field(description="Whether any layout fits (then final is one).")
    more_gpus_needed: bool
    min_nodes_to_fit: int | None = Field(None, description="When nothing fits: the smallest node count of this "
                                         "node type on which a layout fits (None when none up to 131,072 GPUs).")
    hints: list[str] = Field(default_factory=list, description="What would open more layouts (vocabulary padding).")
    one_gpu: OneGpuAnswer | None = Field(None, description="When nothing fits: what fits on one GPU of this type "
                                         "and the options beyond this template (LoRA, QLoRA, 8-bit AdamW, "
                                         "CPU/NVMe offload), each with its GPU and host memory.")
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
        from curry_train.paths import config_names

        have = ", ".join(config_names(root))
        raise FileNotFoundError(f"no config {model!r}; available: {have or '(none)'}")
    raw = load_yaml(path)
    return path.stem, dict(raw.get("model") or {}), dict(raw.get("train") or {})


def _dp_for(world_left: int, gb: int, mb: int) -> int:
    """The largest data-parallel size <= world_left whose replicas split the global batch into micro-batches."""
    return max((d for d in range(1, world_left + 1) if gb % (d * mb) == 0), default=1)


def cluster_config(model_sec: dict[str, Any], train_sec: dict[str, Any], gpus_per_node: int, nodes: int,
                   gpu_memory_gib: float, seq_len: int | None, global_batch: int | None, micro_batch: int,
                   dtype: str, device: str) -> Config:
    """Plain data parallelism over as many of the GPUs as the global batch can feed."""
    world = gpus_per_node * nodes
    seq = int(seq_len or train_sec.get("seq_len") or 4096)
    gb = int(global_batch or train_sec.get("global_batch") or world)
    if gb % micro_batch:
        raise ValueError(f"global_batch={gb} is not a multiple of micro_batch={micro_batch}; use a global_batch "
                         f"divisible by {micro_batch}")
    raw = {"model": model_sec,
           "train": {"seq_len": seq, "global_batch": gb, "micro_batch": micro_batch, "dtype": dtype,
                     "lr": train_sec.get("lr", 3e-4), "weight_decay": train_sec.get("weight_decay", 0.0)},
           "parallel": {"dp": _dp_for(world, gb, micro_batch)},
           "hardware": {"device": device, "gpus_per_node": gpus_per_node, "nodes": nodes,
                        "gpu_memory_gib": gpu_memory_gib}}
    return from_dict(raw)


# ----------------------------------------------------------------------------------------------- the climb

_ADDS = (("zero", ("zero",)), ("keep-gathered", ("fsdp_keep_gathered",)), ("recompute", ("recompute",)),
         ("tp", ("tp", "sp")),
         ("pp", ("pp", "pp_schedule", "pp_virtual", "fsdp_reshard")), ("ep", ("ep",)), ("cp", ("cp", "sp")),
         ("hsdp", ("dp_replicate",)))  # HSDP last: its replica count divides the final dp
_ZERO_WHAT = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters, gradients and optimizer "
              "state"}


def _what(prim: str, par: dict[str, Any], mb: int) -> str:
    """What a rung adds, in words generated from the values it sets."""
    if prim == "baseline":
        return f"plain data parallel, dp={par['dp']} (DDP, no recompute, micro-batch {mb})"
    if prim.startswith("zero"):
        return f"ZeRO-{par['zero']} shards the {_ZERO_WHAT[par['zero']]} over dp*cp={par['dp'] * par['cp']} ranks"
    if prim == "keep-gathered":
        return ("FSDP keeps its gathered units across the micro-batches of a step (one all-gather per step, not "
                "one per micro-batch; gradients still reduce-scattered each micro-batch)")
    if prim == "recompute":
        return f"{par['recompute']} activation recompute"
    if prim == "tp":
        return (f"tensor parallel {par['tp']} inside a node{' + sequence parallel' if par['sp'] else ''} "
                f"(dp={par['dp']})")
    if prim == "pp":
        return (f"pipeline parallel {par['pp']} across nodes ({par['pp_schedule']}, {par['pp_virtual']} virtual "
                f"stage(s) per rank; dp={par['dp']})")
    if prim == "ep":
        return f"expert parallel {par['ep']}"
    if prim == "hsdp":
        r = par["dp_replicate"]
        return (f"HSDP: ZeRO-{par['zero']} shards over {par['dp'] * par['cp'] // r} ranks inside a node, {r} "
                f"replicas across nodes all-reduce the gradient shards (dp={par['dp']})")
    return f"context parallel {par['cp']} (dp={par['dp']})"


def _climb(base: Config, target: dict[str, Any], mb: int, hw: Any, probe: Any, margin: float) -> list[Rung]:
    """From plain DP to `target`, one primitive per rung in the ladder's order, each with its estimate."""
    t, h = base.train, base.hardware
    world = h.gpus_per_node * h.nodes
    par = {**base.parallel.model_dump(), "zero": 0, "recompute": "none", "tp": 1, "sp": False, "pp": 1,
           "pp_schedule": "1f1b", "pp_virtual": 1, "ep": 1, "cp": 1, "dp_replicate": 1, "fsdp_keep_gathered": False,
           "fsdp_reshard": "default"}
    steps = [("baseline", par)]
    for prim, keys in _ADDS:
        if target.get(keys[0], par[keys[0]]) == par[keys[0]]:
            continue
        par = {**par, **{k: target[k] for k in keys}}
        par["dp"] = _dp_for(world // (par["tp"] * par["pp"] * par["cp"]), t.global_batch, mb)
        steps.append((f"zero{par['zero']}" if prim == "zero" else prim, par))
    steps[-1] = (steps[-1][0], dict(target))  # the climb ends at final
    rungs: list[Rung] = []
    prev = None
    for i, (prim, pr) in enumerate(steps):
        cfg = from_dict({**base.to_dict(), "parallel": pr, "train": {**base.to_dict()["train"], "micro_batch": mb}},
                        validate=False)
        e = estimate(cfg, hardware=hw, probe=probe)
        usable = e.usable_bytes * (1 - margin)
        text = _what(prim, pr, mb) + f": peak {e.memory.total / GiB:.1f} GiB"
        if prev is not None:
            text += f" (was {prev.memory.total / GiB:.1f}), step {e.step_time.total_s:.3g} s (was " \
                    f"{prev.step_time.total_s:.3g})"
        else:
            text += f", step {e.step_time.total_s:.3g} s"
        text += f"; usable {usable / GiB:.1f} GiB: {'fits' if e.memory.total <= usable else 'over'}"
        rungs.append(Rung(step=i, primitive=prim, reason=text, parallel=pr, memory_gib=e.memory.gib(), micro_batch=mb,
                          headroom_gib=round((usable - e.memory.total) / GiB, 3),
                          total_bytes=e.memory.total, fits=e.memory.total <= usable, step_time_s=e.step_time.total_s,
                          mfu=e.step_time.mfu, comm_fraction=e.step_time.comm_fraction))
        prev = e
    return rungs


def _idle_reason(final: Row, rows: list[Row], world: int, gb: int) -> str | None:
    """Why `final` leaves GPUs idle, from the values that decide it."""
    f, mb = final.parallel, final.micro_batch
    if final.gpus_used == world:
        return None
    shape = f["tp"] * f["pp"] * f["cp"]
    dp_max = world // shape
    full = [r for r in rows if r.gpus_used == world]
    if full:
        best = min(full, key=lambda r: (bool(r.anti), r.step_s))
        why = f"anti-pattern {', '.join(best.anti)}" if best.anti else f"{best.step_s:.3g} s per step"
        return (f"{final.gpus_used} of {world} GPUs: the best layout on all {world} GPUs has {why} against "
                f"{final.step_s:.3g} s here")
    if world % shape:
        return f"tp*pp*cp = {shape} does not divide the {world} GPUs; {final.gpus_used} are used"
    if gb // mb < dp_max:
        return (f"global_batch {gb} / micro_batch {mb} allows at most {gb // mb} data-parallel replicas, and "
                f"tp*pp*cp = {shape} leaves room for {dp_max}; raise global_batch or add TP/PP")
    return (f"global_batch {gb} does not split over the {dp_max} data-parallel replicas that tp*pp*cp = {shape} "
            f"leaves (dp={f['dp']} is the largest that does: {final.gpus_used} of {world} GPUs); use a global_batch "
            f"divisible by {dp_max * mb} or a tp/pp that divides it")


def _heaviest(base: Config) -> dict[str, Any]:
    """When nothing fits: the most memory-saving layout of the ladder without PP/CP (ZeRO-3, full recompute, the
    widest TP), the climb's end."""
    from curry_train.rules import tp_sizes

    h, t = base.hardware, base.train
    tp = max(tp_sizes(base.model, h.gpus_per_node))
    dp = _dp_for(h.gpus_per_node * h.nodes // tp, t.global_batch, t.micro_batch)
    return {**base.parallel.model_dump(), "dp": dp, "zero": 3 if dp > 1 else 0, "recompute": "full", "tp": tp,
            "sp": tp > 1}


# ----------------------------------------------------------------------------------------------- the plan


def _ranked(r: Row, usable: float, final: Row | None) -> RankedLayout:
    own = usable if r.usable is None else r.usable  # the row's own reserve, as its fit and its band use
    return RankedLayout(parallel=r.parallel, micro_batch=r.micro_batch, gpus_used=r.gpus_used,
                        total_gib=round(r.total / GiB, 3), headroom_gib=round((own - r.total) / GiB, 3),
                        final=r is final, step_time_s=r.step_s, mfu=round(r.mfu, 4),
                        comm_fraction=round(r.comm_fraction, 4), anti_patterns=r.anti)


def plan(model: str | dict[str, Any], gpus_per_node: int = 8, nodes: int = 1, gpu_memory_gib: float | None = None,
         seq_len: int | None = None, global_batch: int | None = None, *, micro_batch: int | None = None,
         search_micro_batch: bool | None = None, dtype: str = "bfloat16", margin: float = 0.0,
         hardware: str | None = None, gpu: str | None = None,
         top: int = 10, probe: dict[str, Any] | None = None, root: str | Path | None = None) -> Plan:
    """Rank every layout of the cluster, pick `final`, and climb to it.

    `model` names a config in configs/ (its model section, and its seq_len/global_batch when not given) or is
    an inline model section dict. `gpu` (estimator.profiles.GPU_NAMES, any spelling) sets the speed
    and the memory budget (capped by gpu_memory_gib when that is smaller); `hardware` names a speed profile only.
    `micro_batch` is kept on every row unless `search_micro_batch` (default: on only when no micro_batch is
    given) lets the search try the powers of two that divide the per-rank batch (a change is stated in
    `hints`). `margin` keeps that fraction of the usable memory free on top of the estimator's reserve."""
    t0 = time.perf_counter()
    given_mb = micro_batch
    searched = micro_batch is None if search_micro_batch is None else bool(search_micro_batch)
    micro_batch = micro_batch or 1
    check_cluster(gpus_per_node=gpus_per_node, nodes=nodes, seq_len=seq_len, gpu_memory_gib=gpu_memory_gib,
                  global_batch=global_batch, micro_batch=micro_batch, gpu=gpu)
    if gpu:
        prof = get_profile(gpu)
        gpu_memory_gib = prof.memory_gib if gpu_memory_gib is None else min(float(gpu_memory_gib), prof.memory_gib)
        hardware = hardware or prof.name
    budget = 80.0 if gpu_memory_gib is None else float(gpu_memory_gib)
    name, model_sec, train_sec = _model_section(model, root)
    world = gpus_per_node * nodes
    gb = int(global_batch or train_sec.get("global_batch") or world)
    if gb < micro_batch:
        raise ValueError(f"global_batch={gb} is smaller than micro_batch={micro_batch}; raise global_batch")
    device = "cpu" if (hardware or "").upper() == "CPU" else "cuda"
    cfg = cluster_config(model_sec, train_sec, gpus_per_node, nodes, budget, seq_len, gb, micro_batch, dtype, device)
    hw = resolve_hardware(cfg, hardware, probe)
    found, final_row, best = plan_final(cfg, hw, margin, searched)  # choose: each row's band is its own budget's
    usable = (int(budget * GiB) - reserve_bytes(cfg)) * (1 - margin)
    hints = [f"tp={k} is blocked only by the vocabulary: {vocab_pad_hint(cfg.model.vocab_size, k)}"
             for k in tp_blocked_by_vocab(cfg.model, gpus_per_node)[-1:]]
    if final_row is not None:
        final, mb = final_row.parallel, final_row.micro_batch
    else:
        final, mb = _heaviest(cfg), micro_batch
    rungs = _climb(cfg, final, mb, hw, probe, margin)
    if given_mb is not None and mb != given_mb:
        hints.append(f"micro_batch {mb} instead of the given {given_mb} (search_micro_batch searched it: "
                     f"{final_row.step_s if final_row else float('nan'):.3g} s per step); pass "
                     f"search_micro_batch=false to keep {given_mb}")
    if final_row is not None and final_row.usable is not None:
        usable = final_row.usable  # the final layout's own reserve (its communicators), as its fit used
    if final_row is not None and final_row.in_band():
        hints.append(f"final is within the estimator's {PEAK_ERROR_BAND:.0%} error band of the limit "
                     f"({final_row.total / GiB:.1f} of {usable / GiB:.1f} GiB usable) and more than {WITHIN:.0%} "
                     "faster than every layout outside it: bench it (measure the peak) before committing")
    min_nodes = None if final_row is not None else min_nodes_to_fit(cfg, hw, margin)
    rows = sorted(found.rows, key=lambda r: (r.step_s, r.weight))
    used = final_row.gpus_used if final_row else final["dp"] * final["tp"] * final["pp"] * final["cp"]
    note = (f"{hw.name} speed ({hw.source}), {budget:g} GiB budget"
            + ("" if gpu or hardware else " (no gpu named: speed guessed from the budget; name gpu to set it)"))
    if final_row is None:
        idle = None
    else:
        idle = _idle_reason(final_row, found.rows, world, gb)
    return Plan(model=name, gpus=world, gpus_per_node=gpus_per_node, nodes=nodes, gpu_memory_gib=budget,
                gpu_profile=hw.name, hardware_note=note, seq_len=cfg.train.seq_len, global_batch=gb, micro_batch=mb,
                micro_batch_given=given_mb, micro_batch_searched=searched, usable_gib=round(usable / GiB, 3),
                rungs=rungs, final=final,
                final_patch={**{f"parallel.{k}": v for k, v in final.items()}, "train.micro_batch": mb},
                final_step_time_s=final_row.step_s if final_row else None, fastest_clean_step_time_s=best,
                final_anti_patterns=final_row.anti if final_row else [], gpus_used=used, idle_reason=idle,
                fits=final_row is not None, more_gpus_needed=final_row is None, min_nodes_to_fit=min_nodes,
                hints=hints, one_gpu=None if final_row is not None else one_gpu_answer(cfg, hardware=hw),
                ranked=[_ranked(r, usable, final_row) for r in rows[:top]], layouts_valid=found.valid,
                layouts_fitting=len(found.rows), seconds=time.perf_counter() - t0)
