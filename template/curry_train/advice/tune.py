"""The advisor's decisions for a config that fits: what makes it faster ("slow"), and which primitive in place
is unnecessary by its own estimate (no symptom), as data (advice/advisor.py words them).

    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('llama3-8b').reason)"

slow: every lever is weighed with its estimate: idle GPUs (more data-parallel ranks), the pipeline bubble (its
schedule, virtual stages, more micro-batches), the micro-batch (FSDP re-gathers the parameters once per
micro-batch), TP inside the node when data-parallel communication dominates, PP across nodes, EP for a MoE, and
HSDP when FSDP spans nodes (parallel.dp_replicate: the shard group inside a node, rules.hsdp_replicas, the size
the planner searches); when none of these gains, the planner's layout (advice/planner.py, micro-batch kept).
Among the options that fit, have no anti-pattern and gain, the lightest rung of the ladder within 10% of the
fastest wins (the planner's rule, advice/search.py); advice/tune.decide then takes a removal instead when it is
faster, so "slow" never answers worse than no symptom.

remove: the heaviest primitive first (CP, EP, PP, TP, HSDP, full -> selective recompute, a lower ZeRO stage)
whose removal pays: it does nothing where it is (ZeRO at dp x cp = 1, layout_warnings.py), or its removal fits,
has no anti-pattern and gains at least REMOVE_GAIN of the step (itself, or with the doubled micro-batch that fits
and pays only without it). A removal within the planner's tie band is churn, not advice.
"""

from __future__ import annotations

from typing import Any

from curry_train.advice.agree import planned_oom, primitive_of
from curry_train.advice.decide import Alt, Ctx, Decision, _pp_patches, _tp_patches, dp_sizes
from curry_train.config import Config, from_dict
from curry_train.estimator import Estimate
from curry_train.rules import WITHIN, anti_patterns, ep_allowed, hsdp_replicas, pp_allowed

WEIGHT = {"dp": 0, "micro_batch": 0, "zero": 1, "hsdp": 1, "recompute": 2, "tp": 3, "pp": 4, "ep": 5, "cp": 6,
          "plan": 7}  # the planner's layout may change several primitives at once: the heaviest change
DP_COMM = ("dp", "zero1", "fsdp", "hsdp")
GAIN = 0.02  # an option must save at least 2% of the step to be worth a change
# Removing a primitive the user put in place is a change to a working layout: it must gain more than the band in
# which the planner calls two layouts a tie (rules.WITHIN, 10%), or do nothing at all where it is.
REMOVE_GAIN = WITHIN


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


def _planned(c: Ctx) -> list[tuple[str, str, dict[str, Any]]]:
    """The planner's final layout for this model, cluster, batch and micro-batch (kept) as one option, so that
    "slow" weighs every layout `plan` weighs (advice/planner.py), not only single-primitive moves."""
    from curry_train.advice.planner import plan

    cfg = c.cfg
    m, t, h = cfg.model, cfg.train, cfg.hardware
    hw = c.hardware if isinstance(c.hardware, str) else ("CPU" if h.device == "cpu" else None)
    try:
        p = plan({"model": m.model_dump(), "train": {"lr": t.lr, "weight_decay": t.weight_decay}}, h.gpus_per_node,
                 h.nodes, h.gpu_memory_gib, t.seq_len, t.global_batch, micro_batch=t.micro_batch,
                 search_micro_batch=False, dtype=t.dtype, hardware=hw, probe=c.probe)
    except ValueError:
        return []
    if not p.fits:
        return []
    cur = {f"parallel.{k}": v for k, v in cfg.parallel.model_dump().items()}
    patch = {k: v for k, v in p.final_patch.items() if k in cur and cur[k] != v}
    if not patch:
        return []
    what = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in patch.items())
    return [("plan", f"the planner's layout ({what})", patch)]


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
    if p.zero == 3 and dp_comm > 0.5 * st.comm_exposed_s > 0:
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

    def weigh_all(opts: list[tuple[str, str, dict[str, Any]]]) -> None:
        for prim, name, patch in opts:
            alt = c.weigh(name, patch)
            if alt.after is None:
                refused.setdefault(prim, alt.refused)
                continue
            if alt.after.memory.total <= c.est.usable_bytes and \
                    alt.after.step_time.total_s < st.total_s * (1 - GAIN) and _clean(cfg, patch):
                good.append((prim, name, alt))

    weigh_all(options)
    if not good:  # no one primitive gains: the planner's layout, which may change several, is the lever left
        weigh_all(_planned(c))
    for prim, why in refused.items():
        if not any(g[0] == prim for g in good):
            c.reject("refused", name=prim, why=why)
    facts = {"comm": comm, "dp_comm": dp_comm}
    if good:
        best = min(a.after.step_time.total_s for _, _, a in good)
        prim, name, alt = min((g for g in good if g[2].after.step_time.total_s <= best * (1 + WITHIN)),
                              key=lambda g: (WEIGHT[g[0]], g[2].after.step_time.total_s))
        return Decision(primitive_of(prim, alt.patch), alt.patch, alt.after, "slow_pick",
                        {**facts, "name": name, "nodes": h.nodes, "prim": prim})
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


def _pointless(cfg: Config, prim: str) -> str | None:
    """Why a primitive in place does nothing (layout_warnings.py), or None."""
    p = cfg.parallel
    if prim == "zero" and p.dp * p.cp == 1:
        return "ZeRO shards over the data-parallel ranks and dp x cp = 1 here (nothing to shard over)"
    return None


def _spend(c: Ctx, patch: dict[str, Any]) -> tuple[dict[str, Any], Estimate] | None:
    """The removal with a doubled micro-batch (fewer per-micro-batch gathers), when that fits, is valid and clean
    and the doubled micro-batch alone does not already fit (then the micro-batch, not the removal, is the gain)."""
    t = c.cfg.train
    if t.global_batch % (patch.get("parallel.dp", c.cfg.parallel.dp) * 2 * t.micro_batch):
        return None
    both = {**patch, "train.micro_batch": 2 * t.micro_batch}
    alone = c.weigh(f"double micro_batch to {2 * t.micro_batch}", {"train.micro_batch": 2 * t.micro_batch})
    if alone.after is not None and alone.after.memory.total <= c.est.usable_bytes and \
            alone.after.step_time.total_s <= c.est.step_time.total_s * (1 - REMOVE_GAIN):
        return None
    alt = c.weigh(f"remove and micro_batch {2 * t.micro_batch}", both)
    if alt.after is None or alt.after.memory.total > c.est.usable_bytes or not _clean(c.cfg, both):
        return None
    return both, alt.after


def remove(c: Ctx) -> Decision:
    """The heaviest primitive in place whose removal pays: it does nothing (ZeRO at dp x cp = 1), or taking it
    out gains at least REMOVE_GAIN of the step, alone or with a doubled micro-batch that pays only without it;
    `nothing` when each is needed."""
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
            facts = {"before_step": st.total_s, "after_step": e.step_time.total_s, "before_total": c.est.memory.total,
                     "after_total": e.memory.total, "value": _value(cfg, prim),
                     "patch": ", ".join(f"{k}={v}" for k, v in patch.items())}
            pointless = _pointless(cfg, prim)
            if pointless and e.memory.total <= c.est.usable_bytes:
                return Decision(prim, patch, e, "remove_pointless", {**facts, "why": pointless}, action="remove")
            if e.memory.total > c.est.usable_bytes:
                why = why or {"over": e.memory.total}
                continue
            if not _clean(cfg, patch):
                why = why or {"anti": _new_anti(cfg, patch)}
                continue
            gain = e.step_time.total_s / st.total_s - 1 if st.total_s else 0.0
            if gain > -REMOVE_GAIN:  # not enough alone: does the larger micro-batch it leaves room for pay?
                spent = _spend(c, patch)
                if spent and spent[1].step_time.total_s <= st.total_s * (1 - REMOVE_GAIN):
                    both, e2 = spent
                    return Decision(prim, both, e2, "remove", {
                        **facts, "after_step": e2.step_time.total_s, "after_total": e2.memory.total,
                        "gain": e2.step_time.total_s / st.total_s - 1, "micro_batch": both["train.micro_batch"],
                        "patch": ", ".join(f"{k}={v}" for k, v in both.items())}, action="remove")
            if gain > -REMOVE_GAIN:
                why = why or {"gain": gain, "step": e.step_time.total_s}
                continue
            return Decision(prim, patch, e, "remove", {**facts, "gain": gain}, action="remove")
        needed.append({"name": prim, "value": _value(cfg, prim), **(why or {})})
    return Decision("none", {}, None, "nothing", {"needed": needed}, action="none")


def _value(cfg: Config, prim: str) -> str:
    p = cfg.parallel
    return {"cp": f"cp={p.cp}", "ep": f"ep={p.ep}", "pp": f"pp={p.pp}", "tp": f"tp={p.tp}",
            "hsdp": f"dp_replicate={p.dp_replicate}",
            "recompute": f"recompute={p.recompute}", "zero": f"zero={p.zero}"}[prim]


def decide(c: Ctx, symptom: str, evidence: str) -> Decision:
    """The answer for `symptom` given the `evidence` of an OOM (decide.oom_evidence): an estimated, measured or
    within-band OOM climbs the OOM ladder; an unconfirmed one names that rung for if a measurement confirms it;
    "slow" weighs every lever and every removal the no-symptom path weighs and takes the faster; otherwise the
    primitive in place whose removal gains, if any."""
    if evidence in ("estimate", "measured", "within_band"):
        return planned_oom(c)
    if evidence == "unconfirmed":
        nxt = planned_oom(c)  # the rung an OOM would get, for if the measurement confirms it
        return Decision("none", {}, None, "oom_unmeasured", {"next_patch": nxt.patch, "next": nxt.primitive,
                                                             "next_kind": nxt.kind},
                        action="none")
    if symptom == "slow":
        d = slow(c)
        r = remove(c)
        if r.action == "remove" and (d.action == "none" or r.after.step_time.total_s < d.after.step_time.total_s):
            return r
        if d.action != "none" or c.symptom_given:
            return d
        return r
    return remove(c)  # nothing wrong: is a primitive in place costing time?
