"""The advisor's decisions as data: which rung, which patch, its estimate and the facts the reason quotes.

    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('tiny', 'oom').reason)"

Nothing here writes prose: each decision names a `kind` and carries the `facts` (numbers, sizes, estimates)
that advice/advisor.py renders into the reason, and each counterfactual is a `Rejection` of the same shape. The
ladder and its anti-patterns (TP before full sharding, PP inside a node, CP without proven need, EP on a dense
model) come from curry_train/rules/; the ladder is described in advice/advisor.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from curry_train.advice.search import PEAK_ERROR_BAND, min_nodes_to_fit  # the estimator's error band
from curry_train.config import Config, ConfigError, from_dict
from curry_train.estimator import Estimate, estimate
from curry_train.rules import (
    ACT_SHARE_FOR_CP,
    LONG_CONTEXT,
    cp_has_proven_need,
    divisors,
    ep_allowed,
    pp_allowed,
    pp_sizes,
)

Primitive = Literal["none", "recompute", "zero", "zero1", "zero2", "zero3", "hsdp", "tp", "pp", "ep", "cp", "dp",
                    "micro_batch"]


@dataclass
class Rejection:
    """A rung considered and not taken: `kind` names the wording, `facts` the values it quotes."""

    kind: str
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decision:
    """One rung: what to add (`primitive`, `patch`), its estimate (`after`), whether only more GPUs help, and
    the `kind` + `facts` the reason is rendered from."""

    primitive: Primitive
    patch: dict[str, Any]
    after: Estimate | None
    kind: str
    facts: dict[str, Any] = field(default_factory=dict)
    more_gpus: bool = False
    action: str = "add"  # add | remove | none


@dataclass
class Alt:
    """An option weighed for this answer, with its estimate (or why the config rules refuse it)."""

    name: str
    patch: dict[str, Any]
    after: Estimate | None
    refused: str = ""


def band_edge(est: Estimate) -> int:
    """The peak above which an estimate is inside PEAK_ERROR_BAND of the usable budget: not evidence either way."""
    return int(est.usable_bytes * (1 - PEAK_ERROR_BAND))


def oom_evidence(est: Estimate, symptom: str | None, measured: int | None) -> tuple[str, int]:
    """(what says the config runs out of memory, the peak the next rung must stay under). A measured peak over
    the usable budget is an OOM whatever the symptom; a reported OOM is believed when the estimate is inside
    PEAK_ERROR_BAND of the limit (the rung must then clear the band); one the estimate does not show is
    'unconfirmed' (the rung is named, to apply if a measurement confirms it)."""
    usable, total = est.usable_bytes, est.memory.total
    if total > usable:
        return "estimate", usable
    if measured is not None and (measured > usable or symptom == "oom"):
        return "measured", max(0, total - max(measured - usable, 1))  # lower the peak by the measured excess
    if symptom != "oom":
        return "", usable
    edge = band_edge(est)
    if total > edge:
        return "within_band", edge
    # A measurement that confirms it is over the budget although the estimate is not: the rung to name must
    # lower the estimated peak, by more than the estimator's error band (a saving inside it is no evidence that
    # the rung lowers the peak). A rung that merely fits the budget may keep the peak (zero 1 -> 2 under TP + PP
    # is the same layout) or raise it (PP over this template's kept FSDP units).
    return "unconfirmed", int(total * (1 - PEAK_ERROR_BAND))


def try_patch(cfg: Config, patch: dict[str, Any], hardware: Any, probe: Any) -> tuple[Config | None,
                                                                                     Estimate | None, str]:
    """The config with `patch` applied and its estimate, or (None, None, why it is invalid)."""
    try:
        new = from_dict(cfg.to_dict(), patch)
    except ConfigError as e:
        return None, None, "; ".join(str(p) for p in e.problems[:2])  # fields: message. Fix: ...
    return new, estimate(new, hardware=hardware, probe=probe), ""


class Ctx:
    """What one decision needs: the config, its estimate, the target and the collected counterfactuals."""

    def __init__(self, cfg: Config, est: Estimate, target: int, hardware: Any, probe: Any, symptom_given: bool):
        self.cfg, self.est, self.target, self.hardware, self.probe = cfg, est, target, hardware, probe
        self.symptom_given = symptom_given
        self.rejected: list[Rejection] = []
        self.alts: list[Alt] = []

    def reject(self, kind: str, **facts: Any) -> None:
        self.rejected.append(Rejection(kind, facts))

    def fits(self, e: Estimate) -> bool:
        return e.memory.total <= self.target

    def weigh(self, name: str, patch: dict[str, Any]) -> Alt:
        """Estimate one option and keep it among the alternatives (a config-rule refusal is kept as such)."""
        _new, e, why = try_patch(self.cfg, patch, self.hardware, self.probe)
        alt = Alt(name, patch, e, why)
        self.alts.append(alt)
        return alt

    def first_fit(self, name: str, patches: list[dict[str, Any]]) -> tuple[dict[str, Any], Estimate] | None:
        """The first valid patch whose estimate fits; otherwise the valid one with the smallest peak below the
        current one; None when there is none. Rejections are recorded."""
        best: tuple[dict[str, Any], Estimate] | None = None
        for patch in patches:
            alt = self.weigh(name, patch)
            e, why = alt.after, alt.refused
            if e is None:
                self.reject("invalid", name=name, patch=patch, why=why)
                continue
            if self.fits(e):
                return patch, e
            self.reject("still_over", name=name, patch=patch, total=e.memory.total)
            if e.memory.total < self.est.memory.total and (best is None or e.memory.total < best[1].memory.total):
                best = (patch, e)  # not a fit, but a step down
        return best

    def fastest_fit(self, name: str, patches: list[dict[str, Any]]) -> tuple[dict[str, Any], Estimate] | None:
        """Of the valid patches whose estimate fits, the one with the shortest step (sizes are weighed by what
        they cost, not by which comes first); without a fit, first_fit's step down."""
        fits: list[tuple[dict[str, Any], Estimate]] = []
        for patch in patches:
            alt = self.weigh(name, patch)
            if alt.after is not None and self.fits(alt.after):
                fits.append((patch, alt.after))
        if not fits:
            self.alts = [a for a in self.alts if a.patch not in patches]  # first_fit weighs them again
            return self.first_fit(name, patches)
        best = min(fits, key=lambda pe: pe[1].step_time.total_s)
        for patch, e in fits:
            if patch is not best[0]:
                self.reject("slower_fit", name=name, patch=patch, step=e.step_time.total_s,
                            chosen_step=best[1].step_time.total_s)
        return best

    def took(self, primitive: Primitive, kind: str, patch: dict[str, Any], e: Estimate, **facts: Any) -> Decision:
        return Decision(primitive, patch, e, kind, {"fits": self.fits(e), "total": e.memory.total, **facts})


def dp_sizes(cfg: Config, upto: int) -> list[int]:
    """Data-parallel sizes <= upto that split the global batch, largest first."""
    t = cfg.train
    return [d for d in sorted(divisors(upto), reverse=True) if t.global_batch % (d * t.micro_batch) == 0]


def _pp_patches(cfg: Config, schedules: tuple[tuple[str, int], ...] = (("1f1b", 1),)) -> list[dict[str, Any]]:
    """Pipeline sizes carved from dp whose stages are whole nodes (rules.pp_sizes; the layers split unevenly by
    cost when pp does not divide them), with each schedule given."""
    p, mb, h = cfg.parallel, cfg.train.micro_batch, cfg.hardware
    out = []
    for pp in pp_sizes(cfg.model.n_layers, h.gpus_per_node * h.nodes, h.nodes):
        if pp <= p.pp or (p.dp * p.pp) % pp:
            continue
        dp = p.dp * p.pp // pp
        if dp < 1 or cfg.train.global_batch % (dp * mb) or cfg.train.global_batch // (dp * mb) < pp:
            continue
        for sched, v in schedules:
            if cfg.model.n_layers >= pp * v:
                patch = {"parallel.pp": pp, "parallel.dp": dp, "parallel.pp_schedule": sched, "parallel.pp_virtual": v}
                if p.pp_layers is not None:  # an explicit split has one entry per stage: split by cost instead
                    patch["parallel.pp_layers"] = None
                if p.dp_replicate > 1 and dp % p.dp_replicate:  # HSDP's replicas must still divide dp
                    patch["parallel.dp_replicate"] = 1
                out.append(patch)
    return out


def oom(c: Ctx) -> Decision:
    """The out-of-memory rung."""
    cfg, p, h = c.cfg, c.cfg.parallel, c.cfg.hardware
    avail = h.gpus_per_node * h.nodes
    dpcp = p.dp * p.cp
    if cfg.train.micro_batch > 1:  # not a rung of the ladder, but the cheapest alternative to weigh against it
        c.weigh("halve micro_batch", {"train.micro_batch": cfg.train.micro_batch // 2})

    def recompute() -> Decision | None:
        modes = ["selective", "full"] if p.recompute == "none" else (["full"] if p.recompute == "selective" else [])
        if not modes:
            return None
        got = c.first_fit("recompute", [{"parallel.recompute": m} for m in modes])
        if got is None:
            return None
        patch, e = got
        return c.took("recompute", "recompute", patch, e, mode=patch["parallel.recompute"],
                      activations=e.memory.activations)

    # 1. one device: recompute first, then more GPUs with ZeRO
    if cfg.world_size == 1:
        # A rung the estimate says cannot fit is not the first answer: recompute when it fits, else ZeRO over more
        # GPUs when that fits; recompute stays the step down only when neither does and more GPUs exist.
        r = recompute()
        if r is not None and r.facts["fits"]:
            c.reject("one_device_recompute_first")
            return r
        sizes = [d for d in dp_sizes(cfg, avail) if d > 1]
        if not sizes:
            if r is not None:
                c.reject("recompute_not_enough", total=r.facts["total"], mode=r.facts["mode"])
            return Decision("none", {}, None, "one_device_more_gpus",
                            {"gpus_per_node": h.gpus_per_node, "nodes": h.nodes, "recompute": p.recompute,
                             "min_nodes": min_nodes_to_fit(cfg, c.est.hardware)}, True)
        d = sizes[0]
        got = c.first_fit("zero", [{"parallel.dp": d, "parallel.zero": z} for z in (1, 2, 3)])
        if got is None or (r is not None and not c.fits(got[1])):
            return r or Decision("none", {}, None, "no_dp_layout", {"avail": avail}, True)
        if r is not None:
            c.reject("recompute_not_enough", total=r.facts["total"], mode=r.facts["mode"])
        patch, e = got
        return c.took(f"zero{patch['parallel.zero']}", "zero_from_one_device", patch, e, dp=d,
                      zero=patch["parallel.zero"], recompute=p.recompute)

    # 2. data parallel below full sharding: the lowest ZeRO stage that fits
    if dpcp > 1 and p.zero < 3:
        # under PP fsdp_reshard=default keeps ZeRO-3's units gathered: the ZeRO-2 layout (curry_train/fsdp_units.py),
        # so the ZeRO-3 rung there reshards after each micro-batch's forward, as the planner's ZeRO-3 row does
        reshard = {"parallel.fsdp_reshard": "always"} if p.pp > 1 and p.fsdp_reshard == "default" else {}
        got = c.first_fit("zero", [{"parallel.zero": z, **(reshard if z == 3 else {})} for z in range(p.zero + 1, 4)])
        if got is not None:
            patch, e = got
            c.reject("tp_before_fsdp")
            m = c.est.memory
            return c.took(f"zero{patch['parallel.zero']}", "zero", patch, e, zero=patch["parallel.zero"],
                          states=m.params + m.grads + m.grad_buffers + m.optimizer, ranks=dpcp)

    # 3. full sharding (or no data parallelism left): recompute
    r = recompute()
    if r is not None:
        return r

    # 4. full sharding + full recompute. Long sequences whose activations are what overflows may take CP ("use
    # CP instead of larger TP", Megatron's context-parallel guide; the seed's CP rung with its proven need), but
    # TP + SP also splits the activations: both are weighed and the faster that fits wins.
    m = cfg.model
    act_share = c.est.memory.activations / max(c.est.memory.total, 1)
    cp_pick = None
    if cp_has_proven_need(cfg.train.seq_len, act_share):
        patches = []
        for cp in divisors(p.dp * p.cp):
            if cp <= p.cp or cfg.train.seq_len % (2 * cp):
                continue
            dp = p.dp * p.cp // cp
            if cfg.train.global_batch % (dp * cfg.train.micro_batch) == 0:
                patches.append({"parallel.cp": cp, "parallel.dp": dp, "parallel.sp": False})
        cp_pick = c.first_fit("cp", patches)
    else:
        c.reject("cp_no_need", seq_len=cfg.train.seq_len, long_context=LONG_CONTEXT, act_share=act_share,
                 threshold=ACT_SHARE_FOR_CP)
    if ep_allowed(m) and p.ep == 1 and p.dp > 1:
        sizes = [e for e in divisors(m.num_experts) if e > 1 and p.dp % e == 0]
        got = c.fastest_fit("ep", [{"parallel.ep": e} for e in sizes])
        if got is not None:
            patch, e = got
            return c.took("ep", "ep", patch, e, per_rank=m.num_experts // patch["parallel.ep"])
    tp_pick = None
    if p.tp < h.gpus_per_node:
        tp_pick = c.first_fit("tp", _tp_patches(cfg))
    else:
        c.reject("tp_node_size", tp=p.tp)
    picks = [(k, g) for k, g in (("cp", cp_pick), ("tp", tp_pick)) if g is not None]
    fitting = [(k, g) for k, g in picks if c.fits(g[1])]
    if fitting or picks:
        pool = fitting or picks
        kind, (patch, e) = min(pool, key=lambda kg: (kg[1][1].step_time.total_s if fitting else kg[1][1].memory.total))
        if len(picks) == 2:
            other = [g for k, g in picks if k != kind][0]
            c.reject("cp_vs_tp", chosen=kind, other="tp" if kind == "cp" else "cp", other_patch=other[0],
                     other_step=other[1].step_time.total_s, other_total=other[1].memory.total,
                     other_fits=c.fits(other[1]), step=e.step_time.total_s)
        t = cfg.train
        cp_n, tp_n = patch.get("parallel.cp", p.cp), patch.get("parallel.tp", p.tp)
        # fp32 logits of one micro-batch on one rank, which this template's chunked loss never holds at once
        logits = 4 * t.micro_batch * (t.seq_len // cp_n) * m.vocab_size // tp_n if t.seq_len >= LONG_CONTEXT else 0
        if kind == "cp":
            return c.took("cp", "cp", patch, e, seq_len=cfg.train.seq_len, act_share=act_share,
                          tokens=cfg.train.seq_len // patch["parallel.cp"], logits=logits)
        return c.took("tp", "tp", patch, e, tp=patch["parallel.tp"], dp_before=p.dp,
                      dp_after=patch.get("parallel.dp", p.dp), cp_after=patch.get("parallel.cp", p.cp),
                      zero=p.zero, recompute=p.recompute, link=c.est.hardware.name,
                      link_gbps=c.est.hardware.intra_node_gbps, logits=logits)
    if pp_allowed(h.nodes):
        pps = _pp_patches(cfg)
        got = c.first_fit("pp", pps)
        kept = [a for a in c.alts if a.patch in pps and a.after is not None and a.after.memory.param_copies > 0
                and not c.fits(a.after)]
        if kept and (got is None or not c.fits(got[1])):  # this template's PP x FSDP keeps units gathered
            a = min(kept, key=lambda a: a.after.memory.total)
            c.reject("pp_fsdp_units", patch=a.patch, total=a.after.memory.total, copies=a.after.memory.param_copies)
        if got is not None:
            patch, e = got
            return c.took("pp", "pp", patch, e, nodes=h.nodes, pp=patch["parallel.pp"], dp_before=p.dp,
                          dp_after=patch["parallel.dp"], tp=p.tp)
    else:
        c.reject("pp_one_node")
    if cfg.world_size < avail:
        sizes = [d for d in dp_sizes(cfg, avail // (p.tp * p.pp * p.cp)) if d > p.dp]
        if sizes:
            got = c.first_fit("dp", [{"parallel.dp": d} for d in sorted(sizes)])
            if got is not None:
                patch, e = got
                return c.took("dp", "dp_idle", patch, e, idle=avail - cfg.world_size)
    nodes = min_nodes_to_fit(cfg, c.est.hardware)
    return Decision("none", {}, None, "oom_exhausted", {"zero": p.zero, "recompute": p.recompute, "tp": p.tp,
                                                        "pp": p.pp, "cp": p.cp, "ep": p.ep, "min_nodes": nodes,
                                                        "gpus_per_node": h.gpus_per_node, "nodes": h.nodes}, True)


def _tp_patches(cfg: Config) -> list[dict[str, Any]]:
    """TP sizes inside a node (divisors of gpus_per_node) carved from dp, or from cp once dp is used up (TP after
    CP). SP goes with TP except under CP (both shard the sequence)."""
    p, t, h = cfg.parallel, cfg.train, cfg.hardware
    out = []
    for tp in divisors(h.gpus_per_node):
        if tp <= p.tp or tp % p.tp:
            continue
        k = tp // p.tp
        if p.dp % k == 0 and t.global_batch % ((p.dp // k) * t.micro_batch) == 0:
            patch = {"parallel.tp": tp, "parallel.sp": p.cp == 1, "parallel.dp": p.dp // k}
            if p.dp_replicate > 1 and (p.dp // k) % p.dp_replicate:  # HSDP's replicas must still divide dp
                patch["parallel.dp_replicate"] = 1
            out.append(patch)
        elif p.cp % k == 0:
            out.append({"parallel.tp": tp, "parallel.sp": False, "parallel.cp": p.cp // k})
    return out


