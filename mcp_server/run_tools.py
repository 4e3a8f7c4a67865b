"""The tools that run, write or read runs: probe_hardware, bench, whitebox_compare, update_config, runs_diff.

Thin typed adapters over the functions the `curry-train` CLI calls. The long ones (a measured probe, bench,
white-box) run in a killable worker process through app._long, so they report progress, have deadlines and take
the machine's device lock; update_config and runs_diff are cheap and run in the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from curry_train.config import ConfigError
from curry_train.measure.bench import BenchResult
from curry_train.measure.hardware import HardwareReport
from curry_train.paths import UnsafeName, check_name
from curry_train.store.configs import ConfigUpdate
from curry_train.store.runs import RunsDiff
from curry_train.validation.inject import CATALOGUE as INJECTIONS
from curry_train.validation.verdict import Verdict as WhiteboxVerdict
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult
from pydantic import Field

from .app import (
    BIG_RESULT,
    LAUNCHES,
    READ_ONLY,
    WRITES_CONFIG,
    ConfigName,
    Overrides,
    Plot,
    TimeoutS,
    _json_result,
    _long,
    _preflight,
    _validate,
    mcp,
    root,
    tool_error,
)


@mcp.tool(annotations=READ_ONLY)
async def probe_hardware(
    ctx: Context,
    measure: Annotated[bool, Field(description="Also time a matmul per device and an all-reduce across the local "
                                               "ranks (launches processes; takes the device lock).")] = False,
) -> HardwareReport:
    """What THIS machine (the one the server runs on) has: GPUs (name, memory, compute capability, NVLink/PCIe
    topology), CPUs, RAM, torch / CUDA versions, distributed backends and launcher/SLURM environment. bench,
    whitebox_compare and a measured capacity_sweep check every config against this report before launching
    (device type, ranks, memory per rank). It says nothing about a cluster you plan for: ask plan or
    estimate_memory with that cluster's numbers. measure=false answers from NVML and torch's files in well under
    a second (cached); measure=true also times the devices in a worker."""
    if not measure:
        from curry_train.measure.hardware import local_hardware

        return local_hardware()
    out = await _long("probe", {"measure": measure}, ctx, deadline_s=300.0, label="probe_hardware")
    return HardwareReport.model_validate(out)


@mcp.tool(annotations=LAUNCHES, meta=BIG_RESULT)
async def bench(
    config: ConfigName,
    ctx: Context,
    steps: Annotated[int, Field(ge=1, le=1000, description="Timed optimizer steps (median reported).")] = 5,
    warmup: Annotated[int, Field(ge=0, le=100, description="Untimed steps first (compile, allocator warm-up).")] = 1,
    overrides: Overrides = {},  # noqa: B006 - never mutated; shows as {} in the schema
    plot: Plot = False,
    timeout_s: TimeoutS = 900.0,
    micro_batches: Annotated[int | None, Field(ge=1, le=4096, description="Micro-batches per rank in each benched "
                                               "step, the layout unchanged (default: 2, or the whole step under a "
                                               "pipeline or when the estimated whole step is at most 30 s).")] = None,
) -> Annotated[CallToolResult, BenchResult]:
    """Run the config on this machine (world_size = dp*tp*pp*cp ranks through torchrun) and measure it: median
    step time, tokens/s, per-rank peak memory in the estimator's categories (params, param_copies, grads,
    grad_buffers, optimizer, activations, loss, pp_buffers, other), losses, OOM, MFU, and the estimator's
    prediction beside the measurement. Recorded as a run (run://<run_id>); compare two with runs_diff. Re-bench
    after every primitive you add. Only for configs this machine can run: a cluster preset (e.g. llama3-8b on a
    CPU machine) is refused at once with what this machine has; ask plan / estimate_memory about it instead."""
    _validate(config, overrides)
    _preflight(config, overrides)
    out = await _long("bench", {"config": config, "steps": steps, "warmup": warmup, "overrides": overrides,
                                "micro_batches": micro_batches}, ctx, deadline_s=timeout_s, label="bench")
    res = BenchResult.model_validate(out)
    image = Path(res.plot_path).read_bytes() if plot and res.plot_path and Path(res.plot_path).is_file() else None
    return _json_result(res, image)


@mcp.tool(annotations=LAUNCHES)
async def whitebox_compare(
    config: ConfigName,
    ctx: Context,
    steps: Annotated[int | None, Field(ge=1, le=50, description="Optimizer steps to compare (2 or more also exercise "
                                                                "the optimizer state). Default: 2, or through the "
                                                                "first step after the lr warm-up (at most 8).")] = None,
    overrides: Overrides = {},  # noqa: B006
    timeout_s: TimeoutS = 900.0,
    inject: Annotated[str | None, Field(description="Plant one known bug in the parallel run only, to demonstrate "
                                                    "that the check catches it (the verdict must fail): "
                                                    + ", ".join(INJECTIONS) + ". Each needs its layout, e.g. "
                                                    "data-same-rows needs parallel.dp >= 2.")] = None,
    resume_from_layout: Annotated[str | None, Field(description="Resume white-box: the layout that trains 2 steps "
                                                                "and saves a checkpoint (KEY=VALUE,... of the "
                                                                "parallel section, e.g. 'dp=2,zero=3', or 'single'); "
                                                                "`config` + `overrides` then resume it for `steps` "
                                                                "(default 2) more. The loaded weights and AdamW "
                                                                "state must be the saved ones bit for bit and the "
                                                                "resumed steps match one device.")] = None,
) -> WhiteboxVerdict:
    """Prove a parallel layout computes what one device computes: runs the config on its ranks and a single-process
    reference from the same seed and data, then compares the loss, every gradient (gathered to full shape) and
    every rank's parameters after each update. Returns passed/failed, the worst parameter, the first diverging
    layer and any diverging rank. Run it after every primitive you add, before trusting its speed or memory
    numbers; with `inject` it demonstrates a failure on purpose. Runs on this machine: configs it cannot run are
    refused before launching, as bench does."""
    _validate(config, overrides)
    if inject is not None:
        from curry_train.measure.service import resolve
        from curry_train.validation.inject import InjectionError, check

        try:
            check(inject, resolve(config, overrides, root())[0], resume=resume_from_layout is not None)
        except InjectionError as e:
            raise tool_error(e) from None
    _preflight(config, overrides)
    out = await _long("whitebox", {"config": config, "steps": steps, "overrides": overrides, "inject": inject,
                                   "resume_from_layout": resume_from_layout}, ctx,
                      deadline_s=timeout_s, label="whitebox_compare")
    return WhiteboxVerdict.model_validate(out)


@mcp.tool(annotations=WRITES_CONFIG)
async def update_config(
    name: Annotated[str, Field(description="Config to write: configs/local/<name>.yaml (a plain name such as "
                                           "'tiny-zero2').")],
    changes: Annotated[dict[str, Any], Field(description='Dotted keys to set, e.g. {"parallel.zero": 2, '
                                                         '"parallel.dp": 4}.')],
    ctx: Context,
    base: Annotated[str | None, Field(description="Start from this config instead of the current <name> "
                                                  "(required when <name> does not exist yet).")] = None,
) -> ConfigUpdate:
    """Validate, then write configs/local/<name>.yaml atomically (the presets in configs/ are never written), keeping
    the previous version in configs/local/.history/.
    Returns the path, the resolved config and the diff. An invalid config writes nothing and the error names each
    field and its fix. Use it to apply the patch recommend_next proposes, one primitive at a time. A new config
    appears in resources/list at once (the server sends notifications/resources/list_changed)."""
    from curry_train.store.configs import update_config as store

    try:
        # name each argument in the refusal ("base 'x' is not allowed"), not only "config name"
        for arg, value in (("name", name), ("base", base)):
            if value is not None:
                check_name(value.removesuffix(".yaml"), arg)
        out = store(name, changes, base, root=root())
    except (ConfigError, UnsafeName, FileNotFoundError) as e:
        raise tool_error(e) from None
    if out.created:
        from .resources import announce_config

        await announce_config(Path(out.path).stem, ctx)
    return out


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
def runs_diff(
    run_a: Annotated[str, Field(description="Baseline run id (from bench / whitebox_compare, or run://index).")],
    run_b: Annotated[str, Field(description="Candidate run id.")],
) -> RunsDiff:
    """Compare two recorded runs: the config keys that differ and the metrics that changed (b/a ratio), without
    bookkeeping (run ids, timings of the call, per-step lists), and a one-line verdict: step time, throughput,
    peak memory by category, and whether the losses match or by how much they differ. Diffing a bench with a
    whitebox_compare run is allowed but the verdict says the kinds differ, so their metrics do not compare."""
    from curry_train.store.runs import Ledger, diff_runs

    try:
        for arg, value in (("run_a", run_a), ("run_b", run_b)):
            check_name(value, f"{arg} (a run id)")
        ledger = Ledger(root())
        return diff_runs(ledger.get(run_a), ledger.get(run_b))
    except UnsafeName as e:  # not tool_error(): its hint is about config names
        raise ToolError(f"{e}. Run ids look like bench-20260101-120000-ab12cd; list them with run://index.") from None
    except KeyError as e:
        raise tool_error(e) from None
