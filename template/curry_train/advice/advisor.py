"""Which parallelism primitive to add next, and why, from the estimator's numbers (the stage-4 ladder).

    curry-train recommend --config llama3-8b --set parallel.zero=0 --json
    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('tiny', 'oom').reason)"

The ladder (skills/stage4-parallel-primitive-intro; its gates in curry_train/rules/gates.py), one rung per call:
  An estimated OOM comes first, whatever the symptom:
  OOM on one device         -> recompute (selective if it fits, else full); then more GPUs with ZeRO. Recompute
                               that cannot fit is never the answer; with no more GPUs, `one_gpu`
                               (advice/beyond.py): what fits on this GPU and the options beyond the ladder.
  OOM under DDP (zero < 3)  -> the lowest ZeRO stage that fits (1: optimizer state, 2: + gradients, 3: + params).
  OOM at ZeRO-3             -> recompute; then EP (MoE); then TP (+SP) inside a node or, for long sequences whose
                               activations overflow, CP: the faster of the two that fits (TP is still tried
                               after CP); then PP across nodes; then "more GPUs", with the smallest node count
                               on which the planner finds a layout (advice/search.py min_nodes_to_fit).
  evidence of an OOM        -> the symptom is evidence, not a switch (decide.oom_evidence): a measured peak over the
                               usable budget is an OOM whatever the symptom; a reported OOM is believed when the
                               estimate is within the estimator's error band of the limit (search.PEAK_ERROR_BAND,
                               3%: benchmarks/estimator_accuracy.py's target) and climbs to clear the band; far
                               below it asks for measured_peak_bytes and names the rung `if_confirmed`.
  one answer with plan      -> every OOM rung is held to plan's answer under the same budget (advice/agree.py):
                               a step of plan's climb to its final, or within its tie band, else plan's layout;
                               "more GPUs" only where plan finds none either.
  a fit inside the band     -> with no OOM evidence the answer may be `none`, but it carries a `caution`: an estimate
                               that close is not evidence that it fits; bench it, and `if_confirmed` is the rung a
                               reported OOM gets there (agree.band_rung).
  slow                      -> advice/tune.py weighs idle GPUs, the bubble, the micro-batch, HSDP, TP inside the
                               node, PP across nodes, EP, each with its estimate, and every removal the no-symptom
                               path weighs; when no single primitive gains, the planner's layout; the faster wins.
  no symptom / none         -> advice/tune.py: the heaviest primitive in place whose removal pays (it does nothing
                               there, or gains tune.REMOVE_GAIN, 10%, alone or with the micro-batch it makes room
                               for), named as an optional improvement (`improvement`), or nothing.
Never: TP before full sharding, PP inside a node, CP without proven need, EP for a dense model (rules/patterns.py).
The symptom, when not given, is derived: OOM when the estimated peak exceeds hardware.gpu_memory_gib minus the
estimator's reserve (CUDA: 2 GiB context/NCCL + 5% fragmentation; CPU: none); slow when exposed communication is
more than half the estimated step. Every answer lists its `alternatives` with their memory and step time.

Deciding and wording are apart: advice/decide.py returns a Decision (primitive, patch, estimate after, `kind` and
the `facts` it rests on) and every counterfactual as a Rejection; `render` and `render_rejected` (advice/wording.py)
are the one place that turns them into text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from curry_train.advice.agree import band_rung, lowers_any
from curry_train.advice.beyond import OneGpuAnswer, one_gpu_answer
from curry_train.advice.decide import Alt, Ctx, Primitive, oom_evidence
from curry_train.advice.tune import decide
from curry_train.advice.wording import _gib, _set, render, render_caution, render_rejected
from curry_train.config import Config
from curry_train.estimator import Estimate, GiB, estimate, load_any, with_gpu
from curry_train.estimator.profiles import get_profile
from curry_train.rules import ACT_SHARE_FOR_CP, LONG_CONTEXT

Symptom = Literal["oom", "slow", "none"]
__all__ = ["ACT_SHARE_FOR_CP", "LONG_CONTEXT", "Alternative", "Primitive", "Recommendation", "Symptom",
           "Validation", "recommend_next"]


class Validation(BaseModel):
    """How to prove the new layout computes what the single device computes."""

    tool: str = "whitebox_compare"
    config: str
    overrides: dict[str, Any]
    command: str
    note: str


class Alternative(BaseModel):
    """An option weighed for this answer: its patch, memory and step time (or the config rule that refuses it)."""

    change: str
    patch: dict[str, Any]
    fits: bool | None = None
    total_gib: float | None = None
    step_time_s: float | None = None
    step_change_pct: float | None = Field(None, description="Step time change against the current config, percent.")
    refused: str = Field("", description="The config rule (fields, message, fix) that refuses it, if any.")
    text: str = Field(description="e.g. 'halve micro_batch: fits, -3%'.")


class Recommendation(BaseModel):
    """One rung of the ladder: what to add or remove, why (with numbers), and what it should change."""

    action: Literal["add", "remove", "change", "none"] = Field(
        description="add a primitive, remove one, change the layout (the planner's layout, which raises some "
                    "primitives and lowers others: config_patch lists them all), or change nothing.")
    primitive: Primitive
    symptom: Symptom
    symptom_source: Literal["given", "derived"]
    reason: str = Field(description="Why this rung, citing the estimate's numbers.")
    config_patch: dict[str, Any] = Field(description="Dotted keys to apply (update_config / --set).")
    memory_before_bytes: int
    memory_after_bytes: int
    memory_change_pct: float = Field(description="Per-rank peak change, percent (negative = saves memory).")
    usable_bytes: int = Field(description="Budget minus reserve: what the peak must stay under.")
    fits_after: bool
    step_time_before_s: float
    step_time_after_s: float
    throughput_change_pct: float = Field(description="Tokens/s change, percent (estimated).")
    more_gpus_needed: bool = Field(description="True when no rung on this hardware fits.")
    rejected: list[str] = Field(default_factory=list, description="Rungs considered and why not (counterfactuals).")
    alternatives: list[Alternative] = Field(default_factory=list, description="Options weighed, with their "
                                            "memory and step time.")
    min_nodes_to_fit: int | None = Field(None, description="When only more GPUs help: the smallest node count of "
                                         "this node type on which the planner finds a fitting layout.")
    gpu_profile: str = Field("", description="The hardware profile the estimates used.")
    evidence: str = Field("", description="What says it runs out of memory: 'estimate' (estimated peak over the "
                          "usable budget), 'measured' (measured_peak_bytes), 'within_band' (a reported OOM with "
                          "the estimate inside the estimator's error band of the limit), 'unconfirmed' (a "
                          "reported OOM the estimate does not show: measure it); empty when nothing does.")
    improvement: bool = Field(False, description="True when nothing is wrong and the change is an optional "
                              "speed-up of a layout that fits and runs.")
    if_confirmed: dict[str, Any] = Field(default_factory=dict, description="For an unconfirmed OOM, or a fit "
                                         "inside the estimator's error band (`caution`): the next rung's patch, to "
                                         "apply if a measurement shows the OOM.")
    caution: str = Field("", description="Set when nothing is to change but the estimate fits inside the "
                         "estimator's error band of the limit (advice/search.py PEAK_ERROR_BAND): not evidence that "
                         "it fits; bench it, and `if_confirmed` is the rung if the measurement runs out of memory.")
    validation: Validation | None = None
    one_gpu: OneGpuAnswer | None = Field(None, description="When only more GPUs help: what fits on one GPU of "
                                         "this type and the options beyond this template's ladder (LoRA, QLoRA, "
                                         "8-bit AdamW, CPU/NVMe offload), each with its GPU and host memory.")


def _alternatives(alts: list[Alt], est: Estimate, chosen: dict[str, Any]) -> list[Alternative]:
    out, seen = [], set()
    for a in alts:
        if not a.name.startswith(("halve", "double", "use", "pipeline", "tp ", "pp ", "ep ", "HSDP")):
            a = Alt(f"{a.name} " + ", ".join(f"{k.split('.')[-1]}={v}" for k, v in a.patch.items()), a.patch, a.after,
                    a.refused)
        key = repr(sorted(a.patch.items()))
        if key in seen or a.patch == chosen:
            continue
        seen.add(key)
        if a.after is None:
            out.append(Alternative(change=a.name, patch=a.patch, refused=a.refused,
                                   text=f"{a.name}: refused by the config rules ({a.refused})"))
            continue
        fits = a.after.memory.total <= est.usable_bytes
        pct = 100 * (a.after.step_time.total_s / est.step_time.total_s - 1) if est.step_time.total_s else 0.0
        out.append(Alternative(change=a.name, patch=a.patch, fits=fits, total_gib=round(a.after.memory.total / GiB, 3),
                               step_time_s=a.after.step_time.total_s, step_change_pct=round(pct, 1),
                               text=f"{a.name}: {'fits' if fits else 'over'} ({_gib(a.after.memory.total)}), "
                                    f"{pct:+.0f}% step time"))
    return out


# ----------------------------------------------------------------------------------------------- API


def recommend_next(config: str | Path | dict[str, Any] | Config, symptom: Symptom | None = None,
                   overrides: dict[str, Any] | None = None, *, hardware: str | None = None, gpu: str | None = None,
                   probe: dict[str, Any] | None = None, measured_peak_bytes: int | None = None,
                   root: str | Path | None = None) -> Recommendation:
    """The next change for `config` (a name in configs/, a YAML path, a dict or a Config) with dotted
    `overrides`, given `symptom` ("oom", "slow", "none"; derived from the estimate when absent). `gpu` names the
    accelerator (budget and speed); `hardware` a speed profile only."""
    cfg = load_any(config, overrides, root=root)
    if gpu:
        cfg = with_gpu(cfg, gpu)
        hardware = hardware or get_profile(gpu).name
    est = estimate(cfg, hardware=hardware, probe=probe)
    usable = est.usable_bytes
    given = symptom is not None
    asked = symptom
    evidence, target = oom_evidence(est, symptom, measured_peak_bytes)
    if evidence:  # an OOM, estimated or measured, comes first whatever the symptom says
        symptom = "oom"
    elif symptom is None:
        symptom = "slow" if est.step_time.comm_bound else "none"
    c = Ctx(cfg, est, target, hardware, probe, given)
    d = decide(c, symptom, evidence)
    reason = render(d, est, target, asked, evidence, measured_peak_bytes)
    primitive, patch, more = d.primitive, d.patch, d.more_gpus
    after = d.after or est
    action = "remove" if d.action == "remove" else ("add" if patch else "none")
    if action == "add" and lowers_any(cfg.parallel.model_dump(), patch):
        action = "change"  # e.g. the planner's layout taking pp 9 -> 1 and tp 8 -> 2: no single primitive added
    if_confirmed, caution = d.facts.get("next_patch", {}), ""
    band = band_rung(c) if action == "none" and not evidence else None
    if band is not None:  # a fit this close to the limit is not evidence that it fits: measure it
        caution = render_caution(est, band)
        reason, if_confirmed = f"{reason} {caution}", band.patch
    name = config if isinstance(config, str) else "<config>"
    all_patch = {**(overrides or {}), **patch}
    validation = None
    if patch:
        validation = Validation(
            config=str(name), overrides=all_patch,
            command=f"curry-train whitebox --config {name} {_set(all_patch)} --json",
            note="one optimizer step of the new layout against the single-device reference: loss and every "
                 "gradient must match within fp32 noise. A model too big for this machine: check the same "
                 "parallel section on configs/tiny.yaml (the parity does not depend on the size).")
    before_t, after_t = est.step_time.total_s, after.step_time.total_s
    return Recommendation(
        action=action, primitive=primitive, symptom=symptom,
        symptom_source="given" if given and asked == symptom else "derived",
        reason=reason, config_patch=patch, memory_before_bytes=est.memory.total,
        memory_after_bytes=after.memory.total,
        memory_change_pct=round(100.0 * (after.memory.total / est.memory.total - 1), 2) if est.memory.total else 0.0,
        usable_bytes=usable, fits_after=after.memory.total <= usable, step_time_before_s=before_t,
        step_time_after_s=after_t,
        throughput_change_pct=round(100.0 * (before_t / after_t - 1), 2) if after_t > 0 else 0.0,
        more_gpus_needed=more, rejected=render_rejected(c.rejected),
        alternatives=_alternatives(c.alts, est, patch), min_nodes_to_fit=d.facts.get("min_nodes"),
        gpu_profile=est.gpu_profile or est.hardware.name, validation=validation, evidence=evidence,
        improvement=bool(patch) and not evidence and asked in (None, "none") and action != "none",
        if_confirmed=if_confirmed, caution=caution,
        one_gpu=one_gpu_answer(cfg, hardware=hardware, probe=probe) if more else None)
