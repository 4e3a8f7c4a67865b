"""curryTrain's MCP server: thin typed adapters over the same functions the `curry-train` CLI calls.

    curry-train mcp                      # stdio (what Claude Code / Desktop start)
    curry-train mcp --http --port 8765   # streamable HTTP on 127.0.0.1 with DNS-rebinding protection

Tools take a config NAME from configs/ (never a path) and dotted `overrides` applied without writing anything.
Cheap tools (estimates, plans, diffs, config writes) run in the server; long ones (bench, white-box, measured
probe and sweep) run in a killable worker process (jobs.py): they report progress, have deadlines, are cancelled
by killing their whole process tree, and take the machine's device lock so they never share the accelerators.
torch is never imported here, so `tools/list` answers within a second of start.
Errors the model can act on are ToolErrors that say what to do next.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from curry_train.advice.advisor import Recommendation
from curry_train.advice.planner import Plan
from curry_train.advice.sweep import SweepResult
from curry_train.config import ConfigError
from curry_train.estimator import Estimate
from curry_train.measure.bench import BenchResult
from curry_train.measure.hardware import HardwareReport
from curry_train.paths import UnsafeName, check_name, configs_dir, project_root
from curry_train.store.configs import ConfigUpdate
from curry_train.store.runs import RunsDiff
from curry_train.validation.inject import CATALOGUE as INJECTIONS
from curry_train.validation.verdict import Verdict as WhiteboxVerdict
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import AfterValidator, BaseModel, Field

from .jobs import WorkerError, run_worker
from .skills_ext import SkillsExtension

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
SKILLS_DIR = REPO / "skills"

INSTRUCTIONS = """curryTrain adds distributed-training parallelism one primitive at a time, on a real PyTorch template.
Read skill://stage4-parallel-primitive-intro/SKILL.md first. The procedure: probe_hardware -> bench the current
config -> recommend_next -> update_config with the recommended patch (one primitive) -> bench again ->
whitebox_compare to prove the parallel run matches one device -> runs_diff the two benches. Measure before
recommending; never stack two primitives without a white-box check between them. `config` arguments are names
in configs/ (see config://index); `overrides` are dotted keys (e.g. {"parallel.dp": 2}) applied without writing.
Long tools report progress; if your host times out, raise MCP_TOOL_TIMEOUT or poll run://index for the run."""

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
MEASURES = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
WRITES_CONFIG = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                open_world_hint=False)
BIG_RESULT = {"anthropic/maxResultSizeChars": 200_000}

mcp = MCPServer("curry-train", version="0.1.0", instructions=INSTRUCTIONS,
                extensions=[SkillsExtension(SKILLS_DIR)])


def _name_only(value: str) -> str:
    """A config argument is a name, never a path: '/', '..' and the like are refused before any file is read."""
    return check_name(value, "config name")


ConfigName = Annotated[str, AfterValidator(_name_only),
                       Field(description="Name of a config in configs/ (e.g. 'tiny', 'llama3-8b'); not a path. "
                                         "List them with the config://index resource.")]
Overrides = Annotated[dict[str, Any], Field(description="Dotted overrides applied without writing the file, e.g. "
                                                        '{"parallel.dp": 2, "parallel.zero": 3}.')]
TimeoutS = Annotated[float, Field(gt=0, le=24 * 3600, description="Deadline in seconds; every rank is killed when "
                                                                  "it passes.")]
Plot = Annotated[bool, Field(description="Also return a PNG (per-rank memory, estimate vs measured).")]


def root() -> str:
    """The project folder holding configs/ and runs/ ($CURRY_TRAIN_ROOT, else the current or checkout folder)."""
    return str(project_root(os.environ.get("CURRY_TRAIN_ROOT") or None))


def _available() -> str:
    return ", ".join(sorted(p.stem for p in configs_dir(root()).glob("*.yaml"))) or "(none)"


def tool_error(e: BaseException) -> ToolError:
    """A user-fixable error, phrased with the next step."""
    if isinstance(e, ConfigError):
        return ToolError(f"{e}\nFix the listed fields (in `overrides` or with update_config) and call again.")
    if isinstance(e, UnsafeName):
        return ToolError(f"{e}. Config arguments are names from config://index ({_available()}), not paths.")
    if isinstance(e, FileNotFoundError):
        return ToolError(str(e).strip("'\""))
    if isinstance(e, KeyError):
        return ToolError(str(e.args[0]) if e.args else str(e))
    return ToolError(str(e))


def _validate(config: str, overrides: dict[str, Any]) -> None:
    from curry_train.measure.service import resolve

    try:
        resolve(config, overrides, root())
    except (ConfigError, UnsafeName, FileNotFoundError) as e:
        raise tool_error(e) from None


async def _long(task: str, args: dict[str, Any], ctx: Context, *, deadline_s: float, label: str) -> dict[str, Any]:
    # probe_hardware has no timeout_s or steps to change: its hints say what it does have
    retry = ("Retry; if it keeps timing out, call probe_hardware with measure=false." if label == "probe_hardware"
             else "Retry with fewer steps or a larger timeout_s.")
    try:
        return await run_worker(task, args, ctx=ctx, deadline_s=deadline_s, label=label, root=root())
    except TimeoutError:
        raise ToolError(f"{label} passed its {deadline_s:.0f}s deadline; every process it started was killed. "
                        f"{retry}") from None
    except WorkerError as e:
        if e.kind == "invalid":
            raise ToolError(f"{e.message}\nFix the arguments and call again.") from None
        if e.kind == "busy":
            raise ToolError(f"{e.message}. Another long job holds the device; retry when it finishes.") from None
        if e.kind == "failed":
            if "timed out" in e.message:
                hint = retry
            elif "OutOfMemoryError" in e.message or "out of memory" in e.message.lower():
                hint = ("A rank ran out of memory: call recommend_next with symptom='oom' for the primitive that "
                        "fits, or estimate_memory to see where the memory goes.")
            else:
                hint = "Read the failing rank's error above; fix the config or report it as a bug."
            raise ToolError(f"{label} failed: {e.message[:6000]}\n{hint}") from None
        if e.kind == "cancelled":
            raise ToolError(f"{label} was cancelled; every rank was killed.") from None
        raise ToolError(f"{label} hit an internal error: {e.message[:2000]}. The traceback is in the server log.") \
            from None


def _json_result(model: BaseModel, image: bytes | None = None) -> CallToolResult:
    data = model.model_dump(mode="json", by_alias=True)
    content: list[Any] = [TextContent(type="text", text=json.dumps(data, default=str))]
    if image is not None:
        import base64

        content.append(ImageContent(type="image", mime_type="image/png", data=base64.b64encode(image).decode()))
    return CallToolResult(content=content, structured_content=data)


# ------------------------------------------------------------------------------------------------ tools


@mcp.tool(annotations=READ_ONLY)
async def probe_hardware(
    ctx: Context,
    measure: Annotated[bool, Field(description="Also time a matmul per device and an all-reduce across the local "
                                               "ranks (launches processes; takes the device lock).")] = False,
) -> HardwareReport:
    """What this machine has: GPUs (name, memory, compute capability, NVLink/PCIe topology), CPUs, RAM, torch /
    CUDA / NCCL versions, distributed backends and launcher/SLURM environment. Call it first: the estimate, plan
    and bench tools need to know the device memory and how the GPUs are linked."""
    out = await _long("probe", {"measure": measure}, ctx, deadline_s=300.0 if measure else 60.0,
                      label="probe_hardware")
    return HardwareReport.model_validate(out)


@mcp.tool(annotations=MEASURES, meta=BIG_RESULT)
async def bench(
    config: ConfigName,
    ctx: Context,
    steps: Annotated[int, Field(ge=1, le=1000, description="Timed optimizer steps (median reported).")] = 5,
    warmup: Annotated[int, Field(ge=0, le=100, description="Untimed steps first (compile, allocator warm-up).")] = 1,
    overrides: Overrides = {},  # noqa: B006 - never mutated; shows as {} in the schema
    plot: Plot = False,
    timeout_s: TimeoutS = 900.0,
) -> Annotated[CallToolResult, BenchResult]:
    """Run the config on this machine (world_size = dp*tp*pp*cp ranks through torchrun) and measure it: median
    step time, tokens/s, per-rank peak memory split into params/grads/optimizer/activations/other, losses, OOM,
    MFU, and the estimator's prediction beside the measurement. Recorded as a run (run://<run_id>); compare two
    with runs_diff. Re-bench after every primitive you add."""
    _validate(config, overrides)
    out = await _long("bench", {"config": config, "steps": steps, "warmup": warmup, "overrides": overrides}, ctx,
                      deadline_s=timeout_s, label="bench")
    res = BenchResult.model_validate(out)
    image = Path(res.plot_path).read_bytes() if plot and res.plot_path and Path(res.plot_path).is_file() else None
    return _json_result(res, image)


@mcp.tool(annotations=READ_ONLY)
async def whitebox_compare(
    config: ConfigName,
    ctx: Context,
    steps: Annotated[int, Field(ge=1, le=50, description="Optimizer steps to compare (2 also exercises the "
                                                         "optimizer state).")] = 2,
    overrides: Overrides = {},  # noqa: B006
    timeout_s: TimeoutS = 900.0,
    inject: Annotated[str | None, Field(description="Plant one known bug in the parallel run only, to demonstrate "
                                                    "that the check catches it (the verdict must fail): "
                                                    + ", ".join(INJECTIONS) + ". Each needs its layout, e.g. "
                                                    "data-same-rows needs parallel.dp >= 2.")] = None,
) -> WhiteboxVerdict:
    """Prove a parallel layout computes what one device computes: runs the config on its ranks and a single-process
    reference from the same seed and data, then compares the loss, every gradient (gathered to full shape) and
    every rank's parameters after each update. Returns passed/failed, the worst parameter, the first diverging
    layer and any diverging rank. Run it after every primitive you add, before trusting its speed or memory
    numbers; with `inject` it demonstrates a failure on purpose."""
    _validate(config, overrides)
    if inject is not None:
        from curry_train.measure.service import resolve
        from curry_train.validation.inject import InjectionError, check

        try:
            check(inject, resolve(config, overrides, root())[0])
        except InjectionError as e:
            raise tool_error(e) from None
    out = await _long("whitebox", {"config": config, "steps": steps, "overrides": overrides, "inject": inject}, ctx,
                      deadline_s=timeout_s, label="whitebox_compare")
    return WhiteboxVerdict.model_validate(out)


@mcp.tool(annotations=WRITES_CONFIG)
def update_config(
    name: Annotated[str, Field(description="Config to write: configs/<name>.yaml (a plain name such as "
                                           "'tiny-zero2').")],
    changes: Annotated[dict[str, Any], Field(description='Dotted keys to set, e.g. {"parallel.zero": 2, '
                                                         '"parallel.dp": 4}.')],
    base: Annotated[str | None, Field(description="Start from this config instead of the current <name> "
                                                  "(required when <name> does not exist yet).")] = None,
) -> ConfigUpdate:
    """Validate, then write configs/<name>.yaml atomically, keeping the previous version in configs/.history/.
    Returns the path, the resolved config and the diff. An invalid config writes nothing and the error names each
    field and its fix. Use it to apply the patch recommend_next proposes, one primitive at a time."""
    from curry_train.store.configs import update_config as store

    try:
        # name each argument in the refusal ("base 'x' is not allowed"), not only "config name"
        for arg, value in (("name", name), ("base", base)):
            if value is not None:
                check_name(value.removesuffix(".yaml"), arg)
        return store(name, changes, base, root=root())
    except (ConfigError, UnsafeName, FileNotFoundError) as e:
        raise tool_error(e) from None


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
def runs_diff(
    run_a: Annotated[str, Field(description="Baseline run id (from bench / whitebox_compare, or run://index).")],
    run_b: Annotated[str, Field(description="Candidate run id.")],
) -> RunsDiff:
    """Compare two recorded runs: every config key that differs, every metric side by side with its b/a ratio,
    and a one-line verdict (step time, throughput, peak memory, identical losses)."""
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


# ------------------------------------------------------------------------------------------------ the brain


def _latest_bench(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The newest successful bench of exactly this resolved config, to draw beside an estimate."""
    from curry_train.store.runs import Ledger

    for rec in Ledger(root()).list(200):
        if rec.kind == "bench" and rec.status == "ok" and rec.config == cfg_dict:
            return rec.metrics
    return None


def _memory_png(est: Estimate, cfg: Any, title: str) -> bytes:
    from curry_train.plots import memory_breakdown_png

    bars = {"estimate": est.memory.model_dump()}
    peaks = {"estimate": est.memory.total}
    measured = _latest_bench(cfg.to_dict())
    if measured and measured.get("memory_breakdown"):
        bars["measured"] = measured["memory_breakdown"]
        peaks["measured"] = measured.get("peak_memory_bytes") or 0
    return memory_breakdown_png(bars, title=title, budget_bytes=est.usable_bytes, peaks=peaks)


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
def estimate_memory(
    config: ConfigName,
    overrides: Overrides = {},  # noqa: B006
    hardware: Annotated[str | None, Field(description="Hardware profile to time it on: A100-40, A100-80, H100, "
                                                      "H200 or CPU (default: guessed from the config).")] = None,
    plot: Plot = False,
) -> Annotated[CallToolResult, Estimate]:
    """Predict per-rank memory (params, grads, optimizer, activations, other, total) for the rank with the largest
    total, whether it fits hardware.gpu_memory_gib, the parameter count, FLOPs per token, communication per
    primitive and a step-time estimate, in milliseconds and without running anything. Models this template's
    actual implementation (what bench measures); check it against bench before trusting a big decision."""
    from curry_train.estimator import estimate_memory as est_fn
    from curry_train.measure.service import resolve

    try:
        cfg, name = resolve(config, overrides, root())
        est = est_fn(cfg, hardware=hardware)
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError) as e:
        raise tool_error(e) from None
    image = None
    if plot:
        p = cfg.parallel
        image = _memory_png(est, cfg, f"{name} DP={p.dp} ZERO={p.zero} TP={p.tp} PP={p.pp} CP={p.cp} ESTIMATE")
    return _json_result(est, image)


@mcp.tool(annotations=READ_ONLY)
def recommend_next(
    config: ConfigName,
    symptom: Annotated[Literal["oom", "slow", "none"] | None, Field(
        description="What goes wrong: oom, slow or none. Omit it to derive it from the estimate.")] = None,
    overrides: Overrides = {},  # noqa: B006
    measured_peak_bytes: Annotated[int | None, Field(
        gt=0, description="bench's peak_memory_bytes, when a measurement says OOM but the estimate fits.")] = None,
    hardware: Annotated[str | None, Field(description="Hardware profile: A100-40, A100-80, H100, H200 or CPU "
                                                      "(default: guessed from the config).")] = None,
) -> Recommendation:
    """The next rung of the parallelism ladder for this config: ONE primitive (recompute, zero1/2/3, tp, pp, ep,
    cp, dp or none) with the reason in numbers, the config_patch to apply with update_config, the expected memory
    and throughput change, the rungs it rejected, and the white-box check to run after applying it. It follows
    the ladder: recompute before more GPUs, the lowest ZeRO stage that fits, TP only after full sharding within a
    node, PP only across nodes, EP only for MoE, CP only for long sequences; it says when only more GPUs help."""
    from curry_train.advice.advisor import recommend_next as advise
    from curry_train.measure.service import resolve

    try:
        resolve(config, overrides, root())  # unknown names and invalid overrides fail with their fix
        return advise(config, symptom, overrides, hardware=hardware, measured_peak_bytes=measured_peak_bytes,
                      root=root())
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError) as e:
        raise tool_error(e) from None


def _plan_png(p: Plan) -> bytes:
    """The pipeline timeline of the final layout (its bubble), or its memory breakdown when it has no pipeline."""
    from curry_train.plots import memory_breakdown_png, pipeline_timeline_png

    f = p.final
    if f.get("pp", 1) > 1:
        m = p.global_batch // (f.get("dp", 1) * p.micro_batch)
        return pipeline_timeline_png(f["pp"], m, f.get("pp_schedule", "1f1b"), f.get("pp_virtual", 1))
    last = p.rungs[-1]
    comp = {k: v * 2**30 for k, v in last.memory_gib.items()}
    title = f"{p.model} ON {p.gpus} GPUS: DP={f.get('dp')} ZERO={f.get('zero')} TP={f.get('tp')} (NO PIPELINE)"
    return memory_breakdown_png({"estimate": comp}, title=title, budget_bytes=p.gpu_memory_gib * 2**30)


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
def plan(
    model: Annotated[str, AfterValidator(_name_only),
                     Field(description="Config name in configs/ whose model section to plan for (e.g. 'llama3-70b'); "
                                       "not a path.")],
    gpus_per_node: Annotated[int, Field(ge=1, le=1024, description="Accelerators per node.")],
    nodes: Annotated[int, Field(ge=1, le=100_000, description="Nodes in the cluster.")],
    gpu_memory_gib: Annotated[float, Field(gt=0, le=4096, description="Memory per accelerator, GiB (e.g. 80).")],
    seq_len: Annotated[int, Field(ge=2, le=10_000_000, description="Tokens per sequence.")],
    global_batch: Annotated[int, Field(ge=1, le=100_000_000, description="Sequences per optimizer step.")],
    micro_batch: Annotated[int, Field(ge=1, description="Sequences per data-parallel rank per forward.")] = 1,
    hardware: Annotated[str | None, Field(description="Hardware profile: A100-40, A100-80, H100, H200 (default: "
                                                      "guessed from gpu_memory_gib).")] = None,
    plot: Annotated[bool, Field(description="Also return a PNG: the pipeline-schedule timeline of the final layout "
                                            "(its bubble), or its memory breakdown without a pipeline.")] = False,
) -> Annotated[CallToolResult, Plan]:
    """Plan a layout for a model on a cluster without running anything: climb the ladder from plain data
    parallelism one rung at a time (each rung with its per-rank memory and step-time estimate) until it fits and
    is not communication-bound, then rank every valid N-D layout (dp x tp x pp x cp, ZeRO stage, recompute,
    pipeline schedule) that fits by estimated step time. Returns the rungs, `final` (the parallel section to put
    in a config) and whether it fits."""
    from curry_train.advice.planner import plan as make_plan

    try:
        p = make_plan(model, gpus_per_node, nodes, gpu_memory_gib, seq_len, global_batch, micro_batch=micro_batch,
                      hardware=hardware, root=root())
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError, ValueError) as e:
        raise tool_error(e) from None
    return _json_result(p, _plan_png(p) if plot else None)


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
async def capacity_sweep(
    config: ConfigName,
    ctx: Context,
    overrides: Overrides = {},  # noqa: B006
    measured: Annotated[bool, Field(description="Verify with real runs on this machine (binary search around the "
                                                "estimate; launches ranks, takes the device lock). Default: "
                                                "estimator only, milliseconds.")] = False,
    rungs: Annotated[list[str] | None, Field(description="Only these rungs, by label: single, single+recompute, "
                                                         "ddp, zero1, zero2, zero3, zero3+recompute, tp<t>, "
                                                         "ep<e>, tp<t>+pp<p> (default: every rung the hardware "
                                                         "allows).")] = None,
    max_micro_batch: Annotated[int, Field(ge=1, le=1 << 20, description="Upper end of the micro-batch search.")]
    = 4096,
    max_runs_per_rung: Annotated[int, Field(ge=1, le=64, description="Measured mode: real runs per search.")] = 8,
    timeout_s: TimeoutS = 1800.0,
) -> SweepResult:
    """Under each rung of the ladder (one device, + recompute, DDP, ZeRO-1/2/3, + TP, + PP), the largest
    micro-batch and the largest model of the config's width x depth family that fit the per-rank budget
    (hardware.gpu_memory_gib). Use it to find where single-device training stops fitting and which rung a
    target model size needs, before picking a primitive."""
    args = {"config": config, "overrides": overrides, "rungs": rungs, "max_micro_batch": max_micro_batch,
            "max_runs_per_rung": max_runs_per_rung}
    _validate(config, overrides)
    if rungs:
        from curry_train.advice.sweep import ladder_rungs
        from curry_train.measure.service import resolve

        known = [label for label, _ in ladder_rungs(resolve(config, overrides, root())[0])]
        if unknown := [r for r in rungs if r not in known]:
            raise ToolError(f"unknown rung(s) {unknown}; this config's hardware allows: {', '.join(known)}")
    if measured:
        out = await _long("sweep", args, ctx, deadline_s=timeout_s, label="capacity_sweep")
        return SweepResult.model_validate(out)
    import anyio
    from curry_train.advice.sweep import capacity_sweep as sweep

    def run() -> SweepResult:
        return sweep(config, overrides, rungs=rungs, max_micro_batch=max_micro_batch, root=root())

    try:
        return await anyio.to_thread.run_sync(run)
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError, ValueError) as e:
        raise tool_error(e) from None


def _refuse_unknown_arguments() -> None:
    """Make every tool refuse arguments it does not take, naming them and the ones it does.

    The SDK's argument models ignore unknown keys, so a typo ({"step": 3} for "steps", "override" for
    "overrides") silently ran a different bench than the caller asked for and reported it as theirs (found by
    tests/reliability/test_fuzz_tools.py). The schema says so too (additionalProperties: false). This reaches into
    the tool manager (mcp 2.3, no public hook for it); the reliability tests fail if that stops working.
    """
    from pydantic import create_model, model_validator

    for tool in mcp._tool_manager.list_tools():
        base = tool.fn_metadata.arg_model
        known = tuple(sorted(f.alias or n for n, f in base.model_fields.items()))

        def check(cls: type, data: Any, known: tuple[str, ...] = known, name: str = tool.name) -> Any:
            if isinstance(data, dict) and (unknown := sorted(str(k) for k in set(data) - set(known))):
                raise ValueError(f"unknown argument(s) {unknown}: {name} takes only {', '.join(known)}; "
                                 "fix the spelling or drop them")
            return data

        tool.fn_metadata.arg_model = create_model(
            base.__name__, __base__=base, __validators__={"_known_arguments": model_validator(mode="before")(check)})
        tool.parameters["additionalProperties"] = False


_refuse_unknown_arguments()

# Resources (skill://, config://, run://) and the diagnose_scaling prompt register themselves on `mcp`.
from . import resources  # noqa: E402,F401

resources.register_configs()
