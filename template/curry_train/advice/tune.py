"""The advisor's decisions for a config that fits: what makes it faster ("slow"), and which primitive in place
is unnecessary by its own estimate (no symptom), as data (advice/advisor.py words them).

    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('llama3-8b').reason)"

slow: every lever is weighed with its estimate: idle GPUs (more data-parallel ranks), the pipeline bubble (its
schedule, virtual stages, more micro-batches), the micro-batch (FSDP re-gathers the parameters once per
micro-batch), TP inside the node when data-parallel communication dominates, PP across nodes, EP for a MoE, and
HSDP when FSDP spans nodes (parallel.dp_replicate: the shard group inside a node, rules.hsdp_replicas, the size
the planner searches). Among the options that fit, have no anti-pattern and gain, the lightest rung of the
ladder within 10% of the fastest wins (the planner's rule, advice/search.py).

remove (issue 20: "never preemptively"): the heaviest primitive first (CP, EP, PP, TP, HSDP, full -> selective
recompute, a lower ZeRO stage) whose removal still fits, has no anti-pattern and keeps the step within 10% of
the current one.
"""

from __future__ import annotations

from typing import Any

from curry_train.advice.decide import Alt, Ctx, Decision, _pp_patches, _tp_patches, dp_sizes, oom
from curry_train.config import Config, from_dict
from curry_train.estimator import Estimate
from curry_train.rules import WITHIN, anti_patterns, ep_allowed, hsdp_replicas, pp_allowed, tp_allowed

WEIGHT = {"dp": 0, "micro_batch": 0, "zero": 1, "hsdp": 1, "recompute": 2, "tp": 3, "pp": 4, "ep": 5, "cp": 6}
DP_COMM = ("dp", "zero1", "fsdp", "hsdp")
GAIN = 0.02  # an option must save at least 2% of the step to be worth a change


def _new_anti(cfg: Config, patch: dict[str, Any]) -> list[str]:
    """Anti-patterns the patch introduces (one the config already has is not the option's fault)."""
    had = {a.id for a in anti_patterns(cfg)}
    return [a.id for a in anti_patterns(from_dict(cfg.to_dict(), patch, validate=False)) if a.id not in had]


def _clean(cfg: Config, patch: dict[str, Any]) -> bool:
    return not _new_anti(cfg, patch)


def _comm(est: Estimate) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in est.communication:
        out[item.primitive] = out.get(item.primitive, 0.0) + item.exposed_s
    return out


def _hsdp(cfg: Config) -> list[tuple[str, str, dict[str, Any]]]:
    """FSDP whose shard group spans nodes: HSDP with the fewest replicas whose shard group fits one node
    (rules.hsdp_replicas), as an option to weigh like any other."""
    p, h = cfg.parallel, cfg.hardware
    if p.dp_replicate > 1:
        return []
    r = hsdp_replicas(p.dp, p.cp, p.tp, h.gpus_per_node, p.zero, p.ep)
    if r is None:
        return []
    shard = p.dp * p.cp // r
    return [("hsdp", f"HSDP: dp_replicate {r} (ZeRO-{p.zero} shards over {shard} ranks inside a node, {r} replicas "
             "all-reduce across nodes)", {"parallel.dp_replicate": r})]


def slow(c: Ctx) -> Decision:
    cfg, p, h, t = c.cfg, c.cfg.parallel, c.cfg.hardware, c.cfg.train
    st = c.est.step_time
    comm = _comm(c.est)
    options: list[tuple[str, str, dict[str, Any]]] = []
    avail = h.gpus_per_node * h.nodes
    if cfg.world_size < avail:
        sizes = [d for d in dp_sizes(cfg, avail // (p.tp * p.pp * p.cp)) if d > p.dp]
        if sizes:
            options.append(("dp", f"use the {avail - cfg.world_size} idle GPUs: dp {p.dp} -> {sizes[0]}",
                             {"parallel.dp": sizes[0]}))
    m = cfg.num_microbatches
    if p.pp > 1:
        for sched, v in (("interleaved_1f1b", 2), ("zero_bubble", 2), ("interleaved_1f1b", 4)):
            if (sched, v) != (p.pp_schedule, p.pp_virtual) and cfg.model.n_layers >= p.pp * v:
                patch = {"parallel.pp_schedule": sched, "parallel.pp_virtual": v}
                if p.pp_layers is not None:  # an explicit split has one entry per stage: split by cost instead
                    patch["parallel.pp_layers"] = None
                options.append(("pp", f"pipeline schedule {sched} with {v} virtual stages per rank", patch))
    if t.micro_batch > 1:
        options.append(("micro_batch", f"halve micro_batch to {t.micro_batch // 2} ({2 * m} micro-batches"
                        + (" fill the pipeline)" if p.pp > 1 else ")"), {"train.micro_batch": t.micro_batch // 2}))
    if m % 2 == 0 and (p.pp == 1 or m // 2 >= p.pp):
        options.append(("micro_batch", f"double micro_batch to {2 * t.micro_batch} ({m // 2} micro-batches: half "
                        "the per-micro-batch collectives)", {"train.micro_batch": 2 * t.micro_batch}))
    dp_comm = sum(comm.get(k, 0.0) for k in DP_COMM)
    if tp_allowed(cfg.model) and p.zero == 3 and dp_comm > 0.5 * st.comm_exposed_s > 0:
        for patch in _tp_patches(cfg):
            options.append(("tp", f"tp {patch['parallel.tp']} inside the node (data-parallel communication "
                            f"{dp_comm:.3g} s dominates)", patch))
    if pp_allowed(h.nodes):
        for patch in _pp_patches(cfg, (("1f1b", 1), ("interleaved_1f1b", 2))):
            options.append(("pp", f"pp {patch['parallel.pp']} across nodes ({patch['parallel.pp_schedule']})", patch))
    else:
        c.reject("pp_one_node")
    if ep_allowed(cfg.model) and p.ep == 1:
        for e in [e for e in range(2, cfg.model.num_experts + 1) if cfg.model.num_experts % e == 0 and p.dp % e == 0]:
            off = {"parallel.dp_replicate": 1} if p.dp_replicate > 1 else {}  # the template's EP runs without HSDP
            options.append(("ep", f"ep {e}", {"parallel.ep": e, **off}))
    options += _hsdp(cfg)
    good: list[tuple[str, str, Alt]] = []
    refused: dict[str, str] = {}
    for prim, name, patch in options:
        alt = c.weigh(name, patch)
        if alt.after is None:
            refused.setdefault(prim, alt.refused)
            continue
        if alt.after.memory.total <= c.est.usable_bytes and alt.after.step_time.total_s < st.total_s * (1 - GAIN) \
                and _clean(cfg, patch):
            good.append((prim, name, alt))
    for prim, why in refused.items():
        if not any(g[0] == prim for g in good):
            c.reject("refused", name=prim, why=why)
    facts = {"comm": comm, "dp_comm": dp_comm}
    if good:
        best = min(a.after.step_time.total_s for _, _, a in good)
        prim, name, alt = min((g for g in good if g[2].after.step_time.total_s <= best * (1 + WITHIN)),
                              key=lambda g: (WEIGHT[g[0]], g[2].after.step_time.total_s))
        return Decision(prim, alt.patch, alt.after, "slow_pick", {**facts, "name": name, "nodes": h.nodes,
                                                                   "prim": prim})
    kind = "slow_comm_bound" if st.comm_fraction > 0.5 else "slow_compute_bound"
    return Decision("none", {}, None, kind, facts, more_gpus=False, action="none")


def _removals(cfg: Config) -> list[tuple[str, list[dict[str, Any]]]]:
    """Heaviest first: each primitive in place and the patches that take it out."""
    p = cfg.parallel
    out: list[tuple[str, list[dict[str, Any]]]] = []
    if p.cp > 1:
        out.append(("cp", [{"parallel.cp": 1, "parallel.dp": p.dp * p.cp, "parallel.sp": p.tp > 1}]))
    if p.ep > 1:
        out.append(("ep", [{"parallel.ep": 1}]))
    if p.pp > 1:
        out.append(("pp", [{"parallel.pp": 1, "parallel.dp": p.dp * p.pp, "parallel.pp_schedule": "1f1b",
                            "parallel.pp_virtual": 1}]))
    if p.tp > 1:
        out.append(("tp", [{"parallel.tp": 1, "parallel.sp": False, "parallel.dp": p.dp * p.tp}]))
    if p.dp_replicate > 1:  # HSDP trades memory (smaller shard groups) for speed: unneeded when FSDP is as fast
        out.append(("hsdp", [{"parallel.dp_replicate": 1}]))
    lighter = {"full": ["none", "selective"], "selective": ["none"]}.get(p.recompute, [])
    if lighter:
        out.append(("recompute", [{"parallel.recompute": r} for r in lighter]))
    if p.zero > 0:
        hsdp_off = {"parallel.dp_replicate": 1} if p.dp_replicate > 1 else {}  # HSDP needs zero >= 2
        out.append(("zero", [{"parallel.zero": z, **(hsdp_off if z < 2 else {})} for z in range(p.zero)]))
    return out


def remove(c: Ctx) -> Decision:
    """The heaviest primitive in place that the estimate says is unnecessary; `nothing` when each is needed."""
    cfg, st = c.cfg, c.est.step_time
    needed: list[dict[str, Any]] = []
    for prim, patches in _removals(cfg):
        why = None
        for patch in patches:  # the lightest replacement first
            alt = c.weigh(f"remove {prim}", patch)
            e = alt.after
            if e is None:
                why = why or {"refused": alt.refused}
                continue
            if e.memory.total > c.est.usable_bytes:
                why = why or {"over": e.memory.total}
                continue
            if e.step_time.total_s > st.total_s * (1 + WITHIN):
                why = why or {"slower": e.step_time.total_s}
                continue
            if not _clean(cfg, patch):
                why = why or {"anti": _new_anti(cfg, patch)}
                continue
            return Decision(prim, patch, e, "remove", {"before_step": st.total_s, "after_step": e.step_time.total_s,
                                                       "before_total": c.est.memory.total,
                                                       "after_total": e.memory.total, "value": _value(cfg, prim),
                                                       "patch": ", ".join(f"{k}={v}" for k, v in patch.items())},
                            action="remove")
        needed.append({"name": prim, "value": _value(cfg, prim), **(why or {})})
    return Decision("none", {}, None, "nothing", {"needed": needed}, action="none")


def _value(cfg: Config, prim: str) -> str:
    p = cfg.parallel
    return {"cp": f"cp={p.cp}", "ep": f"ep={p.ep}", "pp": f"pp={p.pp}", "tp": f"tp={p.tp}",
            "hsdp": f"dp_replicate={p.dp_replicate}",
            "recompute": f"recompute={p.recompute}", "zero": f"zero={p.zero}"}[prim]


def decide(c: Ctx, symptom: str, measured: bool) -> Decision:
    """The answer for `symptom`: an estimated OOM first whatever the symptom; a given OOM the estimate does not
    show needs a measurement; "slow" (given, or derived: communication-bound) weighs the levers; otherwise, or
    when a derived "slow" finds no lever, the unnecessary primitive in place, if any."""
    if c.est.memory.total > c.est.usable_bytes:
        return oom(c)
    if symptom == "oom":
        if not measured:
            return Decision("none", {}, None, "oom_unmeasured", {}, action="none")
        return oom(c)
    if symptom == "slow":
        d = slow(c)
        if d.action != "none" or c.symptom_given:
            return d
    return remove(c)  # nothing wrong (or nothing speeds it up): is a primitive in place unnecessary?
