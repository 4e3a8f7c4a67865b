"""Capacity sweep: under each rung of the ladder, the largest micro-batch and the largest model of a width/depth
family that fit the per-rank budget; from the estimator, or measured with real runs on this machine.

    curry-train sweep --config tiny --json                       # estimator: milliseconds
    curry-train sweep --config tiny --measured --json            # binary search with real runs (measure/sweep.py)

Rungs (cumulative, each the next rung of the stage-4 ladder on the config's hardware): one device; + full
recompute; DDP over the devices; ZeRO-1, -2, -3; ZeRO-3 + full recompute; + TP (a node's width); + PP (more
than one node). Each rung runs with global_batch = dp * micro_batch (one micro-batch per step: no gradient
accumulation, so FSDP keeps no unsharded gradient accumulators).

The family scales the config's model: widths (d_model, with the head dim fixed, heads, kv heads and d_ff in
proportion) times depths (n_layers). "Largest" is by parameter count. Measured mode checks the estimator's
answer with real runs (`curry_train.measure.memory.measure_memory` on the ranks, measure/sweep.py) and binary-searches
around it: the micro-batch between the last size that fits and the first that does not, the model over the family sorted
by estimated peak. A run fits when its measured per-rank peak stays under the budget minus the reserve.

This module decides only: it launches nothing. The measurement is handed in as `measure(cfg) -> peak bytes |
None` (None: the run did not fit); measure/sweep.py supplies the one that runs real ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from curry_train.advice.beyond import OneGpuAnswer, one_gpu_answer
from curry_train.advice.family import DEPTHS, WIDTHS, FamilyMember, family, member
from curry_train.config import Config, ConfigError, from_dict
from curry_train.estimator import GiB, estimate, load_any, param_count

Measure = Callable[[Config], "int | None"]  # a real run's worst per-rank peak in bytes; None: it did not fit


class SweepRow(BaseModel):
    """One rung: its layout and the capacity under it."""

    rung: str
    parallel: dict[str, Any]
    world_size: int
    max_micro_batch: int | None = Field(description="Largest micro-batch (sequences per rank per forward) that "
                                                    "fits with the config's model; None when even 1 does not.")
    micro_batch_peak_bytes: int | None = Field(None, description="Per-rank peak at max_micro_batch.")
    max_model: FamilyMember | None = Field(description="Largest family member that fits at the config's "
                                                       "micro-batch; None when none does.")
    model_peak_bytes: int | None = None
    micro_batch_limited_by: Literal["memory", "search cap"] | None = Field(
        None, description="memory: max_micro_batch + 1 does not fit (a real limit); search cap: every size up to "
                          "the max_micro_batch argument fits, so the limit is higher.")
    model_limited_by: Literal["memory", "family"] | None = Field(
        None, description="memory: the next larger family member does not fit (a real limit); family: the "
                          "family's largest member fits, so the limit lies above the family.")
    source: str = Field(description="estimate, or measured (binary search with real runs).")
    runs: int = Field(0, description="Real runs this row took (measured mode).")
    note: str = Field("", description="What bounds each number, with the sizes that do not fit.")


class SweepResult(BaseModel):
    config: str
    mode: str
    budget_bytes: int
    usable_bytes: int
    micro_batch: int = Field(description="The micro-batch the model search used.")
    family: list[FamilyMember] = Field(description="The width x depth family, smallest first.")
    rungs: list[SweepRow]
    one_gpu: OneGpuAnswer | None = Field(None, description="When the config's model fits under no rung: what fits "
                                         "on one GPU (the largest model of this shape, scaled below the family) and "
                                         "the options beyond this template, each with its GPU and host memory.")
    seconds: float


# ----------------------------------------------------------------------------------------------- rungs


def ladder_rungs(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """(label, parallel section) for each rung this hardware allows, in ladder order."""
    h = cfg.hardware
    avail = h.gpus_per_node * h.nodes
    base = {"dp": 1, "zero": 0, "recompute": "none", "tp": 1, "sp": False, "pp": 1, "pp_schedule": "1f1b",
            "pp_virtual": 1, "ep": 1, "cp": 1}
    rungs = [("single", dict(base)), ("single+recompute", {**base, "recompute": "full"})]
    if avail > 1:
        d = avail
        rungs += [("ddp", {**base, "dp": d}), ("zero1", {**base, "dp": d, "zero": 1}),
                  ("zero2", {**base, "dp": d, "zero": 2}), ("zero3", {**base, "dp": d, "zero": 3}),
                  ("zero3+recompute", {**base, "dp": d, "zero": 3, "recompute": "full"})]
        m = cfg.model
        t = h.gpus_per_node
        while t > 1 and any(v % t for v in (m.n_heads, m.n_kv_heads, m.vocab_size, m.d_ff)):
            t //= 2
        if t > 1 and not m.num_experts and avail // t > 0:
            rungs.append((f"tp{t}", {**base, "dp": avail // t, "zero": 3 if avail // t > 1 else 0,
                                     "recompute": "full", "tp": t, "sp": True}))
        if m.num_experts and avail > 1:
            e = max(x for x in range(1, avail + 1) if avail % x == 0 and m.num_experts % x == 0)
            if e > 1:
                rungs.append((f"ep{e}", {**base, "dp": avail, "zero": 3, "recompute": "full", "ep": e}))
        if h.nodes > 1 and t > 1:
            # uneven stages are fine (pipeline_split.py balances them), so any pp <= n_layers dividing the GPUs
            pp = min((p for p in range(2, m.n_layers + 1) if (avail // t) % p == 0), default=None)
            if pp:
                dp = avail // (t * pp)
                rungs.append((f"tp{t}+pp{pp}", {**base, "dp": dp, "zero": 3 if dp > 1 else 0, "recompute": "full",
                                                 "tp": t, "sp": True, "pp": pp}))
    return rungs


def _at(cfg: Config, parallel: dict[str, Any], micro_batch: int, model: dict | None = None) -> Config | None:
    """The config under `parallel` with one micro-batch of `micro_batch` sequences per step (None: invalid)."""
    raw = cfg.to_dict()
    raw["parallel"] = dict(parallel)
    if model is not None:
        raw["model"] = model
    pp = parallel.get("pp", 1)
    raw["train"] = {**raw["train"], "micro_batch": micro_batch,
                    "global_batch": parallel["dp"] * micro_batch * max(1, pp)}
    try:
        return from_dict(raw)
    except ConfigError:
        return None


# ----------------------------------------------------------------------------------------------- searching


def _bsearch(lo_ok: int, hi_bad: int, fits: Callable[[int], bool]) -> int:
    """Largest n in [lo_ok, hi_bad) with fits(n), given fits(lo_ok) and not fits(hi_bad)."""
    while hi_bad - lo_ok > 1:
        mid = (lo_ok + hi_bad) // 2
        if fits(mid):
            lo_ok = mid
        else:
            hi_bad = mid
    return lo_ok


# ----------------------------------------------------------------------------------------------- the sweep


class _Rung:
    """Fit checks under one rung: from the estimator, or measured (cached, within a run budget)."""

    def __init__(self, cfg: Config, par: dict[str, Any], usable: int, meas: Measure | None, max_runs: int):
        self.cfg, self.par, self.usable, self.meas = cfg, par, usable, meas
        self.max_runs, self.runs_left = max_runs, max_runs
        self.peaks: dict[tuple, int | None] = {}
        self.runs = 0  # real runs this rung took

    def est_peak(self, mb: int, model: dict | None = None) -> int | None:
        c = _at(self.cfg, self.par, mb, model)
        return None if c is None else estimate(c).memory.total

    def real_peak(self, mb: int, model: dict | None = None) -> int | None:
        key = (mb, None if model is None else (model["d_model"], model["n_layers"]))
        if key not in self.peaks:
            c = _at(self.cfg, self.par, mb, model)
            if c is None or self.meas is None:
                self.peaks[key] = None
            else:
                self.runs += 1
                self.peaks[key] = self.meas(c)
        return self.peaks[key]

    def fits_est(self, mb: int, model: dict | None = None) -> bool:
        p = self.est_peak(mb, model)
        return p is not None and p <= self.usable

    def fits_real(self, mb: int, model: dict | None = None) -> bool:
        if self.runs_left <= 0:  # out of runs: the estimator decides the rest of the search
            return self.fits_est(mb, model)
        self.runs_left -= 1
        p = self.real_peak(mb, model)
        return p is not None and p <= self.usable

    def max_micro_batch(self, limit: int) -> tuple[int | None, str]:
        best: int | None = None
        if self.fits_est(1):
            n = 1
            while n * 2 <= limit and self.fits_est(n * 2):
                n *= 2
            best = _bsearch(n, min(2 * n, limit + 1), self.fits_est) if n < limit else n
        if self.meas is None:
            return best, ""
        guess = best or 1  # measured: start at the estimate, walk up or down, then bisect
        if self.fits_real(guess):
            hi = guess + 1
            while hi <= limit and self.runs_left > 0 and self.fits_real(hi):
                guess, hi = hi, min(hi * 2, limit + 1)
            best = _bsearch(guess, hi, self.fits_real) if self.runs_left > 0 else guess
        else:
            best, lo = None, guess // 2
            while lo >= 1 and self.runs_left > 0:
                if self.fits_real(lo):
                    best = _bsearch(lo, guess, self.fits_real)
                    break
                guess, lo = lo, lo // 2
        return best, ("run budget exhausted: the last steps of the search used the estimator"
                      if self.runs_left <= 0 else "")

    def max_model(self, fam: list[dict], params: list[int], mb: int) -> int | None:
        """Index of the largest (by parameters) family member that fits at micro-batch `mb`."""
        ok = [i for i, sec in enumerate(fam) if self.fits_est(mb, sec)]
        best = max(ok, key=lambda i: params[i]) if ok else None
        if self.meas is None or not fam:
            return best
        self.runs_left = self.max_runs
        order = sorted(range(len(fam)), key=lambda i: self.est_peak(mb, fam[i]) or math.inf)

        def fits_at(k: int) -> bool:
            return k < 0 or self.fits_real(mb, fam[order[k]])

        pos = max((order.index(i) for i in ok), default=0)
        top = _bsearch(pos, len(order), fits_at) if fits_at(pos) else _bsearch(-1, pos, fits_at)
        return max(order[: top + 1], key=lambda i: params[i]) if top >= 0 else None


def capacity_sweep(config: str | Path | dict[str, Any] | Config, overrides: dict[str, Any] | None = None, *,
                   rungs: list[str] | None = None, max_micro_batch: int = 4096,
                   widths: tuple[float, ...] = WIDTHS, depths: tuple[float, ...] = DEPTHS,
                   max_runs_per_rung: int = 8, measure: Measure | None = None,
                   root: str | Path | None = None) -> SweepResult:
    """Under each ladder rung: the largest micro-batch and the largest family model that fit the budget.

    `rungs` picks rung labels (default: every rung the config's hardware allows). With `measure` (a real run's
    per-rank peak, measure/sweep.py) each answer is verified and binary-searched around the estimate (at most
    `max_runs_per_rung` runs per search; the estimator decides the rest); without it, the estimator alone."""
    t0 = time.perf_counter()
    cfg = load_any(config, overrides, root=root)
    name = config if isinstance(config, str) else "<config>"
    base_est = estimate(cfg)
    usable = base_est.usable_bytes
    fam = family(cfg, widths, depths)
    params = [param_count(from_dict({**cfg.to_dict(), "model": sec}, validate=False)) for sec in fam]
    members = [member(sec, n) for sec, n in zip(fam, params)]
    meas = measure
    mb0 = cfg.train.micro_batch
    rows = []
    for label, par in ladder_rungs(cfg):
        if (rungs is not None and label not in rungs) or _at(cfg, par, 1) is None:
            continue
        r = _Rung(cfg, par, usable, meas, max_runs_per_rung)
        best_mb, note = r.max_micro_batch(max_micro_batch)
        best_i = r.max_model(fam, params, mb0)
        peak = (r.real_peak if meas is not None else r.est_peak)
        world = par["dp"] * par["tp"] * par["pp"] * par["cp"]
        mb_by = None if best_mb is None else ("search cap" if best_mb >= max_micro_batch else "memory")
        top = max(range(len(fam)), key=lambda i: params[i]) if fam else None
        model_by = None if best_i is None else ("family" if best_i == top else "memory")
        notes = [_mb_note(r, best_mb, mb_by, max_micro_batch), _model_note(r, fam, params, best_i, mb0), note]
        rows.append(SweepRow(
            rung=label, parallel=par, world_size=world, max_micro_batch=best_mb,
            micro_batch_peak_bytes=peak(best_mb) if best_mb is not None else None,
            max_model=members[best_i] if best_i is not None else None,
            model_peak_bytes=peak(mb0, fam[best_i]) if best_i is not None else None,
            micro_batch_limited_by=mb_by, model_limited_by=model_by,
            source="measured" if meas else "estimate", runs=r.runs,
            note="; ".join(n for n in notes if n)))
    return SweepResult(config=str(name), mode="measured" if meas else "estimate",
                       budget_bytes=base_est.budget_bytes, usable_bytes=usable, micro_batch=mb0, family=members,
                       rungs=rows, seconds=time.perf_counter() - t0,
                       one_gpu=None if any(r.max_micro_batch for r in rows) else one_gpu_answer(cfg))


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.3g} GiB"


def _mib(n: int | None) -> str:
    """Two decimals of MiB or GiB: enough to tell the first size that does not fit from the budget."""
    if n is None:
        return "-"
    return f"{n / GiB:.3f} GiB" if n >= 10 * GiB else f"{n / 2**20:.2f} MiB"


def _mb_note(r: _Rung, best: int | None, by: str | None, limit: int) -> str:
    """Why max_micro_batch is what it is, with the (estimated) peak of the first size that does not fit."""
    if best is None:
        return f"micro-batch: even 1 does not fit (estimated {_mib(r.est_peak(1))} > usable {_mib(r.usable)})"
    if by == "search cap":
        return (f"micro-batch: every size up to the search cap max_micro_batch={limit} fits (estimated "
                f"{_mib(r.est_peak(limit))} at {limit}), so {best} is a bound, not the limit: raise max_micro_batch")
    return (f"micro-batch: {best} is the limit ({best + 1} needs an estimated {_mib(r.est_peak(best + 1))} > usable "
            f"{_mib(r.usable)})")


def _model_note(r: _Rung, fam: list[dict], params: list[int], best: int | None, mb: int) -> str:
    """Why max_model is what it is: the next larger member that does not fit, or the family's end."""
    if not fam:
        return ""
    if best is None:
        return f"model: no family member fits at micro-batch {mb}"
    larger = sorted((i for i in range(len(fam)) if params[i] > params[best]), key=lambda i: params[i])
    if not larger:
        return (f"model: every family member up to the largest ({params[best] / 1e6:.1f}M parameters) fits, so the "
                "limit lies above this family, not at its largest member")
    nxt = larger[0]
    return (f"model: {params[best] / 1e6:.1f}M parameters is the limit in this family (the next larger, "
            f"{params[nxt] / 1e6:.1f}M, needs an estimated {_mib(r.est_peak(mb, fam[nxt]))} > usable {_mib(r.usable)})")
