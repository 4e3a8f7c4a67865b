"""Planted-bug catalogue: one known parallelism bug per entry, planted in the parallel run only.

    curry-train whitebox --list-injections
    curry-train whitebox --config tiny --set parallel.dp=2 --inject data-same-rows      # must FAIL (exit 1)

A white-box check that has never failed proves nothing: each entry below is a bug that real parallel code has
shipped with (a missed reduction, a wrong scale, a skipped optimizer term, a data split that drops half the
batch), and `tests/test_injections.py` requires every one to make the verdict fail and name what it touched.
Every entry is planted inside the rank processes (validation/whitebox.parallel_job), after or around
`train.loop.setup`; the single-device reference (whitebox.reference) never runs any of this code.

How an entry is planted (each entry's `plant` says which):
  model_hook   before parallelize, on the full model of this rank (DDP's ignore list must be set before wrapping);
  after_setup  on the Parallelized result: optimizer param groups, FSDP divide factors, the PP schedule, hooks;
  patches      module attributes replaced for the duration of the rank job and restored after it, so batched test
               jobs (whitebox.whitebox_batch runs several specs in one process) never see another job's bug.

This module imports no torch at import time: the CLI's --list-injections and the MCP server read the catalogue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from curry_train.config import Config
from curry_train.wrapping import (
    data_parallel_wrapper,
    dp_group_size,
    expert_replicas,
    fsdp_replicas,
    shards_optimizer_only,
)


class WhiteboxInputError(ValueError):
    """A white-box request that must not launch (steps < 1, timeout <= 0, a bad injection): exit 2."""


class InjectionError(WhiteboxInputError):
    """An unknown injection name, or one that cannot apply to this layout (nothing is launched)."""


@dataclass(frozen=True)
class Injection:
    name: str
    family: str
    breaks: str  # what goes wrong, in one line
    layout: str  # the natural layout it fails on (overrides on tiny / tiny-moe)
    natural: dict[str, Any]  # those overrides, as a dict (config name in "config")
    # regex over reference parameter names the verdict must name; "rank": replica divergence; "scalar": only a
    # per-rank scalar fails; "grad_norm": only the global grad norm fails (a bf16 bound: no tensor is named)
    touches: str
    needs: Callable[[Config], str | None] = field(repr=False, default=lambda cfg: None)  # why it cannot apply


def _dp_cp(cfg: Config) -> int:
    return dp_group_size(cfg.parallel.dp, cfg.parallel.cp)


def _wrapper(cfg: Config) -> str:
    p = cfg.parallel
    return data_parallel_wrapper(p.dp, p.cp, p.zero, p.tp, cfg.train.dtype)


def _needs_ddp(cfg: Config) -> str | None:
    if _dp_cp(cfg) < 2:
        return f"needs data parallelism (dp*cp > 1; here dp={cfg.parallel.dp} cp={cfg.parallel.cp}): with one " \
               "replica there is no gradient reduction to leave out"
    if _wrapper(cfg) != "ddp":
        return f"plants in DDP's all-reduce, but parallel.zero={cfg.parallel.zero} with " \
               f"train.dtype={cfg.train.dtype} uses FSDP (bf16: every layout, wrapping.py); use zero 0 or 1 in " \
               "float32, or inject fsdp-grad-sum"
    return None


def _needs_zero1(cfg: Config) -> str | None:
    p = cfg.parallel
    if not shards_optimizer_only(p.dp, p.cp, p.zero, p.tp, cfg.train.dtype):
        return f"needs ZeRO-1 on ZeroRedundancyOptimizer (parallel.zero=1 with dp*cp > 1 in float32; here " \
               f"zero={p.zero}, dp*cp={_dp_cp(cfg)}, dtype={cfg.train.dtype}: bf16's ZeRO-1 is FSDP2, wrapping.py)"
    if cfg.train.weight_decay <= 0:
        return "drops weight decay, which is 0 here: set train.weight_decay=0.1 or the bug changes nothing"
    return None


def _needs_fsdp(cfg: Config) -> str | None:
    if _wrapper(cfg) != "fsdp" or _dp_cp(cfg) < 2:
        return f"needs FSDP over more than one rank (parallel.zero >= 2 with dp*cp > 1, or any zero in bfloat16; " \
               f"here zero={cfg.parallel.zero}, dp*cp={_dp_cp(cfg)}, dtype={cfg.train.dtype})"
    return None


def _needs_hsdp(cfg: Config) -> str | None:
    r, z = cfg.parallel.dp_replicate, cfg.parallel.zero
    if r < 2 or _wrapper(cfg) != "fsdp":
        return f"needs HSDP (parallel.dp_replicate > 1 with parallel.zero >= 2; here dp_replicate={r}, zero={z}): " \
               "without replica groups there is no all-reduce across them to skip"
    return None


def _needs_sp(cfg: Config) -> str | None:
    if cfg.parallel.tp < 2 or not cfg.parallel.sp:
        return f"needs sequence parallel (parallel.tp > 1 and parallel.sp=true; here tp={cfg.parallel.tp}, " \
               f"sp={str(cfg.parallel.sp).lower()}): without SP the norm weights see every token on every rank"
    return None


def _needs_pp(cfg: Config) -> str | None:
    if cfg.parallel.pp < 2:
        return f"needs pipeline parallelism (parallel.pp > 1; here pp={cfg.parallel.pp})"
    return None  # config.check already requires >= pp micro-batches, so the missing 1/m is never 1


def _needs_experts(cfg: Config) -> str | None:
    if cfg.model.num_experts == 0:
        return "plants in the expert-gradient reduction, but this model is dense (model.num_experts=0); use a " \
               "MoE config such as tiny-moe with parallel.ep > 1"
    if cfg.parallel.ep < 2:
        return f"needs expert parallelism (parallel.ep > 1; here ep={cfg.parallel.ep})"
    return None


def _needs_ep(cfg: Config) -> str | None:
    if _needs_experts(cfg):
        return _needs_experts(cfg)
    if _wrapper(cfg) != "ddp":
        return f"plants in the DDP expert sync (parallel.zero=0 or 1 with dp*cp > 1); here zero={cfg.parallel.zero}"
    return None


def _needs_ep_hsdp(cfg: Config) -> str | None:
    p = cfg.parallel
    if _needs_hsdp(cfg) or _needs_experts(cfg):
        return _needs_hsdp(cfg) or _needs_experts(cfg)
    if (expert_replicas(p.dp, p.cp, p.ep, p.dp_replicate) or 1) < 2:
        return f"needs expert shards held in more than one HSDP replica group (here dp={p.dp}, ep={p.ep}, " \
               f"dp_replicate={p.dp_replicate}: each expert shard lives in one replica)"
    return None


def _needs_cp(cfg: Config) -> str | None:
    if cfg.parallel.cp < 2:
        return f"needs context parallelism (parallel.cp > 1; here cp={cfg.parallel.cp})"
    return None


def _needs_dp(cfg: Config) -> str | None:
    if cfg.parallel.dp < 2:
        return f"needs data parallelism (parallel.dp > 1; here dp={cfg.parallel.dp}): with one dp rank every " \
               "rank already reads the same rows"
    return None


def _needs_clip(cfg: Config) -> str | None:
    if cfg.train.grad_clip <= 0:
        return "clips gradients, which is off here (train.grad_clip=0): set train.grad_clip=0.5 (tiny's norm is ~1)"
    p = cfg.parallel
    shard = _dp_cp(cfg) // fsdp_replicas(p.dp, p.cp, p.zero, p.tp, cfg.train.dtype, p.dp_replicate)
    if (_wrapper(cfg) != "fsdp" or shard < 2) and p.tp < 2:
        return "needs sharded gradients (FSDP over more than one shard: parallel.zero >= 1 with dp*cp > 1 in " \
               "bfloat16, zero >= 2 in float32; or parallel.tp > 1): with whole gradients on every rank the " \
               "local norm is the global one"
    return None


def _needs_ddp_clip(cfg: Config) -> str | None:
    why = _needs_ddp(cfg)
    if why is None and cfg.train.grad_clip <= 0:
        return "is caught by its 2x update without clipping; set train.grad_clip=0.5 to plant the case the " \
               "clip hides (both ranks clip to the same norm, so their updates agree to rounding)"
    return why


def _needs_warmup(cfg: Config) -> str | None:
    if cfg.train.warmup_steps < 1:
        return "breaks the schedule at the end of the warm-up, which is off here (train.warmup_steps=0): set " \
               "train.warmup_steps=2"
    return None


def _needs_bf16(cfg: Config) -> str | None:
    if cfg.train.dtype != "bfloat16":
        return "breaks the bf16 path, which fp32 never runs (train.dtype=float32): set train.dtype=bfloat16"
    return None


def _needs_replicas_bf16(cfg: Config) -> str | None:
    if _needs_bf16(cfg):
        return _needs_bf16(cfg)
    if _dp_cp(cfg) < 2 or cfg.parallel.zero != 0:
        return f"plants in the all-reduce of bf16's ZeRO-0 replicas (FSDP2 on dp*cp replicas of one shard: " \
               f"parallel.zero=0 with dp*cp > 1; here zero={cfg.parallel.zero}, dp*cp={_dp_cp(cfg)}); with " \
               "sharded units inject fsdp-reduce-bf16"
    return None


def _needs_fsdp_bf16(cfg: Config) -> str | None:
    return _needs_fsdp(cfg) or _needs_bf16(cfg)


def _needs_tp(cfg: Config) -> str | None:
    if cfg.parallel.tp < 2:
        return f"needs tensor parallelism (parallel.tp > 1; here tp={cfg.parallel.tp})"
    return None


def _needs_tp_ep(cfg: Config) -> str | None:
    p = cfg.parallel
    if not cfg.model.num_experts or p.tp < 2 or p.ep < 2:
        return f"needs tensor and expert parallelism on a MoE model (model.num_experts > 0, parallel.tp > 1, " \
               f"parallel.ep > 1; here num_experts={cfg.model.num_experts}, tp={p.tp}, ep={p.ep})"
    return None


def _needs_routed(cfg: Config) -> str | None:
    m = cfg.model
    if not m.num_experts or m.top_k >= m.num_experts:
        return f"needs a routed MoE model (model.num_experts > model.top_k; here num_experts={m.num_experts}, " \
               f"top_k={m.top_k}): use a MoE config such as tiny-moe"
    return None


def _needs_replicas(cfg: Config) -> str | None:
    if cfg.world_size < 2:
        return "needs more than one rank (a different lr on rank 1 needs a rank 1)"
    return None


CATALOGUE: dict[str, Injection] = {i.name: i for i in (
    Injection("ddp-unreduced-grad", "DDP", "one parameter's gradient is left un-reduced across the dp ranks "
              "(a missed DDP hook)", "tiny dp=2", {"config": "tiny", "parallel.dp": 2},
              r"layers\.\d+\.feed_forward\.w1\.weight", _needs_ddp),
    Injection("zero1-no-weight-decay", "ZeRO-1", "the sharded optimizer drops AdamW's weight decay",
              "tiny dp=2 zero=1 weight_decay=0.1",
              {"config": "tiny", "parallel.dp": 2, "parallel.zero": 1, "train.weight_decay": 0.1}, r".", _needs_zero1),
    Injection("fsdp-grad-sum", "FSDP", "gradients are summed over the dp ranks, not averaged", "tiny dp=2 zero=3",
              {"config": "tiny", "parallel.dp": 2, "parallel.zero": 3}, r".", _needs_fsdp),
    Injection("hsdp-no-replica-allreduce", "HSDP", "gradient shards are reduce-scattered inside each shard group "
              "but never all-reduced across the replica groups: each replica steps on its own half of the batch",
              "tiny dp=4 dp_replicate=2 zero=3",
              {"config": "tiny", "parallel.dp": 4, "parallel.dp_replicate": 2, "parallel.zero": 3}, r".",
              _needs_hsdp),
    Injection("tp-sp-norm-unreduced", "TP/SP", "the norm weights' gradients are not summed over the tp ranks "
              "(each rank saw only its T/tp tokens)", "tiny tp=2 sp=true",
              {"config": "tiny", "parallel.tp": 2, "parallel.sp": True}, r"(^|\.)(attention_norm|ffn_norm|norm)\.",
              _needs_sp),
    Injection("pp-unscaled-grads", "PP", "the schedule does not divide the accumulated gradients by the number of "
              "micro-batches", "tiny pp=2", {"config": "tiny", "parallel.pp": 2}, r".", _needs_pp),
    Injection("ep-expert-unreduced", "EP", "expert gradients are neither reduced over the expert-data-parallel "
              "ranks nor divided by dp*cp", "tiny-moe dp=2 ep=2",
              {"config": "tiny-moe", "parallel.dp": 2, "parallel.ep": 2}, r"\.experts\.", _needs_ep),
    Injection("cp-local-lse", "CP", "ring attention's backward uses each rank's block-local log-sum-exp instead of "
              "the final one", "tiny cp=2", {"config": "tiny", "parallel.cp": 2},
              r"(tok_embeddings|attention\.w[qkv]|attention_norm|feed_forward|ffn_norm)", _needs_cp),
    Injection("data-same-rows", "data", "every dp rank reads dp rank 0's rows: half the global batch is never used",
              "tiny dp=2", {"config": "tiny", "parallel.dp": 2}, r".", _needs_dp),
    Injection("replica-lr", "replicas", "ranks other than 0 step with 10x the learning rate, so the replicas drift "
              "apart", "tiny dp=2", {"config": "tiny", "parallel.dp": 2}, "rank", _needs_replicas),
    Injection("zero-grad-noop", "step", "the training step's zero-grad does nothing: each step's gradients add to "
              "the previous steps' (caught from step 1 on: steps >= 2)", "tiny dp=2",
              {"config": "tiny", "parallel.dp": 2}, r"."),
    Injection("rank-grad-1pct", "tensor", "rank 1's attention.wq gradients are 1% too large before the reduction "
              "(0.5% on the reduced wq gradient, nothing else)", "tiny dp=2", {"config": "tiny", "parallel.dp": 2},
              r"attention\.wq", _needs_replicas),
    Injection("unseen-rows-grad", "zeros", "embedding rows no token uses get a 1e-11 gradient instead of 0, so AdamW "
              "moves them ~1e-3*lr a step", "tiny dp=2", {"config": "tiny", "parallel.dp": 2}, r"tok_embeddings"),
    Injection("clip-local-norm-fsdp", "clip", "gradient clipping by each rank's local shard norm, not the global "
              "one (every FSDP shard its own coefficient)", "tiny dp=2 zero=3 grad_clip=0.7",
              {"config": "tiny", "parallel.dp": 2, "parallel.zero": 3, "train.grad_clip": 0.7}, r".", _needs_clip),
    Injection("clip-local-norm-tp", "clip", "gradient clipping by each rank's local TP shard norm: the replicated "
              "norm weights get another coefficient on each tp rank", "tiny tp=2 grad_clip=0.5",
              {"config": "tiny", "parallel.tp": 2, "train.grad_clip": 0.5}, "rank", _needs_clip),
    Injection("ddp-rank-sum", "replicas", "rank 1 steps on the sum of the dp gradients, not their mean (clipping "
              "hides it in the update)", "tiny dp=2 grad_clip=0.5",
              {"config": "tiny", "parallel.dp": 2, "train.grad_clip": 0.5}, "rank", _needs_ddp_clip),
    Injection("lr-warmup-restart", "schedule", "the learning rate restarts its warm-up at the warm-up boundary "
              "(exact before it: caught only when the steps reach it)", "tiny dp=2 warmup_steps=2",
              {"config": "tiny", "parallel.dp": 2, "train.warmup_steps": 2}, r".", _needs_warmup),
    Injection("mid-layer-forward", "forward", "rank 1's middle block returns its output 0.1% too large (the "
              "verdict must point at that block, not at the embedding)", "tiny dp=2",
              {"config": "tiny", "parallel.dp": 2}, r"layers\.2", _needs_replicas),
    Injection("cp-loss-unreduced", "scalar", "the step's loss is averaged over dp only, not dp x cp: each cp rank "
              "reports its own chunks' loss (gradients exact; the verdict must name the rank)", "tiny cp=2",
              {"config": "tiny", "parallel.cp": 2}, "scalar", _needs_cp),
    Injection("replicate-reduce-bf16", "bf16", "the dp replicas all-reduce the gradients in bf16 instead of fp32 "
              "(ZeRO-0's FSDP2 replica units with the policy's reduce_dtype bf16, DDP's bf16_compress_hook)",
              "tiny dp=2 dtype=bfloat16", {"config": "tiny", "parallel.dp": 2, "train.dtype": "bfloat16"}, r".",
              _needs_replicas_bf16),
    Injection("fsdp-reduce-bf16", "bf16", "FSDP reduce-scatters the gradients in bf16 instead of fp32 (the "
              "policy's reduce_dtype)", "tiny dp=2 zero=3 dtype=bfloat16",
              {"config": "tiny", "parallel.dp": 2, "parallel.zero": 3, "train.dtype": "bfloat16"}, r".",
              _needs_fsdp_bf16),
    Injection("tp-partial-sum-1pct", "TP", "rank 1's partial sum of the middle block's attention.wo is 1% too "
              "large before the tp all-reduce (fp32: bf16's bounds resolve tp-partial-sum-2pct)", "tiny tp=2",
              {"config": "tiny", "parallel.tp": 2}, r"layers\.2", _needs_tp),
    Injection("tp-partial-sum-2pct", "bf16", "as tp-partial-sum-1pct, 2% too large: a size bf16's relative bounds "
              "resolve, on the grad norm only, where 1% can pass them (docs/CPU-DISTRIBUTED.md, bf16 relative bounds)",
              "tiny tp=2 dtype=bfloat16", {"config": "tiny", "parallel.tp": 2, "train.dtype": "bfloat16"},
              "grad_norm", _needs_tp),
    Injection("resume-drops-moments", "resume", "on resume one tensor's AdamW moments are not loaded (they restart "
              "at 0; the resumed losses move ~1e-6, under the loss-only check)", "tiny tp=2 resumed from dp=2 "
              "zero=3", {"config": "tiny", "parallel.tp": 2}, r"attention_norm"),
    Injection("resume-step-reset", "resume", "on resume one tensor's AdamW step counter is not restored (it restarts "
              "at 0: the bias correction of a first step)", "tiny tp=2 resumed from dp=2 zero=3",
              {"config": "tiny", "parallel.tp": 2}, r"attention_norm"),
    Injection("tp-ep-router-unreduced", "TP+EP", "the router's gradient is not summed over the tp ranks (each "
              "routed only its T/tp tokens)", "tiny-moe tp=2 sp=true ep=2",
              {"config": "tiny-moe", "parallel.tp": 2, "parallel.sp": True, "parallel.ep": 2}, r"router\.gate",
              _needs_tp_ep),
    Injection("tp-ep-tokens-twice", "TP+EP", "every tp rank dispatches the whole sequence to an EP group that "
              "spans the tp ranks: each token reaches its experts tp times", "tiny-moe tp=2 sp=true ep=2",
              {"config": "tiny-moe", "parallel.tp": 2, "parallel.sp": True, "parallel.ep": 2},
              r"\.(experts|router)\.", _needs_tp_ep),
    Injection("ep-expert-ep-averaged", "EP", "expert gradients are also averaged over the EP group, as if each EP "
              "rank's experts were a replica of the others'", "tiny-moe dp=2 ep=2 zero=1",
              {"config": "tiny-moe", "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1}, r"\.experts\.",
              _needs_experts),
    Injection("hsdp-expert-no-replica-allreduce", "HSDP", "expert gradient shards are never all-reduced across "
              "the HSDP replica groups (the dense ones are): each replica's experts step on its half of the batch",
              "tiny-moe dp=4 ep=2 dp_replicate=2 zero=3",
              {"config": "tiny-moe", "parallel.dp": 4, "parallel.ep": 2, "parallel.dp_replicate": 2,
               "parallel.zero": 3}, r"\.experts\.", _needs_ep_hsdp),
    Injection("route-drops-best", "MoE", "every 8th token's top-k takes the experts ranked 2..K+1, not 1..K (an "
              "off-by-one in the selection): no near tie, so the flip-aware bf16 white-box must fail it, not replay "
              "it", "tiny-moe cp=2 dtype=bfloat16", {"config": "tiny-moe", "parallel.cp": 2, "train.dtype": "bfloat16"},
              r"router", _needs_routed),
)}


def check(name: str, cfg: Config, resume: bool = False) -> Injection:
    """The catalogue entry for `name` if it can apply to `cfg` (`resume`: a resume white-box, which the "resume"
    family needs: they plant in the checkpoint load); raises InjectionError saying why not."""
    if name not in CATALOGUE:
        raise InjectionError(f"unknown injection {name!r}: use one of {', '.join(CATALOGUE)} "
                             "(--list-injections describes them)")
    inj = CATALOGUE[name]
    why = inj.needs(cfg)
    if inj.family == "resume" and not resume:
        why = "plants in the checkpoint load, which a white-box from the seed never runs: add " \
              "--resume-from-layout (whitebox_compare: resume_from_layout), e.g. dp=2,zero=3"
    if why:
        raise InjectionError(f"injection {name!r} ({inj.family}) does not apply to this layout: it {why}. "
                             f"Use its natural layout ({inj.layout}) or pick another injection (--list-injections).")
    return inj


def listing() -> list[dict[str, Any]]:
    """The catalogue as JSON-able rows (CLI --list-injections, docs)."""
    # "available" stays in the rows (CLI and JSON readers key on it): every entry of the catalogue is plantable.
    return [{"name": i.name, "family": i.family, "breaks": i.breaks, "layout": i.layout, "available": True}
            for i in CATALOGUE.values()]
