"""Planner speed: plan() (the climb plus the ranking of every valid layout) for Llama 3 8B / 70B / 405B on
8 ... 16,384 GPUs (8 per node, 80 GB, 8192-token sequences, the preset's global batch or one sequence per GPU,
whichever is larger).

    .venv/bin/python benchmarks/planner_speed.py          # a table on stderr, then {"max_plan_seconds": ...}

Goal: under one second for every case (pure arithmetic on the estimator's fast path).
"""

from __future__ import annotations

import json
import sys
import time

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")
GPUS = (8, 64, 512, 4096, 16384)


def main() -> int:
    from curry_train.estimator import load_any
    from curry_train.advice.planner import plan

    rows = []
    for model in MODELS:
        gb0 = load_any(model).train.global_batch
        for gpus in GPUS:
            gb = max(gb0, gpus)
            t0 = time.perf_counter()
            p = plan(model, gpus_per_node=8, nodes=gpus // 8, gpu_memory_gib=80.0, seq_len=8192, global_batch=gb)
            dt = time.perf_counter() - t0
            best = p.ranked[0].parallel if p.ranked else None
            rows.append({"model": model, "gpus": gpus, "seconds": round(dt, 4), "fits": p.fits,
                         "rungs": [r.primitive for r in p.rungs[1:]], "valid": p.layouts_valid,
                         "fitting": p.layouts_fitting, "best": best})
            print(f"{model:12s} {gpus:6d} GPUs  {dt * 1e3:7.1f} ms  fits={p.fits!s:5s} rungs={rows[-1]['rungs']} "
                  f"valid={p.layouts_valid} fitting={p.layouts_fitting}", file=sys.stderr)
    print(json.dumps({"max_plan_seconds": max(r["seconds"] for r in rows),
                      "cases": {f"{r['model']}@{r['gpus']}": r["seconds"] for r in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
