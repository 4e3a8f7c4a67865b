"""`climb`, the main job over MCP: the CLI's `curry-train climb` in a killable worker, one progress line per step.

The worker runs `curry_train.cli.climb.climb` itself, so a climb over MCP writes the same configs
(configs/local/<base>-climb.yaml and its history), records the same runs in the ledger and chains the same
checkpoints (each rung resumes the one before) as the CLI. Every rung reports progress (recommend, apply, bench,
white-box, verdict) as MCP progress notifications. Cancelling the request, or passing `timeout_s`, stops the
launch in flight (its launcher kills the ranks' process group) and jobs.run_worker kills what is left of the tree.
"""

from __future__ import annotations

from typing import Annotated

from curry_train.cli.climb import ClimbReport
from curry_train.paths import UnsafeName, check_name
from mcp.server.mcpserver import Context
from pydantic import Field

from .app import BIG_RESULT, LAUNCHES, ConfigName, Overrides, TimeoutS, _long, _validate, mcp, tool_error


@mcp.tool(annotations=LAUNCHES, meta=BIG_RESULT)
async def climb(
    config: ConfigName,
    memory_budget: Annotated[int, Field(gt=0, description="Per-rank memory budget in bytes that the climb must "
                                                          "fit, e.g. 1700000 for the README's climb of tiny.")],
    ctx: Context,
    overrides: Overrides = {},  # noqa: B006 - never mutated
    name: Annotated[str | None, Field(description="Config the climb writes, one version per rung (default "
                                                  "<config>-climb); never the base itself.")] = None,
    steps: Annotated[int, Field(ge=1, le=1000, description="Timed bench steps per rung.")] = 3,
    max_rungs: Annotated[int, Field(ge=0, le=64, description="Stop after this many primitives.")] = 8,
    keep_checkpoints: Annotated[bool, Field(description="Keep every rung's checkpoint (12 B/param each); "
                                                        "default: only the latest rung's.")] = False,
    timeout_s: TimeoutS = 3600.0,
) -> ClimbReport:
    """The main job on THIS machine: climb the parallelism ladder from `config` until the measured per-rank peak
    fits `memory_budget` bytes, one primitive per rung: bench -> recommend_next (oom) -> update_config with its
    patch -> bench again, resuming the previous rung's checkpoint so the rungs are one training run ->
    whitebox_compare against one device. It stops when the measurement fits, when parity fails, when the advisor
    has no rung left, or after max_rungs. Returns every rung (primitive, layout, steps trained, predicted and
    measured bytes, parity, runs) and the final layout. Same function, ledger and checkpoints as
    `curry-train climb`; progress arrives per rung; cancelling kills every rank."""
    _validate(config, overrides)
    try:
        if name is not None and check_name(name.removesuffix(".yaml"), "name") == config:
            raise ValueError("the climb never rewrites its base config; pass another name")
    except (UnsafeName, ValueError) as e:
        raise tool_error(e) from None
    args = {"config": config, "memory_budget": memory_budget, "overrides": overrides, "name": name, "steps": steps,
            "max_rungs": max_rungs, "keep_checkpoints": keep_checkpoints}
    out = await _long("climb", args, ctx, deadline_s=timeout_s, label="climb")
    return ClimbReport.model_validate(out)
