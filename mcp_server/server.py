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
    climb_tool.py   climb, the main job (the CLI's climb in a worker)
    resources.py    skill://, config://, run:// and the diagnose_scaling prompt
    surface.py      what every tool inherits: case-insensitive choices, plain argument errors, trimmed output
                    schemas, the skills extension declared on every protocol era
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
from . import climb_tool  # noqa: F401
from . import resources
from . import surface
# isort: on

__all__ = ["SKILLS_DIR", "WhiteboxVerdict", "_long", "mcp", "root", "tool_error"]


def _refuse_unknown_arguments() -> None:
    """Make every tool refuse arguments it does not take, naming them and the ones it does.

    The SDK's argument models ignore unknown keys, so a typo ({"step": 3} for "steps", "override" for
    "overrides") silently ran a different bench than the caller asked for and reported it as theirs (found by
    tests/reliability/test_fuzz_tools.py). The schema says so too (additionalProperties: false). This reaches into
    the tool manager (mcp 2.3, no public hook for it); the reliability tests fail if that stops working.
    """
    from pydantic import ValidationError, create_model, model_validator

    for tool in mcp._tool_manager.list_tools():
        base = tool.fn_metadata.arg_model
        known = tuple(sorted(f.alias or n for n, f in base.model_fields.items()))
        choices = surface.choice_fields(base)

        def check(cls: type, data: Any, known: tuple[str, ...] = known, name: str = tool.name,
                  choices: dict[str, dict[str, str]] = choices) -> Any:
            if isinstance(data, dict) and (unknown := sorted(str(k) for k in set(data) - set(known))):
                raise ValueError(f"unknown argument(s) {unknown}: {name} takes only {', '.join(known)}; "
                                 "fix the spelling or drop them")
            return surface.fold_case(data, choices)  # symptom="OOM" is symptom="oom"

        def plain(cls: type, data: Any, handler: Any) -> Any:
            try:
                return handler(data)
            except ValidationError as e:
                raise ValueError(plain_argument_errors(e)) from None

        tool.fn_metadata.arg_model = create_model(
            base.__name__, __base__=base, __validators__={
                "_known_arguments": model_validator(mode="before")(check),
                "_plain_errors": model_validator(mode="wrap")(plain)})
        tool.parameters["additionalProperties"] = False


# What to do about each kind of pydantic argument error, in the words of a user, not of pydantic's types.
_FIXES = {
    "int_parsing": "give a whole number", "int_type": "give a whole number", "int_from_float": "give a whole number",
    "int_parsing_size": "give a whole number below 2**63",
    "float_parsing": "give a number", "float_type": "give a number", "finite_number": "give a finite number",
    "bool_parsing": "pass true or false", "bool_type": "pass true or false",
    "string_type": "pass a string", "dict_type": "pass an object of name: value", "list_type": "pass a list",
    "missing": "pass it (it is required)", "literal_error": "use one of {expected}",
    "greater_than_equal": "set it to at least {ge}", "greater_than": "set it above {gt}",
    "less_than_equal": "set it to at most {le}", "less_than": "set it below {lt}",
}


def plain_argument_errors(error: Any) -> str:
    """One line per refused argument: its name, what was wrong, and the fix (tools/list has the schema)."""
    lines = []
    for item in error.errors(include_url=False):
        field = ".".join(str(p) for p in item.get("loc", ())) or "arguments"
        if item["type"] == "value_error":  # our own validators' text already names the field and the fix
            lines.append(item["msg"].removeprefix("Value error, "))
            continue
        ctx = {k: str(v) for k, v in (item.get("ctx") or {}).items()}
        try:
            fix = _FIXES[item["type"]].format(**ctx)
        except (KeyError, IndexError):
            fix = "fix it to match the tool's input schema (tools/list)"
        got = "" if item["type"] == "missing" else f" (got {str(item.get('input'))[:60]!r})"
        lines.append(f"{field}: {item['msg'].rstrip('.')}{got}; {fix}")
    return "; ".join(lines)


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
surface.plain_validation_errors(mcp, plain_argument_errors)
surface.trim_output_schemas(mcp)
surface.declare_extensions_on_every_era(mcp)
resources.register_configs()
resources.advertise_list_changed()
