"""curryTrain's MCP server: thin typed adapters over the same functions the `curry-train` CLI calls.

    curry-train mcp                      # stdio (what Claude Code / Desktop start)
    curry-train mcp --http --port 8765   # streamable HTTP on 127.0.0.1 with DNS-rebinding protection

Tools take a config NAME from configs/ (never a path) and dotted `overrides` applied without writing anything.
Cheap tools (estimates, plans, diffs, config writes) run in the server; long ones (bench, white-box, measured
probe and sweep) run in a killable worker process (jobs.py): they report progress, have deadlines, are cancelled
by killing their whole process tree, and take the machine's device lock so they never share the accelerators.
torch is never imported here, so `tools/list` answers within a second of start.
Errors the model can act on are ToolErrors that say what to do next.

This module assembles the server; importing it registers every tool, resource and prompt on one MCPServer:
    app.py          the MCPServer instance `mcp` and what the adapters share (root, argument types, errors, _long)
    run_tools.py    probe_hardware, bench, whitebox_compare, update_config, runs_diff
    brain_tools.py  estimate_memory, recommend_next, plan, capacity_sweep
    resources.py    skill://, config://, run:// and the diagnose_scaling prompt
"""

from __future__ import annotations

from typing import Any

from curry_train.validation.verdict import Verdict as WhiteboxVerdict

from .app import SKILLS_DIR, _long, mcp, root, tool_error

# Importing a module registers its tools on `mcp`, and tools/list lists them in registration order: the run tools
# first (the procedure starts with probe_hardware and bench), then the brain's. Hence the fixed order here.
# isort: off
from . import run_tools  # noqa: F401
from . import brain_tools  # noqa: F401
from . import resources
# isort: on

__all__ = ["SKILLS_DIR", "WhiteboxVerdict", "_long", "mcp", "root", "tool_error"]


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


def _plain_descriptions() -> None:
    """Tool descriptions come from docstrings: join their indented continuation lines into plain paragraphs, so
    a client shows "torch / CUDA", not "torch /\n    CUDA"."""
    import inspect
    import re

    for tool in mcp._tool_manager.list_tools():
        if tool.description:
            paragraphs = inspect.cleandoc(tool.description).split("\n\n")
            tool.description = "\n\n".join(re.sub(r"\s*\n\s*", " ", p).strip() for p in paragraphs)


_refuse_unknown_arguments()
_plain_descriptions()
resources.register_configs()
resources.advertise_list_changed()
