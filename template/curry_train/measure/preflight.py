"""Can THIS machine run a config? Checked before anything launches, by every path that starts ranks.

    from curry_train.measure.preflight import preflight
    preflight(cfg, "llama3-8b")   # raises PreflightError naming what this machine has and what to call instead

Callers: bench and the white-box run (curry_train.measure.bench / service, so the CLI and climb check too), a
measured capacity sweep, `curry-train train`, and the MCP tools before they start a worker. Three checks, in this
order, each against `curry_train.measure.hardware.local_hardware()` (NVML and torch's files; no torch import, so
the answer comes in well under a second):

1. the device type: hardware.device=cuda needs a CUDA GPU and a CUDA build of torch here;
2. the ranks: world_size = dp*tp*pp*cp local ranks must fit this machine: one per GPU on CUDA; on CPU at most
   CPU_RANK_CAP = max(4, 2 x cores) gloo ranks (more only time-slice the cores: a 2-core machine runs the 4-rank
   tests in minutes, 64 ranks never finish). A layout over several nodes is launched per node with torchrun;
3. the memory: the estimator's per-rank peak (curry_train.estimator) must fit one local device: a GPU's memory,
   or on CPU the host RAM shared by all ranks.
"""

from __future__ import annotations

from curry_train.config import Config
from curry_train.measure.hardware import HardwareReport, local_hardware

GiB = 2**30


class PreflightError(ValueError):
    """This machine cannot run the config; the message says what it has and which tool or command to use."""


def cpu_rank_cap(cores: int) -> int:
    """Most gloo CPU ranks one machine runs: two per core, at least 4 (the 4-rank tests on a 2-core machine)."""
    return max(4, 2 * cores)


def describe(hw: HardwareReport) -> str:
    ram = f"{hw.memory_bytes / GiB:.0f} GiB RAM" if hw.memory_bytes else "unknown RAM"
    if hw.gpus:
        names = sorted({f"{g.name} ({g.memory_bytes / GiB:.0f} GiB)" for g in hw.gpus})
        return f"{hw.gpu_count} GPU(s): {', '.join(names)}, {hw.cpu_count} CPU cores, {ram}"
    return f"no CUDA GPU, {hw.cpu_count} CPU cores, {ram}"


def _instead(name: str, cfg: Config) -> str:
    n = cfg.hardware.nodes * cfg.hardware.gpus_per_node
    return (f"{name} is a cluster preset: use estimate_memory / plan for it (nothing runs; plan(model='{name}', "
            f"gpus_per_node={cfg.hardware.gpus_per_node}, nodes={cfg.hardware.nodes}, "
            f"gpu_memory_gib={cfg.hardware.gpu_memory_gib:g}, ...) for its {n} devices), or bench a scaled-down copy "
            f"made with update_config (e.g. base='tiny', or base='{name}' with smaller model.d_model / "
            f"model.n_layers, hardware.device=cpu and fewer ranks)")


def preflight(cfg: Config, name: str = "this config", hw: HardwareReport | None = None) -> HardwareReport:
    """Raise PreflightError when this machine cannot run `cfg`; return the local report otherwise."""
    hw = hw or local_hardware()
    here = f"this machine has {describe(hw)}"
    device = cfg.hardware.device
    if device == "auto":
        device = "cuda" if hw.gpu_count and hw.cuda_version else "cpu"
    world = cfg.world_size
    if device == "cuda" and not hw.gpu_count:
        raise PreflightError(f"{name} runs on hardware.device=cuda, but {here}. {_instead(name, cfg)}.")
    if device == "cuda" and not hw.cuda_version:
        raise PreflightError(f"{name} runs on hardware.device=cuda, but torch {hw.torch_version} here is a CPU build "
                             f"({here}). Install a CUDA build of torch, or {_instead(name, cfg)}.")
    cap = hw.gpu_count if device == "cuda" else cpu_rank_cap(hw.cpu_count)
    unit = "GPU(s)" if device == "cuda" else f"CPU ranks (max(4, 2 x {hw.cpu_count} cores))"
    if world > cap:
        multi = ""
        if cfg.hardware.nodes > 1:
            multi = (f" It is a {cfg.hardware.nodes}-node layout: start it on each node with `torchrun "
                     f"--nnodes={cfg.hardware.nodes} --nproc-per-node={cfg.hardware.gpus_per_node} "
                     "--rdzv-endpoint=<host:port> -m curry_train.train --config <file>` "
                     "(curry_train/train/__main__.py).")
        raise PreflightError(f"{name} needs world_size = dp*tp*pp*cp = {world} local ranks, but {here}: at most "
                             f"{cap} {unit}.{multi} Without launching, estimate_memory / plan answer for this "
                             f"layout; to run here, lower parallel.dp / tp / pp / cp to at most {cap} ranks in all "
                             "(overrides, or a copy made with update_config).")
    from curry_train.estimator import estimate

    need = estimate(cfg).memory.total
    if device == "cuda":
        have, what = min(g.memory_bytes for g in hw.gpus), "the smallest local GPU"
    else:
        have, what = (hw.memory_bytes or 0) // max(world, 1), f"host RAM / {world} ranks"
    if have and need > have:
        raise PreflightError(f"{name} needs an estimated {need / GiB:.1f} GiB per rank, but {what} has "
                             f"{have / GiB:.1f} GiB ({here}). {_instead(name, cfg)}.")
    return hw
