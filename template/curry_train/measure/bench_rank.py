"""The rank side of `bench` (measure/bench.py): build once, time a few steps, then track one more step's memory.

Every rank builds its model and mesh once (measure/init_memory.py), runs `warmup` untimed and `steps` timed
optimizer steps, saves a checkpoint if asked, and then tracks one further step of the same model
(measure/memory.measure_step): the memory figure is the peak of the process a normal run is, with its own
communicators resident and no second model built beside the first. The step covers the micro-batches the bench
asked for (bench.bench_config); the layout is the config's.

On CUDA each rank also reports what the whole device holds at the peak (`cuda_device_view`: context, NCCL and
workspaces beside the allocator), the figure that calibrates estimator.reserve_bytes (docs/ESTIMATION.md#reserve).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _say(progress: Path | None, line: str) -> None:
    if progress is not None:  # read by the launcher side for progress reports
        with open(progress, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def bench_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside each rank: warm up, time `steps` steps, then track one more step's per-component memory."""
    import torch

    from curry_train.config import from_dict
    from curry_train.measure.init_memory import measure_init
    from curry_train.measure.memory import measure_step
    from curry_train.measure.steptime import timed_step
    from curry_train.train.loop import collect_garbage, init_distributed, rank, reduce_losses

    cfg = from_dict(spec["config"])
    steps, warmup = int(spec.get("steps", 5)), int(spec.get("warmup", 1))
    device = init_distributed(cfg)
    r = rank()
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"rank": r, "device": device.type, "oom": False}
    if cuda:
        out["device_name"] = torch.cuda.get_device_name(device)
    progress = Path(spec["out_dir"]) / "progress.log" if r == 0 else None
    try:
        par, init = measure_init(cfg, device)
        out["init_peak_bytes"] = max(init["init_peak_bytes"], init.get("cuda_init_peak_bytes", 0))
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = 0
        if spec.get("resume"):
            from curry_train.train.checkpoint import load

            start = out["start_step"] = load(par, spec["resume"])
        history = []
        with collect_garbage(cfg.train.gc_every) as tick:  # as `train` runs: no automatic GC inside a step
            for s in range(warmup + steps):
                history.append(timed_step(par, start + s))
                tick(s)
                phase = f"warm-up {s + 1}/{warmup}" if s < warmup else f"step {s + 1 - warmup}/{steps}"
                _say(progress, f"{phase}: {history[-1].step_time_s * 1e3:.1f} ms")
        # every step's global loss in one all-reduce and one host read, after the timed steps
        out["losses"] = reduce_losses(par, [h.loss_local for h in history])
        out["step_time_s"] = [h.step_time_s for h in history[warmup:]]
        if cuda:
            out["cuda_peak_timed"] = int(torch.cuda.max_memory_allocated(device))
        if spec.get("checkpoint_dir"):
            from curry_train.train.checkpoint import save

            out["checkpoint"] = str(save(par, spec["checkpoint_dir"], start + warmup + steps))
        _say(progress, "measuring per-component memory (1 more step of the same run)")
        out["memory"] = measure_step(par, start + warmup + steps).model_dump()
    except torch.cuda.OutOfMemoryError as e:
        # Mark the OOM for the launcher, then fail the rank: torchrun tears the peers down instead of leaving them
        # blocked in a collective until the process-group timeout.
        marker = Path(spec["out_dir"]) / f"oom_rank{r}.json"
        marker.write_text(json.dumps({"rank": r, "error": str(e)[:2000]}), encoding="utf-8")
        raise
    return out
