"""The out-of-memory rung held to the planner: "it runs out of memory, what next?" gets one answer whichever tool
is asked (docs/ARCHITECTURE.md#one-answer-to-an-oom).

    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('mixtral-8x7b', 'oom'))"

`recommend_next` climbs the ladder one rung at a time (advice/decide.py `oom`); `plan` ranks every layout of the
cluster and climbs to its `final` (advice/planner.py). Asked the same question (the same model, the GPUs the rung
uses, the batch and the user's micro-batch, and the same memory evidence: every layout's usable budget lowered as
the evidence lowers this layout's, plan's `margin`), the two agree when
  - the rung is a step of plan's climb from this layout to plan's final F: it raises a primitive (ZeRO stage,
    recompute mode, tp, pp, ep, cp, HSDP replicas; dp for idle GPUs) that F also uses more of, or the layout it
    leads to is within the planner's tie band (rules.WITHIN) of F's step time; and
  - the ladder names no rung (more GPUs) only when plan finds no layout under that budget either.
Where the ladder's rung is neither, the answer is plan's layout itself (`oom_plan`), as the slow answer takes the
planner's layout when no single primitive gains (advice/tune.py). A rung that uses idle GPUs or one device is
compared with plan on the GPUs it uses: idle GPUs are the "slow" answer's lever, and on one device the ladder tries
recompute before more GPUs.
"""

from __future__ import annotations

from typing import Any

from curry_train.advice.decide import Ctx, Decision, band_edge, oom, try_patch
from curry_train.advice.planner import cluster_config
from curry_train.advice.search import Row, plan_final
from curry_train.config import Config, ConfigError
from curry_train.estimator import resolve_hardware
from curry_train.rules import WITHIN

RECOMPUTE = ("none", "selective", "full")
# a layout that changes several primitives is named by the heaviest it changes
HEAVIEST_FIRST = (("cp", "cp"), ("ep", "ep"), ("pp", "pp"), ("tp", "tp"), ("recompute", "recompute"),
                  ("zero", "zero"), ("dp_replicate", "hsdp"), ("dp", "dp"))
# the parallel keys whose larger value is more of a primitive, and the primitive each one is
RAISES = (("zero", "zero"), ("recompute", "recompute"), ("tp", "tp"), ("pp", "pp"), ("ep", "ep"), ("cp", "cp"),
          ("dp_replicate", "hsdp"))


def primitive_of(prim: str, patch: dict[str, Any]) -> Any:
    """The primitive an option is named by: the planner's layout ("plan") by the heaviest primitive it changes."""
    if prim != "plan":
        return prim
    keys = {k.split(".")[-1] for k in patch}
    return next((name for key, name in HEAVIEST_FIRST if key in keys), "dp")


def amount(par: dict[str, Any], key: str) -> int:
    """How much of a primitive a parallel section uses (recompute by mode: none < selective < full)."""
    return RECOMPUTE.index(par[key]) if key == "recompute" else int(par[key])


def raised(before: dict[str, Any], after: dict[str, Any], with_dp: bool = False) -> set[str]:
    """The parallel keys `after` uses more of than `before` (dp only when asked: it moves with every shape)."""
    keys = [k for k, _ in RAISES] + (["dp"] if with_dp else [])
    return {k for k in keys if amount(after, k) > amount(before, k)}


def lowers_any(par: dict[str, Any], patch: dict[str, Any]) -> bool:
    """Whether `patch` takes any primitive down (dp aside: it moves with every shape): an answer that raises some
    primitives and lowers others is a change of layout, not the addition of one (advisor.py's action)."""
    after = {**par, **{k.split(".")[-1]: v for k, v in patch.items() if k.startswith("parallel.")}}
    return any(amount(after, k) < amount(par, k) for k, _ in RAISES)


def cluster_for(cfg: Config, gpus: int) -> tuple[int, int]:
    """(gpus_per_node, nodes) of `gpus` GPUs of cfg's node type: whole nodes, or part of one."""
    gpn = cfg.hardware.gpus_per_node
    if gpus < gpn:
        return gpus, 1
    return (gpn, gpus // gpn) if gpus % gpn == 0 else (gpn, cfg.hardware.nodes)


def plan_under(c: Ctx, gpus: int) -> Row | None:
    """plan's final row on `gpus` GPUs of this node type, the user's micro-batch kept, every layout's limit lowered
    as the evidence lowers this one's (c.target against its usable budget); None when nothing fits or plan
    refuses the question. The same search and choice as `plan` (search.plan_final), without its climb."""
    cfg = c.cfg
    m, t, h = cfg.model, cfg.train, cfg.hardware
    margin = max(0.0, 1 - c.target / c.est.usable_bytes) if c.est.usable_bytes > 0 else 0.0
    gpn, nodes = cluster_for(cfg, gpus)
    name = c.hardware if isinstance(c.hardware, str) else ("CPU" if h.device == "cpu" else None)
    try:
        asked = cluster_config(m.model_dump(), {"lr": t.lr, "weight_decay": t.weight_decay}, gpn, nodes,
                               h.gpu_memory_gib, t.seq_len, t.global_batch, t.micro_batch, t.dtype,
                               "cpu" if (name or "").upper() == "CPU" else "cuda")
    except (ValueError, ConfigError):
        return None
    hw = resolve_hardware(asked, name, c.probe)
    return plan_final(asked, hw, min(margin, 0.999), search_micro_batch=False)[1]


def agrees(before: dict[str, Any], rung: dict[str, Any], rung_step: float, final: dict[str, Any],
           final_step: float, idle: bool = False) -> bool:
    """Whether a rung (before -> rung) is a step of plan's climb from `before` to `final`, or leads within the
    planner's tie band of it."""
    return bool(raised(before, rung, idle) & raised(before, final, idle)) or rung_step <= final_step * (1 + WITHIN)


def against_plan(c: Ctx, d: Decision) -> Decision:
    """The ladder's OOM rung `d` when plan agrees with it (module docstring); otherwise plan's layout under the
    same evidence, or `d` when plan finds none either."""
    cur = c.cfg.parallel.model_dump()
    if d.patch and d.after is not None:
        new = {**cur, **{k.split(".")[-1]: v for k, v in d.patch.items() if k.startswith("parallel.")}}
        gpus = new["dp"] * new["tp"] * new["pp"] * new["cp"]
    else:
        new, gpus = None, c.cfg.hardware.gpus_per_node * c.cfg.hardware.nodes
    final = plan_under(c, gpus)
    if final is None:
        return d  # plan finds no layout under this budget: the ladder's rung (or more GPUs) stands
    if new is not None and agrees(cur, new, d.after.step_time.total_s, final.parallel, final.step_s,
                                  idle=d.primitive == "dp"):
        return d
    patch = {f"parallel.{k}": v for k, v in final.parallel.items() if cur[k] != v}
    _new, e, _why = try_patch(c.cfg, patch, c.hardware, c.probe)
    if e is None or not patch:
        return d
    ladder = {"ladder": d.primitive, "ladder_patch": d.patch,
              "ladder_step": d.after.step_time.total_s if d.patch and d.after is not None else None}
    if d.patch:
        c.reject("oom_plan_over_ladder", **ladder, plan_step=e.step_time.total_s)
    return c.took(primitive_of("plan", patch), "oom_plan", patch, e, **ladder, gpus=gpus,
                  what=", ".join(f"{k.split('.')[-1]}={v}" for k, v in patch.items()))


def planned_oom(c: Ctx) -> Decision:
    """The OOM rung: the ladder's, held to the planner's answer under the same evidence."""
    return against_plan(c, oom(c))


def band_rung(c: Ctx) -> Decision | None:
    """For an answer that changes nothing while the estimate fits inside PEAK_ERROR_BAND of the usable budget:
    the rung a reported OOM gets there (oom_evidence's 'within_band', the same target: clear of the band), to take
    if a measurement runs out of memory. An estimate that close is not evidence that it fits. None outside it."""
    edge = band_edge(c.est)
    if not edge < c.est.memory.total <= c.est.usable_bytes:
        return None
    return planned_oom(Ctx(c.cfg, c.est, edge, c.hardware, c.probe, c.symptom_given))  # its own alternatives
