"""`curry-train estimate | recommend | plan | sweep`: the estimator, the advisor, the planner and the capacity
sweep on the command line (cli.py adds these subcommands through `add_subcommands`).

    curry-train estimate --config llama3-8b --set parallel.zero=0 --json
    curry-train recommend --config llama3-8b --set parallel.zero=0 --json
    curry-train plan --model llama3-70b --gpus-per-node 8 --nodes 4 --gpu-memory-gib 80 --seq-len 4096 --json
    curry-train sweep --config tiny [--measured] --json

Results go to stdout (one JSON object with --json), errors to stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from curry_train.breakdown import CATEGORIES
from curry_train.cli.argtypes import byte_count, float_in, positive_float, positive_int, seconds


def _emit(obj: Any, as_json: bool, human) -> None:
    from curry_train.cli import emit

    emit(obj, as_json, human)


def _gib(n: float) -> str:
    from curry_train.cli.report import human_bytes

    return human_bytes(n)


def human_flops(n: float) -> str:
    from curry_train.cli.report import human_flops as f

    return f(n)


def _count(n: float) -> str:
    from curry_train.cli.report import human_count

    return human_count(n)


def _human_estimate(e: Any) -> str:
    m = e.memory
    lines = [(f"per-rank peak {_gib(m.total)} (pipeline rank {m.pp_rank}, at the {m.phase}) vs usable "
             f"{_gib(e.usable_bytes)}: {'fits' if e.fits else 'OUT OF MEMORY'} (headroom {_gib(e.headroom_bytes)})"),
             # every category with bytes at the peak, so the line adds up to it (PP x FSDP: param_copies are GiBs)
             "  " + "  ".join(f"{k} {_gib(getattr(m, k))}" for k in CATEGORIES
                              if getattr(m, k) or k in ("params", "grads", "optimizer", "activations", "other")),
             (f"  {_count(e.param_count)} params ({_count(e.params_per_rank)} on this rank); "
              f"{human_flops(e.flops_per_token)}/token"),
             (f"  step {e.step_time.total_s:.3g} s on {e.hardware.name}: compute {e.step_time.compute_s:.3g} s, "
              f"bubble {e.step_time.bubble_s:.3g} s, exposed comm {e.step_time.comm_exposed_s:.3g} s; "
              f"MFU {e.step_time.mfu:.1%}, HFU {e.step_time.hfu:.1%}"),
             f"  ({e.step_time.mfu_convention})",
             f"  hardware: {e.hardware_note}",
             f"  dtype policy: {e.dtype_policy}"]
    for c in e.communication:
        lines.append(f"  comm {c.primitive:5s} {c.collective:14s} x{c.calls:<6d} {_gib(c.bytes):>10s} over "
                     f"{c.group_size} ({c.link}): {c.time_s:.3g} s, exposed {c.exposed_s:.3g} s")
    return "\n".join(lines)


def _human_rec(r: Any) -> str:
    lines = [f"next: {r.action} {r.primitive}  {r.config_patch}", f"  {r.reason}",
             (f"  memory {_gib(r.memory_before_bytes)} -> {_gib(r.memory_after_bytes)} ({r.memory_change_pct:+.1f}%), "
             f"throughput {r.throughput_change_pct:+.1f}%, fits after: {r.fits_after}")]
    if r.more_gpus_needed:
        lines.append("  the only answer on this hardware is more GPUs")
    if getattr(r, "one_gpu", None):
        lines += [f"  {x}" for x in r.one_gpu.text]
    if r.validation:
        lines.append(f"  validate: {r.validation.command}")
    lines += [f"  not: {x}" for x in r.rejected[:6]]
    lines += [f"  alternative: {a.text}" for a in r.alternatives[:6]]
    return "\n".join(lines)


def _layout(par: dict[str, Any], mb: int) -> str:
    """Every key that tells two layouts apart: sizes, ZeRO stage (+keep: fsdp_keep_gathered; the reshard policy when
    not default), recompute, schedule, HSDP replicas, micro-batch."""
    pp = f"pp{par['pp']}" + (f"({par['pp_schedule']} v{par['pp_virtual']})" if par["pp"] > 1 else "")
    dp = f"dp{par['dp']}" + (f"(r{par['dp_replicate']})" if par.get("dp_replicate", 1) > 1 else "")
    z = f"z{par['zero']}" + ("+keep" if par.get("fsdp_keep_gathered") else "")  # ZeRO-2 units kept gathered
    z += f"({par['fsdp_reshard']})" if par.get("fsdp_reshard", "default") != "default" else ""
    return (f"{dp} {z} tp{par['tp']}{'+sp' if par.get('sp') else ''} {pp} cp{par['cp']} ep{par['ep']} "
            f"rc:{par['recompute']} mb{mb}")


def _human_plan(p: Any) -> str:
    mb = (f"micro-batch {p.micro_batch}" + (" (searched)" if p.micro_batch_searched else " (kept)"))
    lines = [(f"{p.model} on {p.nodes} x {p.gpus_per_node} GPUs ({p.gpu_memory_gib} GiB, usable {p.usable_gib:.1f} "
             f"GiB), seq {p.seq_len}, global batch {p.global_batch}, {mb}: {'fits' if p.fits else 'does not fit'} "
             f"({p.seconds * 1e3:.0f} ms)")]
    for r in p.rungs:
        last = " <- final" if r is p.rungs[-1] and p.fits else ""
        lines.append(f"  {r.step:2d} {r.primitive:10s} {_layout(r.parallel, r.micro_batch)} "
                     f"{_gib(r.memory_gib['total'] * 2**30):>10s} {'fits' if r.fits else 'OOM '} headroom "
                     f"{r.headroom_gib:.1f} GiB, step {r.step_time_s:.3g} s{last}")
    if getattr(p, "idle_reason", None):
        lines.append(f"  idle GPUs: {p.idle_reason}")
    if getattr(p, "min_nodes_to_fit", None):
        lines.append(f"  more GPUs: a layout fits from {p.min_nodes_to_fit} nodes of {p.gpus_per_node}")
    lines += [f"  hint: {h}" for h in getattr(p, "hints", [])]
    if getattr(p, "one_gpu", None):
        lines += [f"  {x}" for x in p.one_gpu.text]
    lines.append(f"  {p.layouts_valid} valid layouts, {p.layouts_fitting} fit" + ("; fastest:" if p.ranked else ""))
    seen = set()
    for lay in p.ranked[:5]:
        text = (f"     {_layout(lay.parallel, lay.micro_batch)} {_gib(lay.total_gib * 2**30)} (headroom "
                f"{lay.headroom_gib:.1f} GiB), {lay.step_time_s:.3g} s, MFU {lay.mfu:.1%}"
                + (" <- final" if lay.final else ""))
        if text not in seen:  # distinct rows only
            seen.add(text)
            lines.append(text)
    return "\n".join(lines)


def _human_sweep(s: Any, cap: int | None = None) -> str:
    lines = [f"capacity of {s.config} ({s.mode}), usable {_gib(s.usable_bytes)} per rank; largest model at "
             f"micro-batch {s.micro_batch}:"]
    for r in s.rungs:
        mm = r.max_model
        model = (f"d{mm.d_model} x L{mm.n_layers} ({_count(mm.params)} params)" if mm
                 else "none of the family fits")
        if r.max_micro_batch is None:  # SweepRow: None when even one sequence per rank does not fit
            mb = "max micro-batch: none (1 sequence per rank already exceeds the budget)"
        elif cap is not None and r.max_micro_batch >= cap:
            mb = f"max micro-batch >= {r.max_micro_batch} (the --max-micro-batch cap)"
        else:
            mb = f"max micro-batch {r.max_micro_batch}"
        lines.append(f"  {r.rung:18s} {r.world_size:5d} ranks  {mb}  largest model "
                     f"{model}{'  ' + r.note if r.note else ''}")
    if getattr(s, "one_gpu", None):
        lines += [f"  {x}" for x in s.one_gpu.text]
    return "\n".join(lines)


def _invalid(command: str, e: Exception) -> int:
    print(f"curry-train {command}: {e}", file=sys.stderr)
    return 2


def _cmd_estimate(a: argparse.Namespace) -> int:
    from curry_train.cli.report import say
    from curry_train.config import parse_sets
    from curry_train.estimator import estimate_memory
    from curry_train.estimator.profiles import UnknownGpu

    try:
        e = estimate_memory(a.config, parse_sets(a.set), hardware=a.hardware, root=a.root, gpu=a.gpu)
    except UnknownGpu as err:
        return _invalid("estimate", err)
    for w in e.warnings:  # also in the result (its "warnings" field), as the MCP tool returns it
        say(f"curry-train estimate: warning: {w}")
    _emit(e, a.json, _human_estimate)
    return 0


def _cmd_recommend(a: argparse.Namespace) -> int:
    from curry_train.advice.advisor import recommend_next
    from curry_train.cli.report import warn_layout
    from curry_train.config import parse_sets
    from curry_train.estimator.profiles import UnknownGpu, gpu_budget

    sets = parse_sets(a.set)
    try:
        hardware, budget = gpu_budget(a.gpu, None, a.hardware)
    except UnknownGpu as err:
        return _invalid("recommend", err)
    if budget is not None:  # the named GPU's memory is the budget
        sets = {**sets, "hardware.gpu_memory_gib": budget}
    warn_layout("recommend", a.config, sets, a.root)
    r = recommend_next(a.config, a.symptom, sets, hardware=hardware,
                       measured_peak_bytes=a.measured_peak, root=a.root)
    _emit(r, a.json, _human_rec)
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    from curry_train.advice.planner import plan
    from curry_train.estimator.profiles import gpu_budget

    try:
        hardware, budget = gpu_budget(a.gpu, a.gpu_memory_gib, a.hardware)
        p = plan(a.model, a.gpus_per_node, a.nodes, 80.0 if budget is None else budget, a.seq_len, a.global_batch,
                 micro_batch=a.micro_batch, search_micro_batch=a.search_micro_batch, dtype=a.dtype,
                 margin=a.margin, hardware=hardware, top=a.top, root=a.root)
    except ValueError as e:
        if type(e).__name__ == "ConfigError":
            raise
        return _invalid("plan", e)
    _emit(p, a.json, _human_plan)
    return 0


def _cmd_sweep(a: argparse.Namespace) -> int:
    from curry_train.config import parse_sets
    from curry_train.measure.sweep import capacity_sweep

    s = capacity_sweep(a.config, parse_sets(a.set), measured=a.measured, rungs=a.rung or None,
                       max_micro_batch=a.max_micro_batch, launcher=a.launcher, timeout=a.timeout,
                       progress=(lambda msg: print(msg, file=sys.stderr, flush=True)), root=a.root)
    _emit(s, a.json, lambda x: _human_sweep(x, a.max_micro_batch))
    return 0


def add_subcommands(subparsers: Any) -> None:
    """Register estimate, recommend, plan and sweep on the curry-train parser."""
    from curry_train.cli import add_config_args, add_root_json
    from curry_train.cli.argtypes import int_at_least

    int_at_least_2 = int_at_least(2)  # config.py: train.seq_len >= 2

    from curry_train.estimator import GPU_NAMES

    names = ", ".join(GPU_NAMES)  # estimator/profiles.py: the one list of named profiles
    hw_help = f"hardware profile for the step time only: {names}"
    gpu_help = (f"the accelerator: {names}; sets the memory budget "
                "AND the speed (default: the config's gpu_memory_gib, speed assumed from it and said)")
    p = subparsers.add_parser("estimate", help="per-rank memory, communication, FLOPs and step time (no run)")
    add_config_args(p)
    p.add_argument("--hardware", default=None, help=hw_help)
    p.add_argument("--gpu", default=None, help=gpu_help)
    p.set_defaults(fn=_cmd_estimate)

    p = subparsers.add_parser("recommend", help="the next parallelism primitive (stage-4 ladder), with numbers")
    add_config_args(p)
    p.add_argument("--symptom", choices=["oom", "slow", "none"], default=None,
                   help="what goes wrong now (default: derived from the estimate)")
    p.add_argument("--measured-peak", type=byte_count, default=None, metavar="BYTES",
                   help="a measured per-rank peak (bench): sizes the reduction an OOM needs")
    p.add_argument("--hardware", default=None, help=hw_help)
    p.add_argument("--gpu", default=None, help=gpu_help)
    p.set_defaults(fn=_cmd_recommend)

    p = subparsers.add_parser("plan", help="climb the ladder for a model on a cluster and rank every layout")
    p.add_argument("--model", required=True, help="config name in configs/ (its model section) or a YAML path")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="accelerators per node")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes in the cluster")
    p.add_argument("--gpu-memory-gib", type=positive_float, default=None,
                   help="memory per accelerator, GiB (default: the --gpu's memory, else 80)")
    p.add_argument("--seq-len", type=int_at_least_2, default=None, help="tokens per sequence (default: the config's)")
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="sequences per step (default: the config's)")
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="sequences per rank per forward, kept on every layout (default: searched)")
    p.add_argument("--search-micro-batch", action=argparse.BooleanOptionalAction, default=None,
                   help="search the micro-batch (default: only when --micro-batch is not given)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    p.add_argument("--margin", type=float_in(0.0, 1.0, lo_open=False), default=0.0,
                   help="extra fraction of usable memory to keep free, in [0, 1)")
    p.add_argument("--top", type=positive_int, default=10, help="how many ranked layouts to return")
    p.add_argument("--hardware", default=None, help=hw_help)
    p.add_argument("--gpu", default=None, help=gpu_help)
    add_root_json(p)
    p.set_defaults(fn=_cmd_plan)

    p = subparsers.add_parser("sweep", help="largest micro-batch and model under each ladder rung")
    add_config_args(p)
    p.add_argument("--measured", action="store_true", help="binary-search with real runs on this machine")
    p.add_argument("--rung", action="append", default=[], help="only these rungs (repeatable), e.g. zero3")
    p.add_argument("--max-micro-batch", type=positive_int, default=4096, help="upper end of the micro-batch search")
    p.add_argument("--launcher", choices=["forkserver", "torchrun"], default="forkserver",
                   help="how --measured starts its ranks")
    p.add_argument("--timeout", type=seconds, default=600.0, help="seconds per measured run")
    p.set_defaults(fn=_cmd_sweep)
