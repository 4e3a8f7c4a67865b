"""Planner speed: plan() (the climb plus the ranking of every valid layout) on
  - Llama 3 8B / 70B / 405B on 8 ... 16,384 GPUs (8 per node, 80 GB, 8192-token sequences, the preset's global
    batch or one sequence per GPU, whichever is larger);
  - every published setup of benchmarks/published_layouts.py on its own cluster, sequence and batch;
  - a 128-layer model (layer counts with many divisors: many pipeline sizes) on 16,384 GPUs (Megatron 1T's
    shape, 2,048 nodes, global batch 16,384).

    .venv/bin/python benchmarks/planner_speed.py          # a table on stderr, then {"max_plan_seconds": ...}

Goal: under one second for every case (pure arithmetic on the estimator's fast path). Wall time: on a shared,
loaded machine it overstates the cost; the "cpu_s" column (process time) does not.
"""

from __future__ import annotations

import json
import sys
import time

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")
GPUS = (8, 64, 512, 4096, 16384)


def _case(label: str, rows: list[dict], model: str, gpn: int, nodes: int, mem: float, seq: int, gb: int,
          mb: int = 1, hardware: str | None = None) -> None:
    from curry_train.advice.planner import plan

    t0, c0 = time.perf_counter(), time.process_time()
    p = plan(model, gpus_per_node=gpn, nodes=nodes, gpu_memory_gib=mem, seq_len=seq, global_batch=gb,
             micro_batch=mb, hardware=hardware)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows.append({"case": label, "seconds": round(dt, 4), "cpu_s": round(cpu, 4), "fits": p.fits,
                 "rungs": [r.primitive for r in p.rungs[1:]], "valid": p.layouts_valid, "fitting": p.layouts_fitting})
    print(f"{label:28s} {gpn * nodes:6d} GPUs  {dt * 1e3:7.1f} ms (cpu {cpu * 1e3:7.1f} ms)  fits={p.fits!s:5s} "
          f"valid={p.layouts_valid} fitting={p.layouts_fitting}", file=sys.stderr)


def main() -> int:
    from curry_train.estimator import load_any

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from published_layouts import SETUPS

    rows: list[dict] = []
    for model in MODELS:
        gb0 = load_any(model).train.global_batch
        for gpus in GPUS:
            _case(f"{model}@{gpus}", rows, model, 8, gpus // 8, 80.0, 8192, max(gb0, gpus))
    for name, preset, gpu, mem, _pub, overrides, _meas in SETUPS:
        cfg = load_any(preset, overrides)
        h, t = cfg.hardware, cfg.train
        _case(name, rows, preset, h.gpus_per_node, h.nodes, mem, t.seq_len, t.global_batch, t.micro_batch, gpu)
    _case("128-layer@16384", rows, "megatron-1t", 8, 2048, 80.0, 2048, 16384, 1, "A100-80")
    print(json.dumps({"max_plan_seconds": max(r["seconds"] for r in rows),
                      "max_plan_cpu_seconds": max(r["cpu_s"] for r in rows),
                      "cases": {r["case"]: r["seconds"] for r in rows},
                      "cpu_s": {r["case"]: r["cpu_s"] for r in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
