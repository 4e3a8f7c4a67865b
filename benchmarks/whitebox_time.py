"""Wall time of each primitive's white-box (2 steps, the default) at 2 and 4 ranks, and the launcher's overhead
over a bare torchrun.

    .venv/bin/python benchmarks/whitebox_time.py [--quick]

Each white-box goes through the product path (service.whitebox: validate, torchrun, reference, compare, ledger)
into a throwaway project root. The overhead compares our launcher (run_torchrun: spec file, own session,
captured log, per-rank result files) with `torchrun -m curry_train.train` on the same 1-step job, alternating
the two so machine drift hits both. Final line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {  # name -> (config, overrides); world size follows from the overrides
    "ddp": ("tiny", {"parallel.dp": 2}),
    "zero1": ("tiny", {"parallel.dp": 2, "parallel.zero": 1}),
    "zero2": ("tiny", {"parallel.dp": 2, "parallel.zero": 2}),
    "zero3": ("tiny", {"parallel.dp": 2, "parallel.zero": 3}),
    "recompute_full": ("tiny", {"parallel.dp": 2, "parallel.recompute": "full"}),
    "tp": ("tiny", {"parallel.tp": 2}),
    "tp_sp": ("tiny", {"parallel.tp": 2, "parallel.sp": True}),
    "pp_1f1b": ("tiny", {"parallel.pp": 2}),
    "pp_interleaved": ("tiny", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                                "parallel.pp_virtual": 2}),
    "ep": ("tiny-moe", {"parallel.dp": 2, "parallel.ep": 2}),
    "cp": ("tiny", {"parallel.cp": 2}),
    "ddp_4": ("tiny", {"parallel.dp": 4}),
    "zero3_4": ("tiny", {"parallel.dp": 4, "parallel.zero": 3}),
    "tp_4": ("tiny", {"parallel.tp": 4}),
    "pp_4": ("tiny", {"parallel.pp": 4}),
    "ep_4": ("tiny-moe", {"parallel.dp": 4, "parallel.ep": 4, "parallel.zero": 3}),
    "cp_4": ("tiny", {"parallel.cp": 4}),
    "fsdp_tp_2d": ("tiny", {"parallel.dp": 2, "parallel.zero": 3, "parallel.tp": 2, "parallel.sp": True}),
}
QUICK = ["ddp", "zero3", "tp", "pp_1f1b", "ep", "cp", "ddp_4"]


def main() -> None:
    from curry_train.config import load_config
    from curry_train.measure import service
    from curry_train.train.launch import run_torchrun

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--repeats", type=int, default=3, help="overhead measurement pairs")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="curry_wb_"))
    shutil.copytree(REPO / "configs", root / "configs")
    rows = {}
    for name in QUICK if a.quick else CASES:
        cfg_name, overrides = CASES[name]
        t0 = time.perf_counter()
        v = service.whitebox(cfg_name, overrides, root=root)
        rows[name] = {"world_size": v.world_size, "wall_s": round(time.perf_counter() - t0, 2), "passed": v.passed}
        print(f"{name:16s} world={v.world_size} {rows[name]['wall_s']:6.2f} s passed={v.passed}", flush=True)

    cfg = load_config(root / "configs/tiny.yaml", {"parallel.dp": 2, "train.steps": 1})
    bare_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "curry_train.train",
                "--config", str(root / "configs/tiny.yaml"), "--set", "parallel.dp=2", "--set", "train.steps=1"]
    ours, bare = [], []
    for i in range(a.repeats):
        for which in (("ours", "bare") if i % 2 == 0 else ("bare", "ours")):
            t0 = time.perf_counter()
            if which == "bare":
                subprocess.run(bare_cmd, check=True, capture_output=True)
                bare.append(time.perf_counter() - t0)
            else:
                run_torchrun({"kind": "train", "config": cfg.to_dict()}, 2, root / "runs" / f"overhead{i}")
                ours.append(time.perf_counter() - t0)
    overhead = statistics.median(ours) - statistics.median(bare)
    print(json.dumps({"whitebox_wall_s": rows, "launcher_s": round(statistics.median(ours), 3),
                      "bare_torchrun_s": round(statistics.median(bare), 3), "launcher_overhead_s": round(overhead, 3),
                      "all_passed": all(r["passed"] for r in rows.values())}))


if __name__ == "__main__":
    main()
