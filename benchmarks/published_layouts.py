"""Published training setups as a benchmark for `plan`: does it pick what the people who trained these models
picked, and does the estimator agree with their measured memory?

    .venv/bin/python benchmarks/published_layouts.py            # a table, then one JSON line (the worst of each)
    .venv/bin/python benchmarks/published_layouts.py --json     # only the JSON line

Setups (each preset's comment gives its source; published-layout rows are the papers' own layouts):
  megatron-1.7b ... megatron-1t   Narayanan et al. 2021 (arXiv:2104.04473) Table 1, A100 80 GB
  bloom-176b                      BigScience tr11 (TP 4 x PP 12 x DP 8 on 384 A100 80 GB; 70 layers over 12
                                  stages: uneven, split by cost as pipeline_split.py does)
  opt-175b                        Zhang et al. 2022 (arXiv:2205.01068): FSDP x TP 8 on 992 A100 80 GB
  mt-nlg-530b                     Smith et al. 2022 (arXiv:2201.11990): TP 8 x PP 35 x DP 8 on 2,240 A100 80 GB
  deepseek-v3                     DeepSeek-AI 2024 (arXiv:2412.19437 §3.2): PP 16 x EP 64 x DP 128 on 2,048 H800
                                  (ZeRO-1, as published: parallel/zero.py's per-group ZeRO with EP)
  torchtitan rows                 pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B
                                  and 70B on H100 96 GB with their measured peak memory (max over GPUs)
For each: `plan` on the setup's cluster, sequence, batch and micro-batch, and
  gpus          GPUs `final` uses, of the cluster's (final's dp shows HSDP's replica count as dp64(r8))
  final/clean   final's estimated step time over the fastest layout without an anti-pattern (target <= 1.10)
  published     the published layout's rank among the fitting layouts (any ZeRO stage, recompute and schedule of
                its tp x pp x dp) and its step time over #1 (target <= 1.15), where the template can express it
  memory        the estimate of the published layout against the published measurement (target within 15%)
  anti          the anti-patterns of `final` (curry_train.rules.anti_patterns; target none)
  over          ranked rows `plan` lists as fitting that the full estimate of the same layout (`estimate`: every
                pipeline rank, step and init peak) says do not fit (target 0)
The published/#1 target applies to every setup unless a published measurement shows a layout class faster than
the published layout (EXCEPTIONS: its source, the measured ratio and, live, the estimator's ratio: the published
layout's step over the best row of that class). The exception holds only while the estimator's ratio is within
EXCEPTION_TOLERANCE of the measured one; while it holds, the target holds #1 against that class's best row
instead (the measurement vouches for the gap to that class, not for any further gap to #1), so it cannot hide a
regression on either side. The JSON line gives both: `max_published_over_best` (every setup, raw) and
`max_published_over_best_targeted` (the figure the target applies to).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

GiB = 2**30

# name, preset, gpu profile, memory GiB, published (tp, pp, dp) or None, overrides of the preset, measured GiB
SETUPS: list[tuple[str, str, str, float, tuple[int, int, int] | None, dict[str, Any], float | None]] = [
    ("megatron-1.7b", "megatron-1.7b", "A100-80", 80.0, (1, 1, 32), {}, None),
    ("megatron-18b", "megatron-18b", "A100-80", 80.0, (8, 1, 32), {}, None),
    ("megatron-39b", "megatron-39b", "A100-80", 80.0, (8, 2, 32), {}, None),
    ("megatron-146b", "megatron-146b", "A100-80", 80.0, (8, 8, 24), {}, None),
    ("megatron-310b", "megatron-310b", "A100-80", 80.0, (8, 16, 15), {}, None),
    ("megatron-1t", "megatron-1t", "A100-80", 80.0, (8, 64, 6), {}, None),
    ("bloom-176b", "bloom-176b", "A100-80", 80.0, (4, 12, 8), {}, None),  # 70 layers over PP12: uneven stages
    ("opt-175b", "opt-175b", "A100-80", 80.0, (8, 1, 124), {}, None),
    ("mt-nlg-530b", "mt-nlg-530b", "A100-80", 80.0, (8, 35, 8), {}, None),
    # PP16 x EP64 x ZeRO-1 DP on 2,048 H800 (configs/deepseek-v3.yaml)
    ("deepseek-v3", "deepseek-v3", "H800", 80.0, (1, 16, 128), {}, None),
    # torchtitan: H100 with 96 GB HBM (about 94 GiB usable as the device total); H100 speed
    ("titan-8b-fsdp8", "llama3-8b", "H100", 94.0, (1, 1, 8),
     {"train.seq_len": 8192, "train.global_batch": 16, "train.micro_batch": 2, "parallel.dp": 8,
      "parallel.zero": 3, "parallel.tp": 1, "parallel.sp": False, "parallel.recompute": "selective",
      "hardware.nodes": 1}, 82.4),
    ("titan-8b-fsdp128", "llama3-8b", "H100", 94.0, (1, 1, 128),
     {"train.seq_len": 8192, "train.global_batch": 256, "train.micro_batch": 2, "parallel.dp": 128,
      "parallel.zero": 3, "parallel.tp": 1, "parallel.sp": False, "parallel.recompute": "selective",
      "hardware.nodes": 16}, 67.0),
    ("titan-70b-fsdp32-tp8", "llama3-70b", "H100", 94.0, (8, 1, 32),
     {"train.seq_len": 8192, "train.global_batch": 512, "train.micro_batch": 16, "parallel.dp": 32,
      "parallel.zero": 3, "parallel.tp": 8, "parallel.sp": True, "parallel.recompute": "full",
      "hardware.nodes": 32}, 71.9),  # Float8 + torch.compile in the source: indicative
]


# Setups whose published layout a published measurement shows slower than a layout of #1's class:
# setup -> (#1's class, the measured row of published_throughput.py, the published layout's row there, caveats).
# The ratio is measured / published throughput per GPU, read from published_throughput.ROWS (one home).
EXCEPTIONS: dict[str, tuple[str, str, str, str]] = {
    # Zhao et al. 2023 (arXiv:2304.11277) sec. 5.4: FSDP alone (full sharding, prefetch, activation checkpointing,
    # bf16, Adam) at 175B, >173 TFLOP/s per GPU at batch 1 and >186 at batch 2, "linear" from 128 to 512 A100-80
    # GB; OPT-175B (Zhang et al. 2022, sec. 2.4) up to 147 with Megatron TP 8 x FSDP on 992 A100-80 GB. Ratio
    # 1.18 at batch 1 (1.27 at batch 2). Comparable: the GPU, the size, recompute, and batch 1 is OPT's tokens per
    # GPU per step (992 sequences of 2048 over 992 GPUs). Caveats: minGPT's 175B (GeLU MLP, vocab 50,000) in a
    # benchmark run, not OPT's production run with its data pipeline; a different cluster (2 Tb/s RoCE per node)
    # and software generation (PyTorch FSDP 2023 vs FairScale FSDP + Megatron TP); 512 GPUs, not 992 (linear
    # scaling to 992 is extrapolated); neither paper states its FLOPs formula (Zhao's "55%" of 312 reads as
    # hardware FLOPs, recompute counted; OPT's as Megatron's). So the exception uses batch 1, the closer of the two.
    "opt-175b": ("fsdp", "fsdp-175b-512-mb1", "opt-175b",
                 "Zhao et al. 2023 (arXiv:2304.11277) sec. 5.4 vs Zhang et al. 2022 (arXiv:2205.01068) sec. 2.4"),
    # The same measurement against Megatron's 18.4B row (Narayanan et al. 2021, Table 1: TP 8 x DP 32 on 256
    # A100-80 GB, full recompute, 135 TFLOP/s per GPU in Eq. 3): ratio 173 / 135 = 1.28. The estimator puts the
    # published TP 8 layout at 1.21x FSDP alone over 256 ranks at each one's best (1.23x with both at full
    # recompute, as both runs were measured). The measurement is at 175B, not 18B; the estimator's own terms say
    # why it bounds FSDP alone at 18B from below (tests/test_published_layouts.py holds them): FSDP's gathers and
    # FLOPs both scale with the parameters, so what sets their ratio is the tokens a rank computes per gather:
    # 8,192 at 18B (its whole per-rank batch of 4 sequences in one micro-batch, or ZeRO-2 kept gathered) against
    # 2,048 at 175B batch 1, so the exposed communication is 2-3% of the step against 9%, and the un-split GEMMs
    # (h 6,144) run within 3% of 175B's (h 12,288): FSDP alone at 18B is estimated at 170 TFLOP/s per GPU
    # (full recompute, Eq. 3) against 162 at 175B. TP 8 instead splits every GEMM 8 ways (widths 768 and 2,048)
    # and exposes its all-reduces (1.5 s, 16% of its step; the row is within 2% of Megatron's 135). At batch 1
    # with ZeRO-3 re-gathering per micro-batch the 18B row would be 149, below 175B's: the bound needs the
    # per-rank batch in one gather, which fits (under 10 GiB with ZeRO-3). Caveats: the model size differs; 2021
    # Megatron (no fused attention kernel) vs 2023 PyTorch FSDP; a different cluster (Selene's 8 x 200 Gb/s
    # HDR InfiniBand per node vs 2 Tb/s RoCE); neither states every kernel it used. Corroboration, not a row
    # here (the estimator is 20-29% below that stack, a calibration question): MosaicML's llm-foundry measured
    # FSDP alone (FULL_SHARD, activation checkpointing) on 128 A100-40 GB at 69.2% HFU for MPT-13B and 69.7%
    # for MPT-30B (scripts/train/benchmarking/README.md), about 216 TFLOP/s per GPU with recompute counted,
    # 1.6x Megatron's 18B row, on both sides of 18B.
    "megatron-18b": ("fsdp", "fsdp-175b-512-mb1", "megatron-18b",
                     "Zhao et al. 2023 (arXiv:2304.11277) sec. 5.4 vs Narayanan et al. 2021 (arXiv:2104.04473) "
                     "Table 1"),
}
EXCEPTION_TOLERANCE = 0.10  # the estimator's ratio within 10% of the measured one


def layout_class(par: dict[str, Any]) -> str:
    """The kind of layout a row is: FSDP (or DDP) alone, or the model-parallel primitives it adds."""
    extra = [k for k in ("tp", "pp", "cp", "ep") if par.get(k, 1) > 1]
    return "+".join(extra) if extra else "fsdp"


def measured_ratio(setup: str) -> float | None:
    """The published measurement's throughput over the published layout's (published_throughput.ROWS)."""
    if setup not in EXCEPTIONS:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from published_throughput import ROWS

    figures = {r[0]: r[4] for r in ROWS}
    _cls, faster, published, _src = EXCEPTIONS[setup]
    return figures[faster] / figures[published]


def exception_holds(r: dict[str, Any]) -> bool:
    """Whether the setup's exception holds: a measured ratio, a ranked row of its class, and the estimator's ratio
    (published step over that class's best row) within EXCEPTION_TOLERANCE of the measured ratio."""
    ratio, est = r.get("measured_ratio"), r.get("estimated_ratio")
    return ratio is not None and est is not None and abs(est / ratio - 1) <= EXCEPTION_TOLERANCE


def targeted(r: dict[str, Any]) -> float | None:
    """The figure the published/#1 target holds: published over #1, or where the exception holds, the measured
    class's best row over #1."""
    return r.get("class_best_over_best") if exception_holds(r) else r.get("published_over_best")


def _shape(par: dict[str, Any]) -> tuple[int, int, int, int]:
    return par.get("tp", 1), par.get("pp", 1), par.get("dp", 1), par.get("cp", 1)


def _anti(cfg_dict: dict[str, Any], par: dict[str, Any], row: Any) -> list[str]:
    """A row's anti-patterns: its own field when the planner gives one, else the rule set on its config."""
    if row is not None and getattr(row, "anti_patterns", None) is not None:
        return [getattr(a, "id", str(a)) if not isinstance(a, dict) else a.get("id", str(a))
                for a in row.anti_patterns]
    from curry_train.config import from_dict
    from curry_train.rules import anti_patterns

    raw = {**cfg_dict, "parallel": {**cfg_dict["parallel"], **par}}
    return [a.id for a in anti_patterns(from_dict(raw, validate=False))]


def run_one(name: str, preset: str, gpu: str, mem: float, published: tuple[int, int, int] | None,
            overrides: dict[str, Any], measured: float | None) -> dict[str, Any]:
    from curry_train.advice.planner import plan
    from curry_train.estimator import estimate, load_any

    cfg = load_any(preset, overrides)
    h, t = cfg.hardware, cfg.train
    world = h.gpus_per_node * h.nodes
    kw: dict[str, Any] = {"micro_batch": t.micro_batch, "hardware": gpu, "top": 100_000}
    if "gpu" in inspect.signature(plan).parameters:
        kw["gpu"] = gpu
    if "search_micro_batch" in inspect.signature(plan).parameters:
        kw["search_micro_batch"] = True  # the papers' micro-batch is where the search starts, as it always was
    t0 = time.perf_counter()
    p = plan(preset, h.gpus_per_node, h.nodes, mem, t.seq_len, t.global_batch, **kw)
    seconds = time.perf_counter() - t0
    base = {**cfg.to_dict(), "hardware": {**cfg.to_dict()["hardware"], "gpu_memory_gib": mem}}
    rows = p.ranked
    final = p.final
    used = final.get("dp", 1) * final.get("tp", 1) * final.get("pp", 1) * final.get("cp", 1)
    f_row = next((r for r in rows if r.parallel == final), None)
    f_step = f_row.step_time_s if f_row is not None else p.rungs[-1].step_time_s
    clean = [r for r in rows if not _anti(base, r.parallel, r)]
    best_clean = min((r.step_time_s for r in clean), default=None)
    planned = {**base, "hardware": {**base["hardware"], "gpu_memory_gib": p.gpu_memory_gib}}  # plan's budget
    over = sum(not estimate(load_any(_row_config(planned, r))).fits for r in rows)
    out: dict[str, Any] = {
        "setup": name, "gpus": world, "gpus_used": used, "idle_reason": getattr(p, "idle_reason", None),
        "fits": p.fits, "final": {k: final.get(k) for k in ("dp", "zero", "tp", "pp", "cp", "pp_schedule",
                                                           "recompute", "dp_replicate")},
        "final_step_s": f_step, "best_clean_step_s": best_clean,
        "final_over_clean": f_step / best_clean if best_clean else None,
        "final_anti_patterns": _anti(base, final, f_row), "layouts_fitting": p.layouts_fitting,
        "plan_seconds": seconds, "rows_over": over, "rows": len(rows)}
    if published is None:
        out["published"] = "not expressible"
    else:
        tp, pp, dp = published
        rank = next((i for i, r in enumerate(rows) if _shape(r.parallel) == (tp, pp, dp, 1)), None)
        out["published_rank"] = None if rank is None else rank + 1
        out["published_over_best"] = None if rank is None or not rows else rows[rank].step_time_s / rows[0].step_time_s
        out["best_class"] = layout_class(rows[0].parallel) if rows else None
        out["measured_ratio"] = measured_ratio(name)
        cls = EXCEPTIONS[name][0] if name in EXCEPTIONS else None
        of_class = [r.step_time_s for r in rows if cls and layout_class(r.parallel) == cls]
        if rank is not None and of_class:
            out["estimated_ratio"] = rows[rank].step_time_s / min(of_class)
            out["class_best_over_best"] = min(of_class) / rows[0].step_time_s
    if measured is not None:
        e = estimate(load_any(base))
        est = e.memory.total / GiB
        out["memory_estimated_gib"] = est
        out["memory_measured_gib"] = measured
        out["memory_error"] = (est - measured) / measured
    return out


def _row_config(base: dict[str, Any], row: Any) -> dict[str, Any]:
    """The config of one ranked row: the setup's, with the row's parallel section and micro-batch."""
    return {**base, "parallel": dict(row.parallel), "train": {**base["train"], "micro_batch": row.micro_batch}}


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the final JSON line")
    a = ap.parse_args(argv)
    rows = [run_one(*s) for s in SETUPS]
    if not a.json:
        print(f"{'setup':22s}{'gpus used':>12s}  {'final':34s}{'step s':>9s}{'/clean':>8s}{'pub rank':>9s}"
              f"{'pub/#1':>8s}{'mem est/meas GiB':>18s}{'plan s':>8s}{'over':>10s}  anti-patterns")
        for r in rows:
            f = r["final"]
            hsdp = f"(r{f['dp_replicate']})" if (f.get("dp_replicate") or 1) > 1 else ""
            lay = (f"dp{f['dp']}{hsdp} z{f['zero']} tp{f['tp']} pp{f['pp']} cp{f['cp']} "
                   f"{f['pp_schedule'] if f['pp'] and f['pp'] > 1 else ''} {f['recompute']}")
            mem = (f"{r['memory_estimated_gib']:.1f}/{r['memory_measured_gib']:.1f}" if "memory_error" in r else "-")
            rank = r.get("published_rank", "n/e" if "published" in r else None)
            print(f"{r['setup']:22s}{r['gpus_used']:>6d}/{r['gpus']:<5d}  {lay:34s}{_fmt(r['final_step_s'], '.3g'):>9s}"
                  f"{_fmt(r['final_over_clean']):>8s}{str(rank if rank is not None else 'absent'):>9s}"
                  f"{_fmt(r.get('published_over_best')):>8s}{mem:>18s}{r['plan_seconds']:>8.2f}"
                  f"{str(r['rows_over']) + '/' + str(r['rows']):>10s}  "
                  f"{', '.join(r['final_anti_patterns']) or '-'}"
                  + (f"  idle: {r['idle_reason']}" if r.get("idle_reason") else ""))
    ratios = [r["final_over_clean"] for r in rows if r["final_over_clean"] is not None]
    pubs = [r["published_over_best"] for r in rows if r.get("published_over_best") is not None]
    held = [targeted(r) for r in rows if targeted(r) is not None]
    if not a.json:
        for r in rows:
            if r.get("measured_ratio") is not None:
                cls, src = EXCEPTIONS[r["setup"]][0], EXCEPTIONS[r["setup"]][3]
                print(f"exception {r['setup']}: published over the best {cls} row, measured {r['measured_ratio']:.3f} "
                      f"({src}), estimated {_fmt(r.get('estimated_ratio'), '.3f')}: "
                      + (f"holds; #1 ({r['best_class']}) over the best {cls} row "
                         f"{_fmt(r.get('class_best_over_best'), '.3f')} is held to the target" if exception_holds(r)
                         else f"does not hold (outside {EXCEPTION_TOLERANCE:.0%}): published/#1 is held"))
    mems = [abs(r["memory_error"]) for r in rows if "memory_error" in r]
    worst = {
        "benchmark": "published_layouts",
        "min_gpus_used_fraction": round(min(r["gpus_used"] / r["gpus"] for r in rows), 4),
        "setups_with_idle_gpus_and_no_reason": sum(r["gpus_used"] < r["gpus"] and not r["idle_reason"] for r in rows),
        "max_final_over_best_clean": round(max(ratios), 4) if ratios else None,
        "max_published_over_best": round(max(pubs), 4) if pubs else None,
        "max_published_over_best_targeted": round(max(held), 4) if held else None,
        "published_exceptions": [r["setup"] for r in rows if exception_holds(r)],
        "published_absent": [r["setup"] for r in rows if r.get("published_rank", 0) is None],
        "not_expressible": [r["setup"] for r in rows if "published" in r],
        "max_memory_error": round(max(mems), 4) if mems else None,
        "final_anti_patterns": sum(len(r["final_anti_patterns"]) for r in rows),
        "max_plan_seconds": round(max(r["plan_seconds"] for r in rows), 3),
        "rows_fitting_but_over": sum(r["rows_over"] for r in rows),
        "setups": len(rows),
    }
    print(json.dumps(worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
