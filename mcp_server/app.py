"""The one MCPServer instance and what every tool adapter shares: the project root, the argument types, the error
wording and the long-job runner.

The adapters (run_tools.py, brain_tools.py) and the resources (resources.py) register on `mcp` from here; server.py
imports them all, so importing `curry_train_mcp.server` gives the complete server. Nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

from curry_train.config import ConfigError
from curry_train.paths import UnsafeName, check_name, config_names, project_root
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
Which tool answers which question:
- About a cluster (a preset such as llama3-8b, "N GPUs", another machine): plan and estimate_memory (pure
  arithmetic, milliseconds, nothing launched), recommend_next and capacity_sweep without `measured`.
- About THIS machine (what it has, how a config runs here, whether a layout is correct): probe_hardware, bench,
  whitebox_compare. They refuse, within a second, configs this machine cannot run (another device type, more
  ranks than it holds, more memory per rank than a device has) and name the tool to use instead.
Read skill://stage4-parallel-primitive-intro/SKILL.md first. The procedure on this machine: bench the current
config -> recommend_next -> update_config with the recommended patch (one primitive) -> bench again ->
whitebox_compare to prove the parallel run matches one device -> runs_diff the two benches. Never stack two
primitives without a white-box check between them. `config` arguments are names in configs/ (see config://index);
`overrides` are dotted keys (e.g. {"parallel.dp": 2}) applied without writing. Long tools report progress; if your
host times out, raise MCP_TOOL_TIMEOUT or poll run://index for the run."""

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# bench, whitebox_compare and a measured capacity_sweep launch processes, take the device lock and record runs
# under runs/: not read-only, and not idempotent (each call adds a run)
LAUNCHES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                           open_world_hint=False)
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
    return ", ".join(config_names(root())) or "(none)"


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


def _failure_tail(message: str, lines: int = 6, width: int = 240) -> str:
    """The lines of a failure that say something: no warnings, no traceback frames, no torchrun banners."""
    noise = ("Warning", "warnings.warn", "Traceback (most recent call last)", "  File ", "    ", "*****",
             "torch.distributed.elastic", "SignalException", "Setting OMP_NUM_THREADS")
    keep = [ln.strip()[:width] for ln in message.splitlines() if ln.strip() and not any(n in ln for n in noise)]
    return "\n".join(keep[-lines:])


def _preflight(config: str, overrides: dict[str, Any]) -> None:
    """Refuse, before a worker starts, a config this machine cannot run (curry_train/measure/preflight.py)."""
    from curry_train.measure.preflight import PreflightError, preflight
    from curry_train.measure.service import resolve

    try:
        preflight(*resolve(config, overrides, root()))
    except PreflightError as e:
        raise ToolError(str(e)) from None
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
                # the last completed step and a few meaningful log lines, not kilobytes of warnings
                head = e.message.splitlines()[0].split(" Log tail:")[0]
                raise ToolError(f"{label} {head}\nLast progress: {e.last_progress or '(none)'}\n"
                                f"Log tail:\n{_failure_tail(e.message.partition(chr(10))[2])}\n{retry}") from None
            if "OutOfMemoryError" in e.message or "out of memory" in e.message.lower():
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
