"""The torchrun entry of a cluster job: every node runs the same command, rank 0 keeps the run ledger.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 --rdzv-id JOB \\
        -m curry_train.cli.node_train --config llama3-8b [--set k=v ...] [--checkpoint-dir DIR --save-every N]

(`curry-train launch-script` prints this for Slurm or plain torchrun.) Each rank resolves and validates the
config itself (same files on every node: a shared filesystem or the same checkout). Only global rank 0 writes
the ledger (runs/ under --root, on the node that holds rank 0), before and after training; the other ranks never
touch it. Rank 0 prints the run's metrics as one JSON line on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--root", default=None, help="project folder holding configs/ and runs/")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--keep-last", type=int, default=0)
    a = ap.parse_args(argv)

    from curry_train.config import ConfigError, parse_sets
    from curry_train.measure.service import _checkpoint_args, resolve
    from curry_train.store.runs import Ledger
    from curry_train.train.loop import run_training

    try:
        cfg, name = resolve(a.config, parse_sets(a.set), a.root)
        ckpt = _checkpoint_args(cfg, a.checkpoint_dir, a.save_every, a.resume, a.keep_last)
    except (ConfigError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    rank0 = int(os.environ.get("RANK", "0")) == 0
    ledger = Ledger(a.root) if rank0 else None
    rec = ledger.start("train", cfg, name) if ledger else None
    try:
        out = run_training(cfg, log=lambda r: print(json.dumps(r), file=sys.stderr, flush=True), **ckpt)
    except BaseException as e:
        if ledger:
            ledger.finish(rec.run_id, status="failed", error=f"{type(e).__name__}: {e}"[:4000])
        raise
    if ledger:  # before the teardown: a peer's teardown abort (docs/CPU-DISTRIBUTED.md, quirk 1) cannot lose it
        metrics = {"losses": out["losses"], "first_loss": out["losses"][0], "last_loss": out["losses"][-1],
                   "step_time_s": sorted(out["step_time_s"])[len(out["step_time_s"]) // 2],
                   "world_size": out["world_size"], "device": out["device"], "start_step": out["start_step"],
                   "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")), **({"checkpoint": ckpt} if ckpt else {})}
        ledger.finish(rec.run_id, status="ok", metrics=metrics)
        print(json.dumps({"run_id": rec.run_id, **metrics}), flush=True)
    from curry_train.train.comm_init import end_rank

    end_rank()  # every peer has finished, then the cached groups, DDP's cycles (quirk 1) and the world
    return 0


if __name__ == "__main__":
    sys.exit(main())
