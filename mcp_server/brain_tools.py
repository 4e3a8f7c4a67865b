"""The brain's tools: estimate_memory, recommend_next, plan and capacity_sweep.

They decide without training: the estimator, the advisor, the planner and the capacity sweep run in the server in
milliseconds (capacity_sweep's measured mode is the one exception: it runs in a killable worker through app._long).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from curry_train.advice.advisor import Recommendation
from curry_train.advice.export import Framework, LayoutExport
from curry_train.advice.planner import Plan
from curry_train.advice.sweep import SweepResult
from curry_train.config import ConfigError
from curry_train.estimator import GPU_NAMES, Estimate
from curry_train.paths import UnsafeName
from curry_train.store.hf_import import HfImport
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult
from pydantic import AfterValidator, Field

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
    _name_only,
    _preflight,
    _validate,
    mcp,
    root,
    tool_error,
)

_NAMES = ", ".join(GPU_NAMES)  # estimator/profiles.py: the one list of named profiles
Gpu = Annotated[str | None, Field(description=f"The accelerator: one of {_NAMES}. Sets the memory budget AND "
                                              "the speed (plan: the budget is the "
                                              "smaller of its memory and gpu_memory_gib); the answer names the "
                                              "profile used. Omitted: the budget is gpu_memory_gib and the speed "
                                              "is assumed from it, and the answer says so.")]


def _latest_bench(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The newest successful bench of exactly this resolved config, to draw beside an estimate."""
    from curry_train.store.runs import Ledger

    for rec in Ledger(root()).list(200):
        if rec.kind == "bench" and rec.status == "ok" and rec.config == cfg_dict:
            return rec.metrics
    return None


def _memory_png(est: Estimate, cfg: Any, name: str) -> bytes:
    from curry_train.plots import layout_title, memory_breakdown_png

    bars = {"estimate": est.memory.by_category()}
    peaks = {"estimate": est.memory.total}
    measured = _latest_bench(cfg.to_dict())
    if measured and measured.get("memory_breakdown"):
        bars["measured"] = measured["memory_breakdown"]
        peaks["measured"] = measured.get("peak_memory_bytes") or 0
    title = f"{layout_title(name, cfg.parallel.model_dump())}, estimate ({est.hardware.name} profile)"
    return memory_breakdown_png(bars, title=title, budget_bytes=est.budget_bytes, usable_bytes=est.usable_bytes,
                                peaks=peaks)


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
def estimate_memory(
    config: ConfigName,
    overrides: Overrides = {},  # noqa: B006
    hardware: Annotated[str | None, Field(description=f"Speed profile for the step-time estimate: one of {_NAMES} "
                                                      "(default: guessed from the config). It "
                                                      "does not change the memory budget, which is the config's "
                                                      "hardware.gpu_memory_gib (set it in overrides); the result's "
                                                      "budget_bytes and hardware_note say which were used.")] = None,
    plot: Plot = False,
    gpu: Gpu = None,
) -> Annotated[CallToolResult, Estimate]:
    """Predict per-rank memory (params, grads, optimizer, activations, other, total) for the rank with the largest
    total, whether it fits hardware.gpu_memory_gib, the parameter count, FLOPs per token, communication per
    primitive and a step-time estimate, in milliseconds and without running anything. Memory comes in the same
    categories bench measures (params, param_copies, grads, grad_buffers, optimizer, activations, loss,
    pp_buffers, other). Answers for any cluster (a preset such as llama3-8b needs no GPU here). Models this
    template's actual implementation; check it against bench before trusting a big decision."""
    from curry_train.estimator import estimate_memory as est_fn
    from curry_train.measure.service import resolve

    try:
        cfg, name = resolve(config, overrides, root())
        est = est_fn(cfg, hardware=hardware, gpu=gpu)
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError) as e:
        raise tool_error(e) from None
    return _json_result(est, _memory_png(est, cfg, name) if plot else None)


@mcp.tool(annotations=READ_ONLY)
def recommend_next(
    config: ConfigName,
    symptom: Annotated[Literal["oom", "slow", "none"] | None, Field(
        description="What goes wrong: oom, slow or none. Omit it to derive it from the estimate.")] = None,
    overrides: Overrides = {},  # noqa: B006
    measured_peak_bytes: Annotated[int | None, Field(
        gt=0, description="bench's peak_memory_bytes: over the usable budget it is an OOM whatever the symptom; "
                          "with symptom=oom it sizes the reduction.")] = None,
    hardware: Annotated[str | None, Field(description=f"Speed profile: one of {_NAMES} (default: "
                                                      "guessed from the config). The memory budget stays the "
                                                      "config's hardware.gpu_memory_gib (set it in overrides).")]
    = None,
    gpu: Gpu = None,
) -> Recommendation:
    """The next rung of the parallelism ladder for this config: ONE primitive (recompute, zero1/2/3, tp, pp, ep,
    cp, dp or none) with the reason in numbers, the config_patch to apply with update_config, the expected memory
    and throughput change, the rungs it rejected, and the white-box check to run after applying it. It follows
    the ladder: recompute before more GPUs, the lowest ZeRO stage that fits, TP only after full sharding within a
    node, PP only across nodes, EP only for MoE, CP only for long sequences; it says when only more GPUs help.
    `evidence` says what shows an OOM (estimate, measurement, a reported OOM inside the estimator's error band, or
    unconfirmed: then `if_confirmed` is the rung to take once a measurement confirms it); `improvement` marks an
    optional speed-up of a layout that fits and runs. When only more GPUs help, `one_gpu` says what fits on one GPU
    and the options outside this template (LoRA, QLoRA, 8-bit AdamW, CPU/NVMe offload) with their memory."""
    from curry_train.advice.advisor import recommend_next as advise
    from curry_train.estimator.profiles import gpu_budget
    from curry_train.measure.service import resolve

    try:
        hardware, budget = gpu_budget(gpu, None, hardware)  # an unknown gpu fails here, listing the valid names
        if budget is not None:  # the named GPU's memory is the budget
            overrides = {**overrides, "hardware.gpu_memory_gib": budget}
        resolve(config, overrides, root())  # unknown names and invalid overrides fail with their fix
        return advise(config, symptom, overrides, hardware=hardware, measured_peak_bytes=measured_peak_bytes,
                      root=root())
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError) as e:
        raise tool_error(e) from None


def _plan_png(p: Plan) -> bytes:
    """The pipeline timeline of the final layout (its bubble), or its memory breakdown when it has no pipeline."""
    from curry_train.plots import layout_title, memory_breakdown_png, pipeline_timeline_png

    f = p.final
    if f.get("pp", 1) > 1:
        m = p.global_batch // (f.get("dp", 1) * p.micro_batch)
        return pipeline_timeline_png(f["pp"], m, f.get("pp_schedule", "1f1b"), f.get("pp_virtual", 1))
    last = p.rungs[-1]
    comp = {k: v * 2**30 for k, v in last.memory_gib.items() if k != "total"}
    title = f"{layout_title(p.model, f)} on {p.gpus} GPUs (no pipeline), estimate"
    usable = p.usable_gib * 2**30  # budget minus the final layout's own reserve, as the planner fitted it
    return memory_breakdown_png({"estimate": comp}, title=title, budget_bytes=p.gpu_memory_gib * 2**30,
                                usable_bytes=usable)


@mcp.tool(annotations=READ_ONLY, meta=BIG_RESULT)
def plan(
    model: Annotated[str, AfterValidator(_name_only),
                     Field(description="Config name in configs/ whose model section to plan for (e.g. 'llama3-70b'); "
                                       "not a path.")],
    # the CLI's defaults (curry-train plan --help); tests/test_mcp_server.py checks that they agree
    gpus_per_node: Annotated[int, Field(ge=1, le=1024, description="Accelerators per node.")] = 8,
    nodes: Annotated[int, Field(ge=1, le=100_000, description="Nodes in the cluster.")] = 1,
    gpu_memory_gib: Annotated[float | None, Field(gt=0, le=4096, description="Memory per accelerator, GiB "
                                                  "(default: the gpu's memory, else 80).")] = None,
    seq_len: Annotated[int | None, Field(ge=2, le=10_000_000, description="Tokens per sequence (default: the "
                                         "config's).")] = None,
    global_batch: Annotated[int | None, Field(ge=1, le=100_000_000, description="Sequences per optimizer step "
                                              "(default: the config's).")] = None,
    micro_batch: Annotated[int | None, Field(ge=1, description="Sequences per data-parallel rank per forward, kept "
                                                   "on every layout (default: searched).")] = None,
    search_micro_batch: Annotated[bool | None, Field(description="Search the micro-batch (default: only when "
                                                     "micro_batch is not given); a change is stated in hints.")] = None,
    margin: Annotated[float, Field(ge=0.0, lt=1.0, description="Extra fraction of usable memory to keep free, "
                                                               "as the CLI's --margin.")] = 0.0,
    hardware: Annotated[str | None, Field(description=f"Hardware profile: one of {_NAMES} (default: "
                                                      "guessed from gpu_memory_gib).")] = None,
    plot: Annotated[bool, Field(description="Also return a PNG: the pipeline-schedule timeline of the final layout "
                                            "(its bubble), or its memory breakdown without a pipeline.")] = False,
    gpu: Gpu = None,
) -> Annotated[CallToolResult, Plan]:
    """Plan a layout for a model on a cluster without running anything: climb the ladder from plain data
    parallelism one rung at a time (each rung with its per-rank memory and step-time estimate) until it fits and
    is not communication-bound, then rank every valid N-D layout (dp x tp x pp x cp, ZeRO stage, recompute,
    pipeline schedule) that fits by estimated step time. Returns the rungs, `final` (the parallel section to put
    in a config) and whether it fits."""
    from curry_train.advice.planner import plan as make_plan
    from curry_train.estimator.profiles import gpu_budget

    try:
        # a named gpu sets the speed, and the budget where its memory is below gpu_memory_gib
        hardware, budget = gpu_budget(gpu, gpu_memory_gib, hardware)
        p = make_plan(model, gpus_per_node, nodes, budget, seq_len, global_batch, micro_batch=micro_batch,
                      search_micro_batch=search_micro_batch, margin=margin, hardware=hardware, root=root())
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError, ValueError) as e:
        raise tool_error(e) from None
    return _json_result(p, _plan_png(p) if plot else None)


@mcp.tool(annotations=LAUNCHES, meta=BIG_RESULT)  # measured=true launches ranks and records runs
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
    target model size needs, before picking a primitive. When the config's model fits under no rung, `one_gpu`
    gives the largest model of its shape that fits and the options outside this template, with their memory."""
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
        _preflight(config, overrides)
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


@mcp.tool(annotations=WRITES_CONFIG)
async def import_hf_config(
    path_or_json: Annotated[str, Field(description="A Hugging Face config.json: its path (or its folder) on this "
                                                   "machine, or the JSON text itself. Never fetched from the "
                                                   "network.")],
    name: Annotated[str, AfterValidator(_name_only),
                    Field(description="Config to write: configs/local/<name>.yaml (a plain name, e.g. 'qwen2-72b').")],
    ctx: Context,
    accept: Annotated[list[str], Field(description="Behavioural differences a refusal named that you accept "
                                                   "leaving out (e.g. attention_bias, rope_scaling).")] = [],  # noqa: B006
    seq_len: Annotated[int | None, Field(ge=2, description="train.seq_len (default: the existing config's, or "
                                                           "min(4096, max_position_embeddings)).")] = None,
) -> HfImport:
    """Write a config from a Llama, Mistral, Mixtral, Qwen2, Gemma or DeepSeek-V3 config.json: every field the
    template models (layers, hidden, FFN, heads, KV heads, vocabulary, RoPE theta, norm eps, experts, top-k).
    What the template cannot express is refused field by field, nothing written: structural differences
    (a tied head, another head_dim) always, behavioural ones (biases, sliding window beyond seq_len, RoPE
    scaling, another activation, DeepSeek-V3's sigmoid router and MTP layer) unless named in `accept`. Then
    estimate_memory, plan or export_layout it by name."""
    from curry_train.store.hf_import import import_hf_config as do_import

    try:
        out = do_import(path_or_json, name, accept=accept, seq_len=seq_len, root=root())
    except (ConfigError, UnsafeName, FileNotFoundError) as e:
        raise tool_error(e) from None
    if out.created:
        from .resources import announce_config

        await announce_config(out.name, ctx)
    return out


@mcp.tool(annotations=READ_ONLY)
def export_layout(
    config: ConfigName,
    framework: Annotated[Framework, Field(description="The framework you train with: torchtitan (job TOML), "
                                                      "megatron (pretrain_gpt.py arguments), deepspeed "
                                                      "(ds_config JSON) or accelerate (FSDP config YAML).")],
    overrides: Overrides = {},  # noqa: B006
) -> LayoutExport:
    """The config's layout (parallel degrees, ZeRO/FSDP, recompute, pipeline schedule, micro/global batch) as
    the target framework's own config text, with what the target cannot express and how its per-rank memory
    differs from this template's estimate. Pass plan's final_patch as overrides to export a plan's layout."""
    from curry_train.advice.export import export_layout as do_export

    try:
        return do_export(config, framework, overrides, root=root())
    except (ConfigError, UnsafeName, FileNotFoundError, KeyError) as e:
        raise tool_error(e) from None
