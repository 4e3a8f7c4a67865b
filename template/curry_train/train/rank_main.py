"""One rank of a torchrun job: `python -m torch.distributed.run ... -m curry_train.train.rank_main <spec.json>`.

Runs the job kind named in the spec (see jobs.py) and writes `rank<R>.json` = {"ok", "value" | "error",
"traceback"} into the spec's out_dir, so the launcher learns which rank failed and why.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(spec["out_dir"])
    from curry_train.train.jobs import rank_job

    try:
        result = {"ok": True, "value": rank_job(rank, world, spec)}
    except Exception as e:  # top level of a rank: report the error to the launcher instead of a bare exit code
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, out / f"rank{rank}.json")
    from curry_train.train.comm_init import end_rank

    end_rank(result["ok"])  # every peer has reported, then the cached groups, DDP's cycles (quirk 1), the world
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
