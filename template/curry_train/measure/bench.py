"""Step benchmark: median step time, throughput, per-rank memory (measured, beside the estimate), OOM, MFU.

    curry-train bench --config tiny --set parallel.dp=2 --steps 3 --json [--plot memory.png]

`bench(config, steps, warmup, overrides)` validates, records a run, launches `world_size` ranks through torchrun
(job kind "bench", `bench_job` below), and reduces the per-rank results:
  - step_time_s: per step the slowest rank, then the median over the timed steps (warm-up excluded);
  - memory: `curry_train.measure.memory.measure_memory` in every rank; the breakdown is the rank with the largest peak;
  - oom: a real CUDA OutOfMemoryError in any rank, or (CPU) the measured peak above hardware.gpu_memory_gib;
  - mfu: model FLOPs per token (the estimator's count) x tokens/s / (ranks x device peak); None on CPU;
  - estimate: the estimator's per-rank prediction for the same config, and its error against the measurement.
Benches (and white-box runs) serialise on a per-machine device lock (`DeviceLock`), shared by every process.
`resume=` continues a checkpoint (any layout, train/checkpoint.py) at its step, and `save_checkpoint=True` saves
the state after the timed steps into <run folder>/checkpoints/: how `climb` carries the training run from rung to
rung instead of restarting it (the memory measurement after the timed steps stays a fresh model of its own).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, Field

from curry_train.breakdown import CATEGORIES, Breakdown, split
from curry_train.config import Config
from curry_train.paths import runs_dir

BENCH_JOB = f"{__name__}:bench_job"  # the rank-side job of a bench spec (train/jobs.py resolves it)


class MemoryBreakdown(Breakdown):
    """One rank's bytes at the moment of its peak, in the categories the estimator uses (curry_train/breakdown.py);
    they sum to `peak` on CPU. `categories` keeps each category's own maximum over the step."""

    peak: int = Field(0, description="Peak bytes on this rank (CUDA: the allocator's high-water mark).")
    rank: int | None = Field(None, description="Which rank this is.")
    categories: dict[str, int] = Field(default_factory=dict, description="Per-category maxima over the step.")


class EstimateSide(Breakdown):
    """The estimator's prediction for the same config, in the same categories."""

    total: int = Field(description="Predicted per-rank peak bytes (the rank with the largest total).")
    error_vs_measured: float | None = Field(None, description="total / measured peak - 1 (+ = over-estimate).")


class BenchResult(BaseModel):
    run_id: str
    config_name: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    world_size: int
    device: str
    parallel: dict[str, Any] = Field(description="The parallel section benched.")
    steps: int
    warmup: int
    step_time_s: float | None = Field(description="Median step time (slowest rank per step); None on OOM.")
    step_times_s: list[float] = Field(default_factory=list)
    tokens_per_s: float | None
    peak_memory_bytes: int = Field(description="Largest per-rank peak (CUDA: allocator high-water mark).")
    per_rank_peak_bytes: list[int] = Field(default_factory=list)
    init_peak_bytes: list[int] = Field(default_factory=list, description="Per rank: peak live bytes while it built "
                                       "its model (meta build + local shards, measure/init_memory.py; CUDA: the "
                                       "larger of that and the allocator's high-water mark).")
    memory_breakdown: MemoryBreakdown = Field(description="The rank with the largest peak, by category "
                                                          "(curry_train/breakdown.py, the estimate's categories).")
    memory_budget_bytes: int = Field(description="hardware.gpu_memory_gib in bytes: the per-rank budget.")
    losses: list[float] = Field(default_factory=list, description="Loss of every step, warm-up included.")
    start_step: int = Field(0, description="The first step's index: the checkpoint's step with resume, else 0.")
    resumed_from: str | None = Field(None, description="The checkpoint (step folder) the run continued, if any.")
    checkpoint: str | None = Field(None, description="The step folder saved after the timed steps, if asked.")
    loss_finite: bool
    oom: bool = Field(description="A real CUDA OOM in a rank, or (CPU) the measured peak above the budget.")
    oom_detail: str | None = None
    mfu: float | None = Field(None, description="Model FLOPs utilisation; None on CPU or an unknown device.")
    estimate: EstimateSide | None = Field(None, description="The estimator's prediction beside the measurement.")
    plot_path: str | None = Field(None, description="PNG of the memory breakdown, estimate vs measured.")
    wall_s: float


# ------------------------------------------------------------------------------------------ device lock


class DeviceLock:
    """An advisory lock on runs/.device.lock: one bench / white-box run per machine at a time, across processes.

    The kernel releases it when the holder dies, so a killed server never leaves the device locked.
    """

    def __init__(self, root: str | Path | None = None, name: str = "device"):
        self.path = runs_dir(root) / f".{name}.lock"
        self._fd: int | None = None
        self._mutex = threading.Lock()

    def try_acquire(self) -> bool:
        with self._mutex:
            if self._fd is not None:
                return False
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self._fd = fd
            return True

    def acquire(self, timeout: float = 3600.0, cancel: threading.Event | None = None,
                on_wait: Callable[[str], None] | None = None) -> None:
        deadline = time.monotonic() + timeout
        told = False
        while not self.try_acquire():
            if not told and on_wait is not None:
                on_wait("waiting for the device lock (another bench or white-box run is using this machine)")
                told = True
            if cancel is not None and cancel.is_set():
                raise TimeoutError("cancelled while waiting for the device lock")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the device stayed busy for {timeout:.0f}s; retry when the other run ends")
            time.sleep(0.1)

    def release(self) -> None:
        with self._mutex:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ------------------------------------------------------------------------------------------ rank side


def bench_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside each rank: warm up, time `steps` steps, then measure per-component memory."""
    import gc

    import torch

    from curry_train.config import from_dict
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
        from curry_train.measure.init_memory import measure_init

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
                if progress is not None:  # read by the launcher side for progress reports
                    phase = f"warm-up {s + 1}/{warmup}" if s < warmup else f"step {s + 1 - warmup}/{steps}"
                    with open(progress, "a", encoding="utf-8") as f:
                        f.write(f"{phase}: {history[-1].step_time_s * 1e3:.1f} ms\n")
        # every step's global loss in one all-reduce and one host read, after the timed steps
        out["losses"] = reduce_losses(par, [h.loss_local for h in history])
        out["step_time_s"] = [h.step_time_s for h in history[warmup:]]
        if cuda:
            out["cuda_peak_timed"] = int(torch.cuda.max_memory_allocated(device))
        if spec.get("checkpoint_dir"):
            from curry_train.train.checkpoint import save

            out["checkpoint"] = str(save(par, spec["checkpoint_dir"], start + warmup + steps))
        del par, history
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        from curry_train.measure.memory import measure_memory

        if progress is not None:
            with open(progress, "a", encoding="utf-8") as f:
                f.write("measuring per-component memory (2 more steps)\n")
        report = measure_memory(cfg, steps=2)
        out["memory"] = report.model_dump() if hasattr(report, "model_dump") else dict(vars(report))
    except torch.cuda.OutOfMemoryError as e:
        # Mark the OOM for the launcher, then fail the rank: torchrun tears the peers down instead of leaving them
        # blocked in a collective until the process-group timeout.
        marker = Path(spec["out_dir"]) / f"oom_rank{r}.json"
        marker.write_text(json.dumps({"rank": r, "error": str(e)[:2000]}), encoding="utf-8")
        raise
    return out


# ------------------------------------------------------------------------------------------ service


def fold(report: dict[str, Any], *, peak: int, rank: int) -> MemoryBreakdown:
    """A MemoryReport dict -> the categories at the moment of the peak (no folding: both sides share them)."""
    at = report.get("at_peak") or report
    cats = {k: int(report[k]) for k in CATEGORIES if report.get(k) is not None}
    return MemoryBreakdown(**split(at), peak=peak, rank=rank, categories=cats)


def _estimate(cfg: Config) -> EstimateSide | None:
    """The estimator's per-rank prediction for this config, in the bench's components."""
    try:
        from curry_train.estimator import estimate_memory
    except ModuleNotFoundError as e:
        if e.name == "curry_train.estimator":
            return None
        raise
    mem = estimate_memory(cfg).memory
    return EstimateSide(**mem.by_category(), total=mem.total)


def _model_flops_per_token(cfg: Config) -> float | None:
    try:
        from curry_train import estimator as estimate
    except ModuleNotFoundError:
        return None
    fn = getattr(estimate, "flops_per_token", None)
    return float(fn(cfg)) if fn is not None else None


def _peak_flops(device_name: str, dtype: str) -> float | None:
    """Datasheet peak of the device the ranks ran on (curry_train.estimator.profiles); None when unknown."""
    from curry_train.estimator.profiles import from_device_name

    prof = from_device_name(device_name)
    return None if prof is None or prof.name == "CPU" else prof.peak_flops(dtype)


def summarise(cfg: Config, values: list[dict[str, Any]], *, run_id: str, config_name: str,
              overrides: dict[str, Any], steps: int, warmup: int, wall_s: float) -> BenchResult:
    """Reduce the per-rank bench results to one BenchResult."""
    per_step = [max(v["step_time_s"][i] for v in values) for i in range(len(values[0]["step_time_s"]))]
    step_time = statistics.median(per_step) if per_step else None
    tokens = cfg.train.global_batch * cfg.train.seq_len
    peaks, breakdowns = [], []
    for v in values:
        m = v.get("memory") or {}
        peak = max(int(m.get("peak") or 0), int(m.get("cuda_max_allocated") or 0), int(v.get("cuda_peak_timed") or 0))
        peaks.append(peak)
        breakdowns.append(fold(m, peak=peak, rank=v["rank"]))
    worst = max(range(len(values)), key=lambda i: peaks[i])
    losses = values[0].get("losses", [])
    budget = int(cfg.hardware.gpu_memory_gib * 2**30)
    device = values[0]["device"]
    mfu = None
    if device == "cuda" and step_time:
        fpt, peak_f = _model_flops_per_token(cfg), _peak_flops(values[0].get("device_name", ""), cfg.train.dtype)
        if fpt and peak_f:
            mfu = tokens / step_time * fpt / (cfg.world_size * peak_f)
    est = _estimate(cfg)
    if est is not None and peaks[worst]:
        est.error_vs_measured = est.total / peaks[worst] - 1
    over = device != "cuda" and peaks[worst] > budget
    return BenchResult(
        run_id=run_id, config_name=config_name, overrides=overrides, world_size=cfg.world_size, device=device,
        parallel=cfg.parallel.model_dump(), steps=steps, warmup=warmup, step_time_s=step_time,
        step_times_s=per_step, tokens_per_s=tokens / step_time if step_time else None,
        peak_memory_bytes=peaks[worst], per_rank_peak_bytes=peaks, memory_breakdown=breakdowns[worst],
        init_peak_bytes=[int(v.get("init_peak_bytes", 0)) for v in values],
        memory_budget_bytes=budget, losses=losses, loss_finite=bool(losses) and all(math.isfinite(x) for x in losses),
        oom=over, oom_detail=(f"measured peak {peaks[worst]} B on rank {worst} > budget {budget} B "
                              f"(hardware.gpu_memory_gib={cfg.hardware.gpu_memory_gib})") if over else None,
        mfu=mfu, estimate=est, wall_s=wall_s, start_step=int(values[0].get("start_step", 0)),
        checkpoint=values[0].get("checkpoint"),
    )


def write_plot(result: BenchResult, path: Path, usable_bytes: int | None = None) -> Path:
    """The memory picture of a bench: estimate and measured bars in the shared categories, the budget line."""
    from curry_train.plots import layout_title, memory_breakdown_png

    bars = {"measured": result.memory_breakdown.by_category()}
    peaks = {"measured": result.peak_memory_bytes}
    if result.estimate is not None:
        bars = {"estimate": result.estimate.by_category(), **bars}
        peaks["estimate"] = result.estimate.total
    title = f"{layout_title(result.config_name, result.parallel)}, rank {result.memory_breakdown.rank}"
    path.write_bytes(memory_breakdown_png(bars, title=title, budget_bytes=result.memory_budget_bytes,
                                          usable_bytes=usable_bytes, peaks=peaks))
    return path


def _wait(job: Any, timeout: float, cancel: threading.Event | None, say: Callable[[str], None]) -> list[Any]:
    """launch.Job.wait, plus rank 0's progress lines forwarded to `say`."""
    from curry_train.train.launch import LaunchError

    deadline = time.monotonic() + timeout
    progress = job.run_dir / "progress.log"
    seen = 0
    while job.poll() is None:
        if cancel is not None and cancel.is_set():
            job.kill()
            raise LaunchError("cancelled; every rank was killed")
        if time.monotonic() > deadline:
            job.kill()
            raise LaunchError(f"timed out after {timeout:.0f}s; every rank was killed. Log tail:\n{job.tail()}")
        if progress.is_file():
            text = progress.read_text(encoding="utf-8")
            lines = text[:text.rfind("\n") + 1].splitlines()  # complete lines only
            for line in lines[seen:]:
                say(line)
            seen = len(lines)
        time.sleep(0.1)
    return job.results()


def bench(config: str, steps: int = 5, warmup: int = 1, overrides: dict[str, Any] | None = None, *,
          root: str | Path | None = None, timeout: float = 900.0, cancel: threading.Event | None = None,
          progress: Callable[[str], None] | None = None, resume: str | None = None,
          save_checkpoint: bool = False) -> BenchResult:
    """Benchmark `config` (a name in configs/) with dotted `overrides`; the run is recorded in the ledger.
    `resume`: continue this checkpoint (a missing, corrupt or other-shape one is a ConfigError before anything
    launches); `save_checkpoint`: save after the timed steps into the run folder (`checkpoint` in the result)."""
    from curry_train.measure.preflight import preflight
    from curry_train.measure.service import resolve
    from curry_train.store.runs import Ledger
    from curry_train.train.launch import LaunchError, start_torchrun

    if steps < 1 or warmup < 0:
        raise ValueError("steps must be >= 1 and warmup >= 0")
    say = progress or (lambda msg: None)
    overrides = dict(overrides or {})
    cfg, name = resolve(config, overrides, root)
    preflight(cfg, name)  # before the run is recorded: a config this machine cannot run launches nothing
    if resume:
        from curry_train.train.checkpoint import find_checkpoint

        resume = str(find_checkpoint(Path(resume).expanduser(), cfg)[0].resolve())
    ledger = Ledger(root)
    rec = ledger.start("bench", cfg, name)
    run_path = ledger.path.parent / rec.run_id
    t0 = time.perf_counter()
    say(f"launching {cfg.world_size} rank(s) for {warmup}+{steps} steps (run {rec.run_id})")
    spec = {"kind": "bench", "job": BENCH_JOB, "config": cfg.to_dict(), "steps": steps, "warmup": warmup,
            "resume": resume, "checkpoint_dir": str((run_path / "checkpoints").resolve()) if save_checkpoint else None}
    job = start_torchrun(spec, cfg.world_size, run_path)
    try:
        values = _wait(job, timeout, cancel, say)
    except LaunchError as e:
        ooms = sorted(run_path.glob("oom_rank*.json"))
        if not ooms:
            ledger.finish(rec.run_id, status="cancelled" if "cancelled" in str(e) else "failed", error=str(e)[:4000])
            raise
        detail = json.loads(ooms[0].read_text(encoding="utf-8"))
        result = BenchResult(
            run_id=rec.run_id, config_name=name, overrides=overrides, world_size=cfg.world_size, device="cuda",
            parallel=cfg.parallel.model_dump(), steps=steps, warmup=warmup, step_time_s=None, tokens_per_s=None,
            peak_memory_bytes=0, memory_breakdown=MemoryBreakdown(),
            memory_budget_bytes=int(cfg.hardware.gpu_memory_gib * 2**30), loss_finite=False, oom=True,
            oom_detail=f"CUDA out of memory on rank {detail['rank']}: {detail['error'][:500]}",
            estimate=_estimate(cfg), wall_s=time.perf_counter() - t0, resumed_from=resume)
        ledger.finish(rec.run_id, status="failed", metrics=result.model_dump(mode="json"), error=result.oom_detail)
        return result
    finally:
        if job.poll() is None:
            job.kill()
    say("ranks finished; summarising")
    result = summarise(cfg, values, run_id=rec.run_id, config_name=name, overrides=overrides, steps=steps,
                       warmup=warmup, wall_s=time.perf_counter() - t0)
    result.resumed_from = resume
    from curry_train.estimator import reserve_bytes

    usable = result.memory_budget_bytes - reserve_bytes(cfg)
    result.plot_path = str(write_plot(result, run_path / "memory.png", usable))
    ledger.finish(rec.run_id, status="ok", metrics=result.model_dump(mode="json"))
    return result
