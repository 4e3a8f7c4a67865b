"""Every number the estimator gives over a wide set of layouts, as exact float reprs: a refactor of the estimator
that means no change must leave the dump byte-identical.

    .venv/bin/python benchmarks/estimator_golden.py /tmp/golden_before.json
    ... refactor ...
    .venv/bin/python benchmarks/estimator_golden.py /tmp/golden_after.json && cmp /tmp/golden_{before,after}.json

Recorded (json writes floats with repr, so equal files mean bit-equal numbers):
  presets      `estimate` of every configs/*.yaml: memory per category on every pipeline rank, the totals, init
               peak, fits, FLOPs, every collective and every step-time term
  grid         `estimate` of tiny (and its MoE variant) over pipeline schedules, virtual stages, ZeRO stages,
               recompute modes, dtypes, TP/SP, CP, EP, HSDP and both devices
  published    for every setup of benchmarks/published_layouts.py: every layout the planner's search evaluates
               (its layout fields, the need it reads and the step time with its terms), the `plan` result (ranked
               rows and final; wall time dropped) and the full `estimate` of every ranked row
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# the layout's fields under their earlier short names, so that dumps before and after the rename compare
_OLD_NAMES = {"V": "vocab_size", "D": "d_model", "L": "n_layers", "H": "n_heads", "G": "n_kv_heads", "F": "d_ff",
              "E": "num_experts", "K": "top_k", "cf": "capacity_factor", "s": "seq_len", "gb": "global_batch",
              "b": "micro_batch", "schedule": "pp_schedule", "v": "pp_virtual", "gpn": "gpus_per_node",
              "budget_gib": "gpu_memory_gib", "has_z": "has_z_loss", "has_aux": "has_aux_loss", "dpr": "dp_replicate",
              "lc": "loss_chunks"}


def _layout_dict(x: Any) -> dict[str, Any]:
    return {_OLD_NAMES.get(f.name, f.name): getattr(x, f.name) for f in dataclasses.fields(x)}


def _estimate(cfg: Any) -> dict[str, Any]:
    from curry_train.estimator import estimate

    try:
        return estimate(cfg).model_dump()
    except Exception as e:  # noqa: BLE001 - a failure is a recorded output too
        return {"error": f"{type(e).__name__}: {e}"}


def presets() -> dict[str, Any]:
    from curry_train.estimator import load_any

    out = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        out[path.stem] = _estimate(load_any(path.stem))
    return out


def _grid_cases() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    scheds = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zero_bubble", 3)]
    for (sched, v), pp, zero, rc, dtype, dev in itertools.product(
            scheds, (1, 2, 4), (0, 1, 2, 3), ("none", "selective", "full"), ("float32", "bfloat16"),
            ("cpu", "cuda")):
        if pp == 1 and (sched, v) != ("1f1b", 1):
            continue
        dp = 2
        o = {"parallel.pp": pp, "parallel.pp_schedule": sched, "parallel.pp_virtual": v, "parallel.dp": dp,
             "parallel.zero": zero, "parallel.recompute": rc, "train.dtype": dtype, "hardware.device": dev,
             "train.micro_batch": 1, "train.global_batch": 8 * dp}
        cases.append(("tiny", o))
    for tp, sp, cp, zero, dtype, lc in itertools.product((1, 2), (False, True), (1, 2), (0, 2, 3),
                                                        ("float32", "bfloat16"), (0, 1, 4)):
        if sp and tp == 1:
            continue
        o = {"parallel.tp": tp, "parallel.sp": sp, "parallel.cp": cp, "parallel.dp": 2, "parallel.zero": zero,
             "train.dtype": dtype, "train.loss_chunks": lc, "train.global_batch": 8}
        cases.append(("tiny", o))
    for dpr, zero in itertools.product((1, 2), (2, 3)):
        cases.append(("tiny", {"parallel.dp": 4, "parallel.zero": zero, "parallel.dp_replicate": dpr,
                               "train.global_batch": 8}))
    moe = {"model.num_experts": 4, "model.top_k": 2}
    for ep, zero, cf, dtype, pp in itertools.product((1, 2), (0, 1, 2, 3), (0.0, 1.25), ("float32", "bfloat16"),
                                                     (1, 2)):
        o = {**moe, "parallel.dp": 2, "parallel.ep": ep, "parallel.zero": zero, "model.capacity_factor": cf,
             "train.dtype": dtype, "parallel.pp": pp, "train.global_batch": 8, "train.micro_batch": 1}
        cases.append(("tiny", o))
    for pp, sched, v in ((4, "1f1b", 1), (8, "interleaved_1f1b", 2), (4, "zero_bubble", 2), (8, "gpipe", 1)):
        for zero in (1, 3):
            cases.append(("llama3-8b", {"parallel.dp": 8, "parallel.pp": pp, "parallel.pp_schedule": sched,
                                        "parallel.pp_virtual": v, "parallel.zero": zero, "parallel.tp": 1,
                                        "parallel.sp": False, "hardware.nodes": 8, "train.global_batch": 256}))
    return cases


def grid() -> dict[str, Any]:
    from curry_train.estimator import load_any

    out = {}
    for name, o in _grid_cases():
        key = name + " " + json.dumps(o, sort_keys=True)
        try:
            cfg = load_any(name, o)
        except Exception as e:  # noqa: BLE001 - an invalid case is recorded as such
            out[key] = {"invalid": type(e).__name__}
            continue
        out[key] = _estimate(cfg)
    return out


def published() -> dict[str, Any]:
    import curry_train.advice.search as search
    import published_layouts as pl
    from curry_train.advice.planner import plan
    from curry_train.estimator import load_any

    calls: dict[str, Any] = {}
    need0, step0 = search.layout_need, search._step_time

    def need(x: Any, limit: int | None = None) -> int:
        got = need0(x, limit)
        calls.setdefault(json.dumps(_layout_dict(x), sort_keys=True), {})[f"need {limit}"] = got
        return got

    def step(x: Any, hw: Any) -> Any:
        st, items = step0(x, hw)
        calls.setdefault(json.dumps(_layout_dict(x), sort_keys=True), {})[f"step {hw.name}"] = {
            "step": st.model_dump(), "comm": [i.model_dump() for i in items]}
        return st, items

    search.layout_need, search._step_time = need, step
    out: dict[str, Any] = {}
    try:
        for name, preset, gpu, mem, _pub, overrides, _meas in pl.SETUPS:
            calls.clear()
            cfg = load_any(preset, overrides)
            h, t = cfg.hardware, cfg.train
            kw: dict[str, Any] = {"micro_batch": t.micro_batch, "hardware": gpu, "top": 100_000}
            if "gpu" in inspect.signature(plan).parameters:
                kw["gpu"] = gpu
            if "search_micro_batch" in inspect.signature(plan).parameters:
                kw["search_micro_batch"] = True
            p = plan(preset, h.gpus_per_node, h.nodes, mem, t.seq_len, t.global_batch, **kw)
            dump = p.model_dump()
            dump.pop("seconds", None)
            base = {**cfg.to_dict(), "hardware": {**cfg.to_dict()["hardware"], "gpu_memory_gib": p.gpu_memory_gib}}
            rows = [_estimate(load_any(pl._row_config(base, r))) for r in p.ranked]
            out[name] = {"plan": dump, "row_estimates": rows, "evaluated": dict(sorted(calls.items()))}
    finally:
        search.layout_need, search._step_time = need0, step0
    return out


def main(argv: list[str]) -> int:
    dest = Path(argv[0] if argv else "/tmp/estimator_golden.json")
    data = {"presets": presets(), "grid": grid(), "published": published()}
    dest.write_text(json.dumps(data, sort_keys=True, indent=0))
    n_eval = sum(len(v["evaluated"]) for v in data["published"].values())
    print(f"{dest}: {len(data['presets'])} presets, {len(data['grid'])} grid cases, {n_eval} evaluated layouts",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
