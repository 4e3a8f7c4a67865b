"""The advisor's words: every decision kind (advice/decide.py, advice/tune.py) and every rejection turned into
the reason text a user reads, with the numbers it rests on. `render` and `render_rejected` are the one place.

    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('tiny', 'oom').reason)"

Where a verdict rests on how this template implements a primitive (PP x FSDP units kept unsharded, DDP unable
to hold TP's DTensor parameters, the chunked loss), the reason says so in one clause, with what Megatron-LM or
torchtitan would do instead (docs/ESTIMATION.md describes each of the template's choices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from curry_train.advice.decide import PEAK_ERROR_BAND, Decision, Rejection
from curry_train.advice.tune import REMOVE_GAIN
from curry_train.breakdown import CATEGORIES
from curry_train.estimator import Estimate, GiB
from curry_train.rules import WITHIN


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


def _loss(f: dict[str, Any]) -> str:
    """The clause a long-sequence verdict owes to this template's chunked loss, with the bytes it saves."""
    if not f.get("logits"):
        return ""
    return (f" In this template the LM loss is chunked (model/gpt.py chunked_lm_loss), so the fp32 [tokens, vocab] "
            f"logits of a micro-batch ({_gib(f['logits'])} per rank here) never exist at once; Megatron-LM or "
            "torchtitan without a fused or chunked cross entropy would need them on top.")


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
    "slower_fit": lambda f: (f"{f['name']} {f['patch']}: fits, {f['step']:.3g} s per step against "
                             f"{f['chosen_step']:.3g} s for the size taken"),
    "still_over": lambda f: f"{f['name']} {f['patch']}: {_gib(f['total'])} still over",
    "recompute_not_enough": lambda f: (f"recompute ({f['mode']}): {_gib(f['total'])}, still over: not a rung that "
                                       "fits, so not the answer"),
    "one_device_recompute_first": lambda f: "zero/tp/pp: one device; recompute is the first rung (it costs FLOPs, "
                                            "not GPUs)",
    "pp_fsdp_units": lambda f: (
        f"pp {f['patch']}: {_gib(f['total'])}, of which {_gib(f['copies'])} are gathered parameter copies: in this "
        "template a pipeline over FSDP stages keeps each chunk's units gathered from its backward to its next "
        "forward (torch.distributed.pipelining; docs/ESTIMATION.md, 'Pipeline x FSDP'): without them about "
        f"{_gib(f['total'] - f['copies'])}; Megatron-LM's pipeline keeps each stage's parameters whole and shards "
        "only the optimizer state (its distributed optimizer), so it has no gathered copies to keep"),
    "oom_plan_over_ladder": lambda f: (f"{f['ladder']} ({_set(f['ladder_patch'])}): {f['ladder_step']:.3g} s per "
                                       f"step against {f['plan_step']:.3g} s for the planner's layout, which does "
                                       "not take it"),
    "tp_before_fsdp": lambda f: "tp: never before full sharding (ZeRO-3 solves more with less)",
    "cp_no_need": lambda f: f"cp: no proven need ({_cp_need_why(f)})",
    "cp_vs_tp": lambda f: (f"{f['other']} {f['other_patch']}: {_gib(f['other_total'])}"
                           f"{'' if f['other_fits'] else ' (over)'}, {f['other_step']:.3g} s per step against "
                           f"{f['step']:.3g} s with {f['chosen']}"),
    "tp_node_size": lambda f: f"tp: already {f['tp']} = GPUs per node; TP across nodes is ~43% slower (Playbook)",
    "pp_one_node": lambda f: "pp: one node; PP's bubble is rarely worth it where the node's fast link carries TP "
                             "+ FSDP",
}


def _oom_head(est: Estimate, target: int, given: str | None, evidence: str, measured: int | None) -> str:
    first = f" (memory first: the given symptom '{given}' waits until it fits)" if given not in (None, "oom") else ""
    if evidence == "estimate":
        return f"estimated peak {_mem(est)} > {_budget(est)}{first}"
    if evidence == "within_band":
        return (f"you report an OOM and the estimate agrees within its error: peak {_gib(est.memory.total)} is "
                f"within the estimator's {PEAK_ERROR_BAND:.0%} band of {_budget(est)} (headroom "
                f"{_gib(est.headroom_bytes)}), so the OOM is believed; the next rung must bring the estimate below "
                f"{_gib(target)}, clear of the band")
    over = f" ({_gib(measured)})" if measured else ""
    return (f"measured peak{over} above {_budget(est)} although the estimate ({_gib(est.memory.total)}) fits: an "
            f"OOM{first}; lowering the peak by the measured excess, below {_gib(target)}")


def _slow_head(est: Estimate, comm: dict[str, float]) -> str:
    st = est.step_time
    worst = max(comm, key=comm.get) if comm else None  # type: ignore[arg-type]
    return (f"estimated step {st.total_s:.3g} s: compute {st.compute_s:.3g} s, bubble {st.bubble_s:.3g} s, exposed "
            f"communication {st.comm_exposed_s:.3g} s ({st.comm_fraction:.0%}"
            + (f", mostly {worst} {comm[worst]:.3g} s" if worst and comm[worst] > 0 else "") + ")")


_ZERO_WHAT = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters too"}


def _next(f: dict[str, Any]) -> str:
    """The rung an unconfirmed OOM names: the ladder's primitive, or the planner's layout (advice/agree.py)."""
    return "the planner's layout under that budget" if f.get("next_kind") == "oom_plan" else f["next"]


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
    "plan": lambda f: ("No single primitive gains 2%, but the layout the planner ranks first for this model, "
                       "cluster, batch and micro-batch (curry-train plan) does, changing several at once."),
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
           if f.get("min_nodes") else "") + ". On this one GPU, `one_gpu` gives what does fit and the options "
        "beyond this template (LoRA/QLoRA, 8-bit optimizer states, CPU/NVMe offload) with their memory."),
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
        f"{_steps(b.step_time.total_s, e.step_time.total_s)}.{_loss(f)}"),
    "ep": lambda h, f, b, e: (
        f"{h}. A mixture of experts at full sharding: expert parallel puts {f['per_rank']} experts on each rank "
        f"and routes tokens by all-to-all: {_gib(f['total'])}{_over(f)}, "
        f"{_steps(b.step_time.total_s, e.step_time.total_s)}"
        f"{'' if not f['fits'] else ', the fastest of the sizes that fit'}."),
    "tp": lambda h, f, b, e: (
        f"{h}, with zero={f['zero']} and recompute={f['recompute']}. Tensor parallel (+ sequence parallel unless "
        f"CP shards the sequence) inside a node splits every layer's weights and activations {f['tp']} ways over "
        f"the node's link ({f['link']}: {f['link_gbps']:g} GB/s; dp {f['dp_before']} -> {f['dp_after']}): "
        f"{_gib(f['total'])}{_over(f)}, {_steps(b.step_time.total_s, e.step_time.total_s)}.{_loss(f)}"),
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
    "oom_plan": lambda h, f, b, e: (
        f"{h}. "
        + (f"The ladder's next rung, {f['ladder']} ({_set(f['ladder_patch'])}), would take {f['ladder_step']:.3g} s "
           "per step; the layout the planner ranks first under the same budget does not take that rung and is more "
           f"than {WITHIN:.0%} faster" if f["ladder_patch"] else
           "No rung of the ladder lowers the peak enough here, but the planner finds a layout under the same budget")
        + f" (curry-train plan on these {f['gpus']} GPUs, micro-batch kept): {f['what']}: {_gib(f['total'])}"
        f"{_over(f)}, {_steps(b.step_time.total_s, e.step_time.total_s)}."),
    "oom_unmeasured": lambda h, f, b, e: (
        f"you report an OOM, but the estimate fits with room: peak {_gib(b.memory.total)} of {_budget(b)} "
        f"(headroom {_gib(b.headroom_bytes)}, more than the estimator's {PEAK_ERROR_BAND:.0%} error band). Pass "
        "measured_peak_bytes (bench's peak_memory_bytes) or run bench; if the measurement confirms it, the next "
        "rung is " + (f"{_next(f)} ({_set(f['next_patch'])})" if f["next_patch"] else "more GPUs") + "."),
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
        f"{f['value']} costs {-f['gain']:.0%} of the step; with {f['patch']} the "
        f"{_steps(f['before_step'], f['after_step'])}, peak {_gib(f['after_total'])} of {_budget(b)} (was "
        f"{_gib(f['before_total'])})"
        + (f", with micro-batch {f['micro_batch']}: the larger micro-batch fits and pays only without it"
           if f.get("micro_batch") else "")
        + f"; a removal is advised only when it gains at least {REMOVE_GAIN:.0%}, beyond the planner's tie band. "
        f"Apply {f['patch']}."),
    "remove_pointless": lambda h, f, b, e: (
        f"{f['value']} does nothing here: {f['why']}; with {f['patch']} the memory and the step stay the same "
        f"({_gib(f['after_total'])}, {f['after_step']:.3g} s). Apply {f['patch']}."),
}


def render(d: Decision, est: Estimate, target: int, given: str | None, evidence: str = "",
           measured: int | None = None) -> str:
    """The one place a decision becomes its reason text."""
    if d.kind == "nothing":
        return _nothing(est, d.facts.get("needed", []))
    # nothing is wrong and a change is advised: it is an improvement of a layout that runs, and says so
    opt = "Optional improvement (the layout fits and runs): " if given in (None, "none") and not evidence and \
        d.patch and d.kind in ("slow_pick", "remove") else ""
    if d.kind.startswith("slow_"):
        return opt + _REASON[d.kind](_slow_head(est, d.facts["comm"]), d.facts, est, d.after)
    if d.kind in ("remove", "remove_pointless", "oom_unmeasured"):
        return opt + _REASON[d.kind]("", d.facts, est, d.after)
    return _REASON[d.kind](_oom_head(est, target, given, evidence or "estimate", measured), d.facts, est, d.after)


def render_caution(est: Estimate, rung: Decision) -> str:
    """The caution an answer that changes nothing owes a fit inside the estimator's error band (agree.band_rung)."""
    nxt = f"{rung.primitive} ({_set(rung.patch)})" if rung.patch else "more GPUs"
    return (f"Caution: the estimated peak {_gib(est.memory.total)} is within the estimator's {PEAK_ERROR_BAND:.0%} "
            f"error band of {_budget(est)} (headroom {_gib(est.headroom_bytes)}; the band is "
            "benchmarks/estimator_accuracy.py's target for the per-rank peak, advice/search.py PEAK_ERROR_BAND), so "
            "the estimate is not evidence that it fits: run bench to measure the peak; if the measurement runs out "
            f"of memory, the next rung is {nxt}, the rung a reported OOM gets here.")


def render_rejected(rejected: list[Rejection]) -> list[str]:
    return [_REJECTED[r.kind](r.facts) for r in rejected]


def _need_text(n: dict[str, Any]) -> str:
    if "over" in n:
        return f"{n['value']}: without it {_gib(n['over'])}, over"
    if "gain" in n:
        return (f"{n['value']}: without it {n['step']:.3g} s per step ({n['gain']:+.0%}), not the "
                f"{REMOVE_GAIN:.0%} gain a change must bring")
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


