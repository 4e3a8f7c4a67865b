"""The main job: climb the parallelism ladder on this machine until a per-rank memory budget fits.

    curry-train climb --config configs/tiny.yaml --memory-budget 1700000

The seed's procedure, automated, one primitive per rung:
  probe this machine -> write <config>-climb (the base fitted to this machine, budget as hardware.gpu_memory_gib)
  -> bench the baseline -> while the measured per-rank peak is over the budget: recommend_next (symptom oom)
  -> apply its one-primitive patch with update_config -> bench -> white-box against one device -> record.
It stops when the measurement fits, when parity fails (never stack a primitive on a broken one), when the advisor
says only more GPUs help, or after --max-rungs. Every bench and white-box run is in the ledger; every version of
the climb config is in configs/local/.history/ (configs/local/ is ignored by the repository: paths.py). The
table: rung, primitive, layout, the steps it trained, predicted vs measured per-rank bytes, step time, parity.

One training run across the rungs: every rung's bench saves its state after its timed steps (model + AdamW,
runs/<bench run>/checkpoints/step-NNNNNN, train/checkpoint.py) and the next rung resumes from it, resharded into
its new layout, so the loss curve continues (rung 1 trains steps 4-7 after the baseline's 0-3) and a rung's
record names the checkpoint it resumed from and its step. A rung that saved nothing (a CUDA OOM) passes on the
checkpoint it resumed from. A missing or damaged checkpoint stops the climb with an error, never a silent fresh
start. The white-box check of a rung that resumed is the resume white-box from the checkpoint it resumed
(validation/resume.py): the rung's layout loads that checkpoint with the same load the bench ran, its loaded
weights and AdamW state must be the checkpoint's bit for bit, the step counters and lr its step's, and its next
steps match the single-device reference that loads the same checkpoint; the baseline's (and a rung that resumed
nothing) is the white-box from the seed (`parity_from`). Disk: a checkpoint is the fp32 weights plus AdamW's two
moments, 12 B/param (about 96 GB at 8B), so
once a rung has resumed and saved its own, the checkpoint it resumed from is deleted (`checkpoint_deleted` in its
record); --keep-checkpoints keeps every rung's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.config import ConfigError, Problem
from curry_train.measure.bench import DeviceLock
from curry_train.measure.preflight import cpu_rank_cap
from curry_train.paths import configs_dir, resolve_config_arg, runs_dir, written_dir
from curry_train.train.launch import LaunchError

WHITEBOX_STEPS = None  # whitebox.default_steps: two updates at least (a wrong optimizer step shows in the second),
# through the end of a short lr warm-up
# The README's CPU budget for tiny: between the measured peaks of rung 2 (ZeRO-3 on 4 ranks + full recompute,
# 1.96 MB) and rung 3 (+ TP 2 with SP, 1.45 MB), so the climb takes three primitives (baseline 5.05 MB; the lean
# activations of model/lean.py, docs/ESTIMATION.md, brought ZeRO-3 under the earlier 2,000,000).
README_BUDGET = 1_700_000


class Rung(BaseModel):
    rung: int
    primitive: str = Field(description="What this rung added ('baseline' for rung 0).")
    reason: str = ""
    patch: dict[str, Any] = Field(default_factory=dict, description="Dotted keys applied on this rung.")
    parallel: dict[str, Any]
    world_size: int
    predicted_bytes: int | None = Field(None, description="The estimator's per-rank peak.")
    measured_bytes: int = Field(description="bench's measured per-rank peak (largest rank).")
    step_time_s: float | None
    oom: bool
    fits: bool = Field(description="Measured peak within the budget less estimator.reserve_bytes (0 on CPU).")
    parity: str = Field(description="white-box verdict: passed, FAILED, or why it was not run.")
    bench_run: str
    whitebox_run: str | None = None
    parity_from: str = Field("seed", description="What the white-box started from: 'seed', or the checkpoint the "
                             "rung resumed (the resume white-box: loaded state bitwise, then the resumed steps).")
    loss: float | None = None
    losses: list[float] = Field(default_factory=list, description="bench's losses, warm-up included.")
    start_step: int = Field(0, description="The first step this rung trained (the resumed checkpoint's step).")
    resumed_from: str | None = Field(None, description="The checkpoint (step folder) this rung resumed from; "
                                     "None for the baseline.")
    checkpoint: str | None = Field(None, description="The checkpoint this rung saved; the next rung resumes it.")
    checkpoint_deleted: bool = Field(False, description="True when a later rung resumed `checkpoint` and saved its "
                                     "own, so this one was deleted (climb keep_checkpoints=False).")


class ClimbReport(BaseModel):
    config: str = Field(description="The config the climb wrote (configs/<config>.yaml), its final rung.")
    base: str
    memory_budget_bytes: int
    device: str
    rungs: list[Rung]
    fits: bool
    stopped: str = Field(description="Why the climb ended.")
    final_parallel: dict[str, Any]
    wall_s: float


def _layout(p: dict[str, Any]) -> str:
    s = f"dp{p['dp']} z{p['zero']} tp{p['tp']}{'+sp' if p.get('sp') else ''} pp{p['pp']} cp{p['cp']}"
    if p.get("ep", 1) > 1:
        s += f" ep{p['ep']}"
    if p.get("recompute", "none") != "none":
        s += f" rc:{p['recompute']}"
    return s


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.2f} MiB"


def format_table(r: ClimbReport) -> str:
    head = f"{'rung':>4}  {'primitive':<10} {'layout':<28} {'steps':>7} {'predicted':>11} {'measured':>11} " \
           f"{'step':>9}  {'parity':<8} fits"
    lines = [(f"climb {r.base} -> configs/{r.config}.yaml on {r.device}, budget {_mib(r.memory_budget_bytes)} "
              f"({r.memory_budget_bytes} B) per rank"), head, "-" * len(head)]
    for g in r.rungs:
        step = f"{g.step_time_s * 1e3:.1f} ms" if g.step_time_s else "OOM"
        trained = f"{g.start_step}-{g.start_step + len(g.losses) - 1}" if g.losses else "-"
        lines.append(f"{g.rung:>4}  {g.primitive:<10} {_layout(g.parallel):<28} {trained:>7} "
                     f"{_mib(g.predicted_bytes):>11} "
                     f"{'OOM' if g.oom and not g.measured_bytes else _mib(g.measured_bytes):>11} {step:>9}  "
                     f"{g.parity:<8} {'yes' if g.fits else 'no'}")
    lines.append(f"{'FITS' if r.fits else 'DOES NOT FIT'}: {r.stopped} ({r.wall_s:.0f} s)")
    return "\n".join(lines)


def _recommend(name: str, root: str | Path | None, measured_peak_bytes: int | None) -> Any:
    """The advisor's next rung for a measured OOM (the measurement tells it how far over the budget we are)."""
    from curry_train.advice.advisor import recommend_next

    return recommend_next(name, symptom="oom", measured_peak_bytes=measured_peak_bytes or None, root=root)


def _machine_changes(cfg: Any, budget: int, probe: Any) -> dict[str, Any]:
    """Fit the base config to this machine: its device, how many ranks it can run, the budget."""
    out: dict[str, Any] = {"hardware.gpu_memory_gib": budget / 2**30, "hardware.nodes": 1}
    if probe.gpu_count:
        out.update({"hardware.device": "cuda", "hardware.gpus_per_node": probe.gpu_count})
    else:
        out.update({"hardware.device": "cpu",
                    # the same CPU-rank cap the preflight of every launch applies (measure/preflight.py)
                    "hardware.gpus_per_node": max(1, min(cfg.hardware.gpus_per_node,
                                                         cpu_rank_cap(probe.cpu_count)))})
    return out


def _delete_checkpoint(g: Rung, root: str | Path | None) -> None:
    """Delete rung `g`'s checkpoint folder, which must lie in runs/ (never anything a user pointed at)."""
    import shutil

    path = Path(str(g.checkpoint)).resolve()
    runs = runs_dir(root).resolve()
    if runs not in path.parents:
        raise ValueError(f"refusing to delete {path}: a climb checkpoint lies under {runs}")
    shutil.rmtree(path)
    g.checkpoint_deleted = True


def climb(config: str, memory_budget: int, *, overrides: dict[str, Any] | None = None, name: str | None = None,
          steps: int = 3, max_rungs: int = 8, root: str | Path | None = None, timeout: float = 900.0,
          log: Callable[[str], None] | None = None, keep_checkpoints: bool = False,
          cancel: threading.Event | None = None) -> ClimbReport:
    """Walk the ladder from `config` (a name in configs/ or a YAML file there) until `memory_budget` bytes fit.

    `cancel` (the MCP tool's worker sets it on SIGTERM) stops the launch in flight, whose launcher kills its ranks'
    process group, and any rung not yet started: a LaunchError("cancelled ...")."""
    from curry_train.measure import service
    from curry_train.measure.bench import bench
    from curry_train.measure.hardware import local_hardware
    from curry_train.store.configs import update_config

    say = log or (lambda msg: None)
    if memory_budget <= 0:
        raise ValueError("--memory-budget is bytes per rank and must be positive")
    t0 = time.perf_counter()
    path = resolve_config_arg(config, root)
    if path.resolve().parent not in (configs_dir(root).resolve(), written_dir(root).resolve()):
        raise ValueError(f"{config}: the climb writes its rungs next to the base, so the base must be in "
                         f"{configs_dir(root)}")
    base = path.stem
    base_cfg, _ = service.resolve(base, overrides, root)
    name = name or f"{base}-climb"
    if name == base:
        raise ValueError("the climb never rewrites its base config; pass another --name")

    say("probing this machine")
    probe = local_hardware()  # NVML and torch's files: no torch import, cached
    changes = {**(overrides or {}), **_machine_changes(base_cfg, memory_budget, probe)}
    update_config(name, changes, base=base, root=root)
    say(f"wrote configs/local/{name}.yaml from {base}: {changes}")
    device = "cuda" if probe.gpu_count else "cpu"

    rungs: list[Rung] = []
    lock = DeviceLock(root)

    def locked(fn: Callable[[], Any]) -> Any:
        if cancel is not None and cancel.is_set():
            raise LaunchError(f"cancelled: the climb stopped after {len(rungs)} rung(s)")
        lock.acquire(timeout=timeout, on_wait=say, cancel=cancel)
        try:
            return fn()
        finally:
            lock.release()

    def measure(rung: int, primitive: str, reason: str, patch: dict[str, Any], resume: Rung | None) -> Rung:
        ck = resume.checkpoint if resume else None
        say(f"rung {rung}: bench {name} ({primitive})" + (f", resuming {ck}" if ck else ""))
        try:
            # the whole step: the rungs are one training run, each resuming the previous rung's checkpoint
            b = locked(lambda: bench(name, steps=steps, warmup=1, root=root, timeout=timeout, progress=say,
                                     resume=ck, save_checkpoint=True, cancel=cancel, micro_batches="all"))
        except ConfigError as e:
            if not ck:
                raise
            raise ConfigError([Problem(
                fields=["climb"], message=f"rung {rung} cannot resume from the checkpoint rung {resume.rung} saved "
                f"({ck}): " + "; ".join(p.message for p in e.problems),
                fix="restore that folder, or rerun the climb (it starts again from the baseline); a rung never "
                "starts over silently")]) from e
        parity, wb_run = "n/a", None
        if b.oom and not b.peak_memory_bytes:
            parity = "skipped"  # a CUDA OOM: nothing to compare
        elif rung == 0 and b.world_size == 1:
            parity = "ref"  # the single-device baseline is the reference itself
        else:
            say(f"rung {rung}: white-box {name} against one device")
            v = locked(lambda: service.whitebox(name, steps=WHITEBOX_STEPS, root=root, timeout=timeout,
                                                cancel=cancel, resume_checkpoint=ck))  # ck: the resume white-box
            parity, wb_run = ("passed" if v.passed else "FAILED"), v.run_id
        # the estimator's test (estimator.reserve_bytes): on CUDA the context, NCCL and fragmentation come off the
        # budget before the allocator's peak is compared; on CPU the reserve is 0
        fits = not b.oom and b.peak_memory_bytes <= memory_budget - b.reserve_bytes
        g = Rung(rung=rung, primitive=primitive, reason=reason, patch=patch, parallel=b.parallel,
                 world_size=b.world_size, predicted_bytes=b.estimate.total if b.estimate else None,
                 measured_bytes=b.peak_memory_bytes, step_time_s=b.step_time_s, oom=b.oom, fits=fits,
                 parity=parity, parity_from=ck if ck and wb_run else "seed", bench_run=b.run_id,
                 whitebox_run=wb_run, loss=b.losses[-1] if b.losses else None,
                 losses=b.losses, start_step=b.start_step, resumed_from=b.resumed_from, checkpoint=b.checkpoint)
        say(f"rung {rung}: {primitive}: measured {_mib(g.measured_bytes)} (predicted {_mib(g.predicted_bytes)}), "
            f"parity {parity}, {'fits' if fits else 'over budget'}")
        return g

    rungs.append(measure(0, "baseline", f"{base} fitted to this machine", changes, None))
    stopped = ""
    while True:
        last = rungs[-1]
        if last.parity == "FAILED":
            stopped = f"white-box parity FAILED at rung {last.rung} (run {last.whitebox_run}); fix it before " \
                      "climbing further"
            break
        if last.fits:
            stopped = f"fits after {last.rung} rung(s): measured {_mib(last.measured_bytes)} <= budget"
            break
        if last.rung >= max_rungs:
            stopped = f"still over budget after --max-rungs {max_rungs}"
            break
        rec = _recommend(name, root, last.measured_bytes)
        primitive = str(getattr(rec, "primitive", "none"))
        patch = dict(getattr(rec, "config_patch", {}) or {})
        reason = str(getattr(rec, "reason", ""))
        if primitive == "none" or not patch:
            stopped = f"the advisor has no further rung: {reason}"
            break
        say(f"rung {last.rung + 1}: advisor recommends {primitive}: {reason}")
        upd = update_config(name, patch, root=root)
        if not upd.written:
            stopped = f"the advisor repeated a patch already applied ({patch}): {reason}"
            break
        # resume the latest rung that saved a checkpoint (one that OOMed saved none)
        src = next((g for g in reversed(rungs) if g.checkpoint and not g.checkpoint_deleted), None)
        rungs.append(measure(last.rung + 1, primitive, reason, patch, src))
        if src is not None and rungs[-1].checkpoint and not keep_checkpoints:
            _delete_checkpoint(src, root)
            say(f"rung {rungs[-1].rung} saved its own checkpoint: deleted rung {src.rung}'s ({src.checkpoint})")
    final = rungs[-1]
    return ClimbReport(config=name, base=base, memory_budget_bytes=memory_budget, device=device, rungs=rungs,
                       fits=final.fits and final.parity != "FAILED", stopped=stopped, final_parallel=final.parallel,
                       wall_s=time.perf_counter() - t0)
