"""Which parallelism primitive to add next, and why, from the estimator's numbers (the stage-4 ladder).

    curry-train recommend --config llama3-8b --set parallel.zero=0 --json
    python -c "from curry_train.advice.advisor import recommend_next; print(recommend_next('tiny', 'oom').reason)"

The ladder (skills/stage4-parallel-primitive-intro, estimation-formulas.md §9), one rung per call:
  OOM on one device         -> recompute (selective if it fits, else full); then more GPUs with ZeRO.
  OOM under DDP (zero < 3)  -> the lowest ZeRO stage that fits (1: optimizer state, 2: + gradients, 3: + params).
  OOM at ZeRO-3             -> recompute; then TP (+SP) inside a node (MoE: EP instead, this template has no
                               expert TP); then CP when long sequences' activations are what overflows;
                               then PP across nodes; then "more GPUs".
  slow (comm-bound)         -> PP across nodes; MoE at scale: EP; compute-bound: more data-parallel ranks.
Never: TP before full sharding, PP inside one node, CP without proven need (seq >= 32k and activations >= 40%
of the peak), EP for a dense model. When no rung fits the hardware, it says the only answer is more GPUs.

The symptom, when not given, is derived: OOM when the estimated peak exceeds hardware.gpu_memory_gib minus the
estimator's reserve (CUDA: 2 GiB context/NCCL + 5% fragmentation; CPU: none); slow when exposed communication is
more than half the estimated step. A given symptom wins: "oom" with an estimate that fits means the estimate
is optimistic, so the next rung must lower it (by the measured excess when `measured_peak_bytes` is given).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from curry_train.config import Config, ConfigError, from_dict
from curry_train.estimator import Estimate, GiB, estimate, load_any

Primitive = Literal["none", "recompute", "zero1", "zero2", "zero3", "tp", "pp", "ep", "cp", "dp"]
Symptom = Literal["oom", "slow", "none"]
LONG_CONTEXT = 32768  # seed: "CP only when sequences > 32k actually drive your task"
ACT_SHARE_FOR_CP = 0.40  # ... and activations are what overflows


class Validation(BaseModel):
    """How to prove the new layout computes what the single device computes."""

    tool: str = "whitebox_compare"
    config: str
    overrides: dict[str, Any]
    command: str
    note: str


class Recommendation(BaseModel):
    """One rung of the ladder: what to add, why (with numbers), and what it should change."""

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
    validation: Validation | None = None


# ----------------------------------------------------------------------------------------------- helpers


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= 0.01 * GiB else f"{n / 2**20:.2f} MiB"


def _mem(e: Estimate) -> str:
    m = e.memory
    return (f"{_gib(m.total)} on pipeline rank {m.pp_rank} at the {m.phase} (params {_gib(m.params)}, grads "
            f"{_gib(m.grads)}, optimizer {_gib(m.optimizer)}, activations {_gib(m.activations)}, other "
            f"{_gib(m.other)})")


def _budget(e: Estimate) -> str:
    return f"usable {_gib(e.usable_bytes)} ({_gib(e.budget_bytes)} budget - {_gib(e.reserve_bytes)} reserve)"


def _try(cfg: Config, patch: dict[str, Any], hardware: Any, probe: Any) -> tuple[Config | None, Estimate | None, str]:
    """The config with `patch` applied and its estimate, or (None, None, why it is invalid)."""
    try:
        new = from_dict(cfg.to_dict(), patch)
    except ConfigError as e:
        return None, None, "; ".join(p.message for p in e.problems[:2])
    return new, estimate(new, hardware=hardware, probe=probe), ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _set(patch: dict[str, Any], cfg: Config) -> str:
    return " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in patch.items())


class _Ctx:
    """What one recommendation needs: the config, its estimate, the target and the collected counterfactuals."""

    def __init__(self, cfg: Config, est: Estimate, target: int, hardware: Any, probe: Any, symptom_given: bool):
        self.cfg, self.est, self.target, self.hardware, self.probe = cfg, est, target, hardware, probe
        self.symptom_given = symptom_given
        self.rejected: list[str] = []

    def fits(self, e: Estimate) -> bool:
        return e.memory.total <= self.target

    def first_fit(self, name: str, patches: list[dict[str, Any]]) -> tuple[dict[str, Any], Estimate] | None:
        """The first valid patch whose estimate fits; otherwise the valid one with the smallest peak below the
        current one; None when there is none. Rejections are recorded."""
        best: tuple[dict[str, Any], Estimate] | None = None
        for patch in patches:
            _new, e, why = _try(self.cfg, patch, self.hardware, self.probe)
            if e is None:
                self.rejected.append(f"{name} {patch}: invalid ({why})")
                continue
            if self.fits(e):
                return patch, e
            self.rejected.append(f"{name} {patch}: {_gib(e.memory.total)} still over")
            if e.memory.total < self.est.memory.total and (best is None or e.memory.total < best[1].memory.total):
                best = (patch, e)  # not a fit, but a step down
        return best


# ----------------------------------------------------------------------------------------------- the ladder


def _dp_sizes(cfg: Config, upto: int) -> list[int]:
    """Data-parallel sizes <= upto that split the global batch, largest first."""
    t = cfg.train
    return [d for d in sorted(_divisors(upto), reverse=True) if t.global_batch % (d * t.micro_batch) == 0]


def _oom(c: _Ctx) -> tuple[Primitive, dict[str, Any], Estimate | None, str, bool]:
    """(primitive, patch, estimate after, reason, more GPUs needed) for an out-of-memory rung."""
    cfg, p, h = c.cfg, c.cfg.parallel, c.cfg.hardware
    avail = h.gpus_per_node * h.nodes
    dpcp = p.dp * p.cp
    head = f"estimated peak {_mem(c.est)} > {_budget(c.est)}" if c.est.memory.total > c.est.usable_bytes else \
        f"measured OOM although the estimate ({_gib(c.est.memory.total)}) fits: lowering the peak below " \
        f"{_gib(c.target)}"

    def recompute() -> tuple[Primitive, dict[str, Any], Estimate | None, str, bool] | None:
        modes = ["selective", "full"] if p.recompute == "none" else (["full"] if p.recompute == "selective" else [])
        if not modes:
            return None
        got = c.first_fit("recompute", [{"parallel.recompute": m} for m in modes])
        if got is None:
            return None
        patch, e = got
        verdict = "fits" if c.fits(e) else "the largest saving, still over"
        return ("recompute", patch, e, (f"{head}. Activation recompute ({patch['parallel.recompute']}) drops the "
                f"saved activations to {_gib(e.memory.activations)}: peak {_gib(e.memory.total)} ({verdict}); it "
                "costs FLOPs, not communication (selective ~ +3%, full ~ +33%)."), False)

    # 1. one device: recompute first, then more GPUs with ZeRO
    if cfg.world_size == 1:
        r = recompute()
        if r is not None:
            c.rejected.append("zero/tp/pp: one device; recompute is the first rung (seed: 'single-GPU OOM -> "
                              "recompute first')")
            return r
        sizes = [d for d in _dp_sizes(cfg, avail) if d > 1]
        if not sizes:
            return ("none", {}, None, (f"{head}, with full recompute already on and one device on this hardware "
                    f"({h.gpus_per_node} x {h.nodes}): the only answer is more GPUs (then ZeRO over them)."), True)
        d = sizes[0]
        got = c.first_fit("zero", [{"parallel.dp": d, "parallel.zero": z} for z in (1, 2, 3)])
        if got is None:
            return ("none", {}, None, f"{head}; no valid data-parallel layout on {avail} devices: more GPUs.", True)
        patch, e = got
        z = patch["parallel.zero"]
        return (f"zero{z}", patch, e, (f"{head}. Recompute is already full; spread the model states over dp={d} "
                f"devices: ZeRO-{z} is the lowest stage that {'fits' if c.fits(e) else 'comes closest'} "
                f"({_gib(e.memory.total)})."), False)

    # 2. data parallel below full sharding: the lowest ZeRO stage that fits
    if dpcp > 1 and p.zero < 3:
        got = c.first_fit("zero", [{"parallel.zero": z} for z in range(p.zero + 1, 4)])
        if got is not None:
            patch, e = got
            z = patch["parallel.zero"]
            c.rejected.append("tp: never before full sharding (ZeRO-3 solves more with less)")
            states = c.est.memory.params + c.est.memory.grads + c.est.memory.optimizer
            what = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters too"}[z]
            return (f"zero{z}", patch, e, (f"{head}. Model states are {_gib(states)} of it; ZeRO-{z} shards {what} "
                    f"over {dpcp} ranks: {_gib(e.memory.total)} "
                    f"({'the lowest stage that fits' if c.fits(e) else 'still over; recompute is next'})."), False)

    # 3. full sharding (or no data parallelism left): recompute
    r = recompute()
    if r is not None:
        return r

    # 4. full sharding + full recompute
    m = cfg.model
    # long sequences whose activations are what overflows: CP first ("use CP instead of larger TP", Megatron's
    # context-parallel guide; the seed's CP rung, with its proven need)
    act_share = c.est.memory.activations / max(c.est.memory.total, 1)
    if cfg.train.seq_len >= LONG_CONTEXT and act_share >= ACT_SHARE_FOR_CP:
        patches = []
        for cp in (2, 4, 8, 16, 32):
            if cp <= p.cp or (p.dp * p.cp) % cp:
                continue
            dp = p.dp * p.cp // cp
            if cfg.train.global_batch % (dp * cfg.train.micro_batch) == 0:
                patches.append({"parallel.cp": cp, "parallel.dp": dp, "parallel.sp": False})
        got = c.first_fit("cp", patches)
        if got is not None:
            patch, e = got
            return ("cp", patch, e, (f"{head}. Sequence {cfg.train.seq_len} tokens: activations are "
                    f"{act_share:.0%} of the peak. Context parallel (ring attention) gives each rank "
                    f"{cfg.train.seq_len // patch['parallel.cp']} tokens of every sequence: "
                    f"{_gib(e.memory.total)}{'' if c.fits(e) else ' (still over)'}."), False)
    else:
        c.rejected.append(f"cp: no proven need (seq_len {cfg.train.seq_len} < {LONG_CONTEXT} or activations "
                          f"{act_share:.0%} < {ACT_SHARE_FOR_CP:.0%} of the peak)")
    if m.num_experts and p.ep == 1 and p.dp > 1:
        sizes = [e for e in _divisors(m.num_experts) if e > 1 and p.dp % e == 0]
        sizes.sort(key=lambda e: (e * p.cp * p.tp > h.gpus_per_node, e))  # inside a node first
        got = c.first_fit("ep", [{"parallel.ep": e} for e in sizes])
        if got is not None:
            patch, e = got
            return ("ep", patch, e, (f"{head}. A mixture of experts at full sharding: expert parallel puts "
                    f"{m.num_experts // patch['parallel.ep']} experts on each rank and routes tokens by all-to-all: "
                    f"{_gib(e.memory.total)}{'' if c.fits(e) else ' (still over)'}."), False)
    if not m.num_experts and p.tp < h.gpus_per_node:
        patches = []
        for t in (2, 4, 8, 16, 32, 64):
            if t <= p.tp or t > h.gpus_per_node or (p.dp * p.tp) % t:
                continue
            dp = p.dp * p.tp // t
            if dp < 1 or cfg.train.global_batch % (dp * cfg.train.micro_batch):
                continue
            patches.append({"parallel.tp": t, "parallel.sp": True, "parallel.dp": dp})
        got = c.first_fit("tp", patches)
        if got is not None:
            patch, e = got
            return ("tp", patch, e, (f"{head}, with ZeRO-3 and full recompute already on. Tensor parallel "
                    f"(+ sequence parallel) inside a node splits every layer's weights and activations "
                    f"{patch['parallel.tp']} ways over NVLink (dp {p.dp} -> {patch['parallel.dp']}): "
                    f"{_gib(e.memory.total)}{'' if c.fits(e) else ' (still over)'}."), False)
    elif m.num_experts:
        c.rejected.append("tp: on a MoE model the TP plan splits attention only (experts are replicated over tp); "
                          "shard the experts with ep instead")
    else:
        c.rejected.append(f"tp: already {p.tp} = GPUs per node; TP across nodes is ~43% slower (Playbook)")
    if h.nodes > 1:
        patches = []
        for pp in _divisors(m.n_layers):
            if pp <= p.pp or (p.dp * p.pp) % pp:
                continue
            dp = p.dp * p.pp // pp
            mb = cfg.train.micro_batch
            if dp < 1 or cfg.train.global_batch % (dp * mb) or cfg.train.global_batch // (dp * mb) < pp:
                continue
            patches.append({"parallel.pp": pp, "parallel.dp": dp, "parallel.pp_schedule": "1f1b",
                            "parallel.pp_virtual": 1})
        got = c.first_fit("pp", patches)
        if got is not None:
            patch, e = got
            return ("pp", patch, e, (f"{head}, with TP at node size. Pipeline parallel across the {h.nodes} nodes "
                    f"splits the layers into {patch['parallel.pp']} stages (1F1B; dp {p.dp} -> "
                    f"{patch['parallel.dp']}): {_gib(e.memory.total)}{'' if c.fits(e) else ' (still over)'}."), False)
    else:
        c.rejected.append("pp: one node; PP's bubble is rarely worth it where NVLink carries TP + FSDP")
    if cfg.world_size < avail:
        sizes = [d for d in _dp_sizes(cfg, avail // (p.tp * p.pp * p.cp)) if d > p.dp]
        if sizes:
            got = c.first_fit("dp", [{"parallel.dp": d} for d in sorted(sizes)])
            if got is not None:
                patch, e = got
                return ("dp", patch, e, (f"{head}. {avail - cfg.world_size} devices are idle: more data-parallel "
                        f"ranks shrink the ZeRO shards: {_gib(e.memory.total)}"
                        f"{'' if c.fits(e) else ' (still over)'}."), False)
    return ("none", {}, None, (f"{head}. Every rung this hardware allows is in place (ZeRO-3, full recompute, "
            f"TP {p.tp}, PP {p.pp}): the only answer is more GPUs (or a smaller micro-batch / model)."), True)


def _slow(c: _Ctx) -> tuple[Primitive, dict[str, Any], Estimate | None, str, bool]:
    cfg, p, h = c.cfg, c.cfg.parallel, c.cfg.hardware
    st = c.est.step_time
    comm = {}
    for item in c.est.communication:
        comm[item.primitive] = comm.get(item.primitive, 0.0) + item.exposed_s
    worst = max(comm, key=comm.get) if comm else None
    head = (f"estimated step {st.total_s:.3g} s: compute {st.compute_s:.3g} s, bubble {st.bubble_s:.3g} s, exposed "
            f"communication {st.comm_exposed_s:.3g} s ({st.comm_fraction:.0%}"
            + (f", mostly {worst} {comm[worst]:.3g} s" if worst else "") + ")")
    comm_bound = st.comm_fraction > 0.5 or (st.comm_exposed_s > 0.25 * st.total_s and c.symptom_given)
    m = cfg.model
    if m.num_experts and p.ep == 1 and p.dp > 1:
        best = None
        for e in [e for e in _divisors(m.num_experts) if e > 1 and p.dp % e == 0]:
            _, est, _ = _try(cfg, {"parallel.ep": e}, c.hardware, c.probe)
            if est is not None and est.memory.total <= c.est.usable_bytes and (
                    best is None or est.step_time.total_s < best[1].step_time.total_s):
                best = ({"parallel.ep": e}, est)
        if best is not None and best[1].step_time.total_s < st.total_s:
            return ("ep", best[0], best[1], (f"{head}. A mixture of experts at scale: expert parallel trades the "
                    f"all-gather of every expert for two all-to-alls of the routed tokens: "
                    f"{best[1].step_time.total_s:.3g} s per step."), False)
    if comm_bound and h.nodes > 1 and cfg.world_size > h.gpus_per_node:
        best = None
        for pp in _divisors(m.n_layers):
            if pp <= p.pp or (p.dp * p.pp) % pp:
                continue
            dp = p.dp * p.pp // pp
            mb = cfg.train.micro_batch
            if cfg.train.global_batch % (dp * mb) or cfg.train.global_batch // (dp * mb) < pp:
                continue
            patch = {"parallel.pp": pp, "parallel.dp": dp, "parallel.pp_schedule": "1f1b", "parallel.pp_virtual": 1}
            _, est, _ = _try(cfg, patch, c.hardware, c.probe)
            if est is None or est.memory.total > c.est.usable_bytes:
                continue
            if best is None or est.step_time.total_s < best[1].step_time.total_s:
                best = (patch, est)
        if best is not None and best[1].step_time.total_s < st.total_s:
            return ("pp", best[0], best[1], (f"{head}: communication-bound across {h.nodes} nodes. Pipeline "
                    f"parallel in {best[0]['parallel.pp']} stages sends only activations between nodes and keeps "
                    f"the gradient reduction to dp {best[0]['parallel.dp']} ranks: {best[1].step_time.total_s:.3g} "
                    f"s per step (bubble {best[1].step_time.bubble_s:.3g} s)."), False)
        c.rejected.append("pp: no pipeline split both fits and is faster")
    elif comm_bound:
        c.rejected.append("pp: one node (or one node's worth of ranks); PP inside NVLink rarely pays")
    avail = h.gpus_per_node * h.nodes
    if cfg.world_size < avail:
        sizes = [d for d in _dp_sizes(cfg, avail // (p.tp * p.pp * p.cp)) if d > p.dp]
        if sizes:
            d = sizes[0]
            _new, est, _why = _try(cfg, {"parallel.dp": d}, c.hardware, c.probe)
            if est is not None:
                return ("dp", {"parallel.dp": d}, est, (f"{head}; {avail - cfg.world_size} devices are idle: "
                        f"dp {p.dp} -> {d} ({est.step_time.tokens_per_s:.3g} tokens/s)."), False)
    if comm_bound:
        return ("none", {}, None, (f"{head}. No rung on this hardware hides it; more (or faster-linked) GPUs, "
                "or a larger micro-batch to amortise the collectives."), True)
    return ("none", {}, None, f"{head}: compute-bound; more data-parallel ranks (more GPUs) is the lever.", True)


# ----------------------------------------------------------------------------------------------- API


def recommend_next(config: str | Path | dict[str, Any] | Config, symptom: Symptom | None = None,
                   overrides: dict[str, Any] | None = None, *, hardware: str | None = None,
                   probe: dict[str, Any] | None = None, measured_peak_bytes: int | None = None,
                   root: str | Path | None = None) -> Recommendation:
    """The next primitive for `config` (a name in configs/, a YAML path, a dict or a Config) with dotted
    `overrides`, given `symptom` ("oom", "slow", "none"; derived from the estimate when absent)."""
    cfg = load_any(config, overrides, root=root)
    est = estimate(cfg, hardware=hardware, probe=probe)
    usable = est.usable_bytes
    given = symptom is not None
    if symptom is None:
        symptom = "oom" if est.memory.total > usable else ("slow" if est.step_time.comm_bound else "none")
    target = usable
    if symptom == "oom" and est.memory.total <= usable:
        excess = (measured_peak_bytes - usable) if measured_peak_bytes else 1
        target = max(0, est.memory.total - max(excess, 1))
    c = _Ctx(cfg, est, target, hardware, probe, given)
    if symptom == "oom":
        primitive, patch, after, reason, more = _oom(c)
    elif symptom == "slow":
        primitive, patch, after, reason, more = _slow(c)
    else:
        st = est.step_time
        primitive, patch, after, more = "none", {}, None, False
        reason = (f"estimated peak {_gib(est.memory.total)} fits ({_budget(est)}, headroom "
                  f"{_gib(est.headroom_bytes)}); exposed communication is {st.comm_fraction:.0%} of a "
                  f"{st.total_s:.3g} s step: nothing to add. Bench it to confirm.")
    after = after or est
    name = config if isinstance(config, str) else "<config>"
    all_patch = {**(overrides or {}), **patch}
    validation = None
    if patch:
        validation = Validation(
            config=str(name), overrides=all_patch,
            command=f"curry-train whitebox --config {name} {_set(all_patch, cfg)} --json",
            note="one optimizer step of the new layout against the single-device reference: loss and every "
                 "gradient must match within fp32 noise. A model too big for this machine: check the same "
                 "parallel section on configs/tiny.yaml (the parity does not depend on the size).")
    before_t, after_t = est.step_time.total_s, after.step_time.total_s
    return Recommendation(
        primitive=primitive, symptom=symptom, symptom_source="given" if given else "derived", reason=reason,
        config_patch=patch, memory_before_bytes=est.memory.total, memory_after_bytes=after.memory.total,
        memory_change_pct=round(100.0 * (after.memory.total / est.memory.total - 1), 2) if est.memory.total else 0.0,
        usable_bytes=usable, fits_after=after.memory.total <= usable, step_time_before_s=before_t,
        step_time_after_s=after_t,
        throughput_change_pct=round(100.0 * (before_t / after_t - 1), 2) if after_t > 0 else 0.0,
        more_gpus_needed=more, rejected=c.rejected, validation=validation)
