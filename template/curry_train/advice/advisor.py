"""Which parallelism primitive to add next, and why, from the estimator's numbers (the stage-4 ladder).

    curry-train recommend --config llama3-8b --set parallel.zero=0 --json
    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('tiny', 'oom').reason)"

The ladder (skills/stage4-parallel-primitive-intro; its gates in curry_train/rules.py), one rung per call:
  An estimated OOM comes first, whatever the symptom:
  OOM on one device         -> recompute (selective if it fits, else full); then more GPUs with ZeRO.
  OOM under DDP (zero < 3)  -> the lowest ZeRO stage that fits (1: optimizer state, 2: + gradients, 3: + params).
  OOM at ZeRO-3             -> recompute; then EP (MoE); then TP (+SP) inside a node or, for long sequences whose
                               activations overflow, CP: the faster of the two that fits (TP is still tried
                               after CP); then PP across nodes; then "more GPUs", with the smallest node count
                               on which the planner finds a layout (advice/search.py min_nodes_to_fit).
  "oom" given, estimate fits -> no claim: it asks for measured_peak_bytes (bench's peak) or a bench; with it,
                               the next rung must lower the peak by the measured excess.
  slow                      -> advice/tune.py weighs idle GPUs, the bubble, the micro-batch, HSDP, TP inside the
                               node, PP across nodes, EP, each with its estimate.
  no symptom / none         -> advice/tune.py: the heaviest primitive in place that is unnecessary by its own
                               estimate (action "remove"), or nothing.
Never: TP before full sharding, PP inside a node, CP without proven need, EP for a dense model (rules.py).
The symptom, when not given, is derived: OOM when the estimated peak exceeds hardware.gpu_memory_gib minus the
estimator's reserve (CUDA: 2 GiB context/NCCL + 5% fragmentation; CPU: none); slow when exposed communication is
more than half the estimated step. Every answer lists its `alternatives` with their memory and step time.

Deciding and wording are apart: advice/decide.py returns a Decision (primitive, patch, estimate after, `kind` and
the `facts` it rests on) and every counterfactual as a Rejection; `render` and `render_rejected` below are the one
place that turns them into text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from curry_train.advice.decide import Alt, Ctx, Decision, Primitive, Rejection
from curry_train.advice.tune import decide
from curry_train.breakdown import CATEGORIES
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

    action: Literal["add", "remove", "none"] = Field(description="add a primitive, remove one, or change nothing.")
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
    validation: Validation | None = None


# ----------------------------------------------------------------------------------------------- wording


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= 0.01 * GiB else f"{n / 2**20:.2f} MiB"


def _mem(e: Estimate) -> str:
    m = e.memory  # every non-zero category of curry_train/breakdown.py, so the parts add up to the total
    parts = ", ".join(f"{c.replace('_', ' ')} {_gib(getattr(m, c))}" for c in CATEGORIES if getattr(m, c, 0))
    return f"{_gib(m.total)} on pipeline rank {m.pp_rank} at the {m.phase} ({parts})"


def _budget(e: Estimate) -> str:
    return f"usable {_gib(e.usable_bytes)} ({_gib(e.budget_bytes)} budget - {_gib(e.reserve_bytes)} reserve)"


def _set(patch: dict[str, Any]) -> str:
    return " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in patch.items())


def _over(f: dict[str, Any]) -> str:
    return "" if f["fits"] else " (still over)"


def _pct(after: float, before: float) -> str:
    return f"{100 * (after / before - 1):+.0f}%" if before > 0 else "n/a"


def _steps(before: float, after: float) -> str:
    return f"step {before:.3g} s -> {after:.3g} s ({_pct(after, before)})"


def _cp_need_why(f: dict[str, Any]) -> str:
    """The clause that is actually true: the short sequence, or the small activation share."""
    if f["seq_len"] < f["long_context"]:
        return f"seq_len {f['seq_len']} < {f['long_context']}"
    return f"activations {f['act_share']:.0%} < {f['threshold']:.0%} of the peak at seq_len {f['seq_len']}"


# Each rejection kind and its wording (facts: decide.py, tune.py).
_REJECTED: dict[str, Callable[[dict[str, Any]], str]] = {
    "invalid": lambda f: f"{f['name']} {f['patch']}: refused by the config rules ({f['why']})",
    "refused": lambda f: f"{f['name']}: refused by the config rules, not by memory ({f['why']})",
    "still_over": lambda f: f"{f['name']} {f['patch']}: {_gib(f['total'])} still over",
    "one_device_recompute_first": lambda f: "zero/tp/pp: one device; recompute is the first rung (seed: "
                                            "'single-GPU OOM -> recompute first')",
    "tp_before_fsdp": lambda f: "tp: never before full sharding (ZeRO-3 solves more with less)",
    "cp_no_need": lambda f: f"cp: no proven need ({_cp_need_why(f)})",
    "cp_vs_tp": lambda f: (f"{f['other']} {f['other_patch']}: {_gib(f['other_total'])}"
                           f"{'' if f['other_fits'] else ' (over)'}, {f['other_step']:.3g} s per step against "
                           f"{f['step']:.3g} s with {f['chosen']}"),
    "tp_moe": lambda f: "tp: on a MoE model the TP plan splits attention only (experts are replicated over tp); "
                        "shard the experts with ep instead",
    "tp_node_size": lambda f: f"tp: already {f['tp']} = GPUs per node; TP across nodes is ~43% slower (Playbook)",
    "pp_one_node": lambda f: "pp: one node; PP's bubble is rarely worth it where the node's fast link carries TP "
                             "+ FSDP",
}


def _oom_head(est: Estimate, target: int, given: str | None) -> str:
    if est.memory.total > est.usable_bytes:
        first = f" (memory first: the given symptom '{given}' waits until it fits)" if given not in (None, "oom") \
            else ""
        return f"estimated peak {_mem(est)} > {_budget(est)}{first}"
    return (f"measured peak above the budget although the estimate ({_gib(est.memory.total)}) fits: lowering the "
            f"peak below {_gib(target)}")


def _slow_head(est: Estimate, comm: dict[str, float]) -> str:
    st = est.step_time
    worst = max(comm, key=comm.get) if comm else None  # type: ignore[arg-type]
    return (f"estimated step {st.total_s:.3g} s: compute {st.compute_s:.3g} s, bubble {st.bubble_s:.3g} s, exposed "
            f"communication {st.comm_exposed_s:.3g} s ({st.comm_fraction:.0%}"
            + (f", mostly {worst} {comm[worst]:.3g} s" if worst and comm[worst] > 0 else "") + ")")


_ZERO_WHAT = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters too"}


def _in_place(f: dict[str, Any]) -> str:
    return ", ".join(f"{k}={f[k]}" for k in ("zero", "recompute", "tp", "pp", "cp", "ep") if k in f)


# What each lever does, for the slow answer (facts: tune.py).
_WHY: dict[str, Callable[[dict[str, Any]], str]] = {
    "dp": lambda f: "Idle GPUs are the cheapest speed-up: more data-parallel ranks split the batch.",
    "micro_batch": lambda f: ("FSDP re-gathers the parameters once per micro-batch and a pipeline fills with "
                              "micro-batches: the micro-batch trades the two."),
    "tp": lambda f: (f"Data-parallel communication ({f['dp_comm']:.3g} s exposed) dominates; tensor parallel inside "
                     "the node shrinks the data-parallel group that crosses nodes."),
    "pp": lambda f: (f"Across {f['nodes']} nodes a pipeline sends only activations between nodes, and its "
                     "schedule and virtual stages set the bubble."),
    "ep": lambda f: ("A mixture of experts at scale: expert parallel trades the all-gather of every expert for two "
                     "all-to-alls of the routed tokens."),
    "hsdp": lambda f: (f"FSDP's group spans the {f['nodes']} nodes, so every all-gather and reduce-scatter crosses "
                       "the inter-node link; HSDP keeps them inside a node and sends only one all-reduce of the "
                       "gradient shards across."),
    "zero": lambda f: "", "recompute": lambda f: "", "cp": lambda f: "",
}

# Each decision kind and its wording: (head, facts, estimate before, estimate after) -> reason.
_REASON: dict[str, Callable[[str, dict[str, Any], Estimate, Any], str]] = {
    "recompute": lambda h, f, b, e: (
        f"{h}. Activation recompute ({f['mode']}) drops the saved activations to {_gib(f['activations'])}: peak "
        f"{_gib(f['total'])} ({'fits' if f['fits'] else 'the largest saving, still over'}); it costs FLOPs, not "
        f"communication: {_steps(b.step_time.total_s, e.step_time.total_s)}."),
    "one_device_more_gpus": lambda h, f, b, e: (
        f"{h}, with recompute={f['recompute']} and one device on this hardware ({f['gpus_per_node']} x "
        f"{f['nodes']}): the only answer is more GPUs (then ZeRO over them)"
        + (f"; the planner finds a fitting layout from {f['min_nodes']} nodes of {f['gpus_per_node']}"
           if f.get("min_nodes") else "") + "."),
    "no_dp_layout": lambda h, f, b, e: f"{h}; no valid data-parallel layout on {f['avail']} devices: more GPUs.",
    "zero_from_one_device": lambda h, f, b, e: (
        f"{h}. Recompute ({f['recompute']}) is not enough; spread the model states over dp={f['dp']} devices: "
        f"ZeRO-{f['zero']} is the lowest stage that {'fits' if f['fits'] else 'comes closest'} ({_gib(f['total'])})."),
    "zero": lambda h, f, b, e: (
        f"{h}. Model states are {_gib(f['states'])} of it; ZeRO-{f['zero']} shards {_ZERO_WHAT[f['zero']]} over "
        f"{f['ranks']} ranks: {_gib(f['total'])} "
        f"({'the lowest stage that fits' if f['fits'] else 'still over; recompute is next'})."),
    "cp": lambda h, f, b, e: (
        f"{h}. Sequence {f['seq_len']} tokens: activations are {f['act_share']:.0%} of the peak. Context parallel "
        f"(ring attention) gives each rank {f['tokens']} tokens of every sequence: {_gib(f['total'])}{_over(f)}, "
        f"{_steps(b.step_time.total_s, e.step_time.total_s)}."),
    "ep": lambda h, f, b, e: (
        f"{h}. A mixture of experts at full sharding: expert parallel puts {f['per_rank']} experts on each rank "
        f"and routes tokens by all-to-all: {_gib(f['total'])}{_over(f)}."),
    "tp": lambda h, f, b, e: (
        f"{h}, with zero={f['zero']} and recompute={f['recompute']}. Tensor parallel (+ sequence parallel unless "
        f"CP shards the sequence) inside a node splits every layer's weights and activations {f['tp']} ways over "
        f"the node's link ({f['link']}: {f['link_gbps']:g} GB/s; dp {f['dp_before']} -> {f['dp_after']}): "
        f"{_gib(f['total'])}{_over(f)}, {_steps(b.step_time.total_s, e.step_time.total_s)}."),
    "pp": lambda h, f, b, e: (
        f"{h}, with tp={f['tp']}. Pipeline parallel across the {f['nodes']} nodes splits the layers into "
        f"{f['pp']} stages (1F1B; dp {f['dp_before']} -> {f['dp_after']}): {_gib(f['total'])}{_over(f)}."),
    "dp_idle": lambda h, f, b, e: (
        f"{h}. {f['idle']} devices are idle: more data-parallel ranks shrink the ZeRO shards: "
        f"{_gib(f['total'])}{_over(f)}."),
    "oom_exhausted": lambda h, f, b, e: (
        f"{h}. Every rung this hardware allows is in place ({_in_place(f)}): the only answer is more GPUs"
        + (f": the planner finds a fitting layout from {f['min_nodes']} nodes of {f['gpus_per_node']} "
           f"({f['min_nodes'] * f['gpus_per_node']} GPUs; now {f['nodes']})" if f.get("min_nodes") else
           " (none up to 131,072 GPUs: a smaller micro-batch, sequence or model)") + "."),
    "oom_unmeasured": lambda h, f, b, e: (
        f"the estimate fits: peak {_gib(b.memory.total)} of {_budget(b)} (headroom {_gib(b.headroom_bytes)}), and "
        "no measurement was given, so nothing says it runs out of memory. Pass measured_peak_bytes (bench's "
        "peak_memory_bytes) or run bench; with the measured peak the advisor lowers it by the measured excess."),
    "slow_pick": lambda h, f, b, e: (
        f"{h}. {_WHY[f['prim']](f)} Weighed with the estimator, the lightest change within 10% of the fastest "
        f"is: {f['name']}: "
        f"{_steps(b.step_time.total_s, e.step_time.total_s)}, peak {_gib(e.memory.total)} "
        f"(bubble {e.step_time.bubble_s:.3g} s, exposed communication {e.step_time.comm_exposed_s:.3g} s)."),
    "slow_comm_bound": lambda h, f, b, e: (
        f"{h}: communication-bound, and no option weighed (alternatives) both fits and gains 2%; more (or "
        "faster-linked) GPUs."),
    "slow_compute_bound": lambda h, f, b, e: (
        f"{h}: compute is the step, and no option weighed (alternatives) gains 2%; more data-parallel ranks (more "
        "GPUs) is the lever."),
    "remove": lambda h, f, b, e: (
        f"{f['value']} is unnecessary by its own estimate: with {f['patch']} the peak is {_gib(f['after_total'])} "
        f"of {_budget(b)} (was {_gib(f['before_total'])}) and the {_steps(f['before_step'], f['after_step'])} "
        f"(within 10% counts as unneeded: the seed adds nothing preemptively). Apply {f['patch']}."),
}


def render(d: Decision, est: Estimate, target: int, given: str | None) -> str:
    """The one place a decision becomes its reason text."""
    if d.kind == "nothing":
        return _nothing(est, d.facts.get("needed", []))
    if d.kind.startswith("slow_"):
        return _REASON[d.kind](_slow_head(est, d.facts["comm"]), d.facts, est, d.after)
    if d.kind in ("remove", "oom_unmeasured"):
        return _REASON[d.kind]("", d.facts, est, d.after)
    return _REASON[d.kind](_oom_head(est, target, given), d.facts, est, d.after)


def render_rejected(rejected: list[Rejection]) -> list[str]:
    return [_REJECTED[r.kind](r.facts) for r in rejected]


def _need_text(n: dict[str, Any]) -> str:
    if "over" in n:
        return f"{n['value']}: without it {_gib(n['over'])}, over"
    if "slower" in n:
        return f"{n['value']}: without it {n['slower']:.3g} s per step, more than 10% slower"
    if "anti" in n:
        return f"{n['value']}: without it {', '.join(n['anti'])}"
    if "refused" in n:
        return f"{n['value']}: removing it is refused ({n['refused']})"
    return n["value"]


def _nothing(est: Estimate, needed: list[dict[str, Any]]) -> str:
    st = est.step_time
    why = ("; each primitive in place is needed: " + "; ".join(_need_text(n) for n in needed)) if needed else ""
    return (f"estimated peak {_gib(est.memory.total)} fits ({_budget(est)}, headroom "
            f"{_gib(est.headroom_bytes)}); exposed communication is {st.comm_fraction:.0%} of a "
            f"{st.total_s:.3g} s step: nothing to add{why}. Bench it to confirm.")


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
    over = est.memory.total > usable
    if symptom is None or over:  # an estimated OOM comes first, whatever the symptom
        symptom = "oom" if over else ("slow" if est.step_time.comm_bound else "none")
    target = usable
    if symptom == "oom" and not over and measured_peak_bytes:
        target = max(0, est.memory.total - max(measured_peak_bytes - usable, 1))
    c = Ctx(cfg, est, target, hardware, probe, given)
    d = decide(c, symptom, measured=bool(measured_peak_bytes))
    primitive, patch, more = d.primitive, d.patch, d.more_gpus
    reason = render(d, est, target, asked)
    after = d.after or est
    action = "remove" if d.action == "remove" else ("add" if patch else "none")
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
        gpu_profile=est.gpu_profile or est.hardware.name, validation=validation)
