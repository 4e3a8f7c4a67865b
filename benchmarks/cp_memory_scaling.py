"""Context parallel at growing sequence length: per-rank (peak - model states) and CPU throughput.

    .venv/bin/python benchmarks/cp_memory_scaling.py [--seqs 1024 2048] [--cp 2] [--steps 3]

tiny at cp ranks, micro_batch 1, one sequence per step. Memory: measure/memory.py's exact tracker on every
rank; "activation" = peak - (params + grads + optimizer), the part that must grow linearly in the sequence once
no [T/cp, T/cp] score tile is stored. Throughput: tokens/s of the timed training steps after one warm-up step
(median over ranks' reports). Final line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

from curry_train.config import load_config
from curry_train.measure.memory import memory_spec
from curry_train.paths import resolve_config_arg
from curry_train.train.jobs import rank_jobs
from curry_train.train.launch import launch_forkserver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for seq in a.seqs:
        cfg = load_config(resolve_config_arg("tiny"), {"parallel.cp": a.cp, "train.seq_len": seq,
                                                       "train.micro_batch": 1, "train.global_batch": 1,
                                                       "train.steps": a.steps + 1})
        specs = [memory_spec(cfg),
                 {"kind": "train", "config": cfg.to_dict()}]
        mem, train = zip(*launch_forkserver(rank_jobs, cfg.world_size, specs, timeout=900))
        act = max(r["peak"] - r["params"] - r["grads"] - r["optimizer"] for r in mem)
        tps = statistics.median(statistics.median(t["tokens_per_s"][1:]) for t in train)
        rows.append({"seq": seq, "peak_minus_states_bytes": act, "tokens_per_s": round(tps, 1)})
        print(json.dumps(rows[-1]), flush=True)
    growth = [rows[i + 1]["peak_minus_states_bytes"] / rows[i]["peak_minus_states_bytes"]
              for i in range(len(rows) - 1)]
    print(json.dumps({"cp": a.cp, "rows": rows, "growth": [round(g, 3) for g in growth]}))


if __name__ == "__main__":
    main()
