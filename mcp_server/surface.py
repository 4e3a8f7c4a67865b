"""What every tool inherits from the server plumbing: how clients see its arguments, its errors and its schemas.

server.py applies these once every tool is registered, so a tool added in any module gets them without a line of
its own:
- `declare_extensions_on_every_era`: `initialize` declares the skills extension on handshake-era connections too.
  mcp 2.3 sieves `capabilities.extensions` out of a 2025-11-25 result (that schema has no such field), and the
  MCP Inspector 2.12 (protocol 2025-11-25) then refuses `--method skills/list` although the server answers it.
- `case_insensitive_choices`: a string choice (a `Literal`) matches whatever its case (`symptom="OOM"`).
- `plain_validation_errors`: an argument error reaches the client as the product's own line (field, value, fix;
  server.plain_argument_errors), never pydantic's text with its type tags and web links.
- `trim_output_schemas`: output schemas keep the result's own fields (types, required, enums) and lose their
  prose (descriptions, titles, examples) and the nested models' definitions: a client validates structured
  content against them, while the model reads each tool's description. tests/test_mcp_stdio.py measures
  `tools/list` over stdio against MAX_TOOLS_LIST_BYTES.
"""

from __future__ import annotations

import typing
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

PROSE = frozenset({"description", "title", "examples"})  # schema keywords a validator never reads
MAX_TOOLS_LIST_BYTES = 50_000  # the budget of one tools/list answer (issue: clients keep it in context)


def declare_extensions_on_every_era(mcp: MCPServer) -> None:
    extensions = dict(mcp._lowlevel_server.extensions or {})  # what the SDK advertises on the modern era

    async def declare(ctx: Any, call_next: Any) -> Any:
        result = await call_next(ctx)
        if ctx.method == "initialize" and isinstance(result, dict) and extensions:
            caps = result.setdefault("capabilities", {})
            caps["extensions"] = {**extensions, **(caps.get("extensions") or {})}
        return result

    mcp.middleware.append(declare)


def _choices(annotation: Any) -> tuple[str, ...]:
    """The string values of every Literal inside an annotation (Optional, Annotated and unions included)."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(a for a in typing.get_args(annotation) if isinstance(a, str))
    return tuple(c for a in typing.get_args(annotation) for c in _choices(a))


def choice_fields(arg_model: type) -> dict[str, dict[str, str]]:
    """{argument name: {lower-case choice: the choice}} for every argument with string choices."""
    out = {}
    for name, field in arg_model.model_fields.items():
        choices = _choices(field.annotation)
        lowered = {c.lower(): c for c in choices}
        if choices and len(lowered) == len(choices):  # choices that differ only in case stay exact
            out[field.alias or name] = lowered
    return out


def fold_case(data: Any, fields: dict[str, dict[str, str]]) -> Any:
    """`data` with each string choice spelled as the tool declares it (OOM -> oom); anything else unchanged."""
    if not isinstance(data, dict) or not fields:
        return data
    return {k: fields[k].get(v.lower(), v) if k in fields and isinstance(v, str) else v for k, v in data.items()}


def plain_validation_errors(mcp: MCPServer, explain: Any) -> None:
    """Re-word the SDK's argument-validation failure (a ToolError caused by a pydantic ValidationError)."""
    from pydantic import ValidationError

    sdk_call_tool = mcp.call_tool

    async def call_tool(name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await sdk_call_tool(name, arguments, context)
        except ToolError as e:
            cause = e.__cause__
            if not isinstance(cause, ValidationError):
                raise
            raise ToolError(f"Error executing tool {name}: {explain(cause)}") from cause

    mcp.call_tool = call_tool  # type: ignore[method-assign]  # _handle_call_tool calls self.call_tool


def strip_prose(schema: Any) -> Any:
    """A JSON schema without its prose keywords; property NAMES that happen to be 'title' or 'description' stay."""
    if isinstance(schema, list):
        return [strip_prose(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in PROSE and not isinstance(v, dict):
            continue
        if k in ("properties", "$defs", "definitions", "patternProperties"):
            out[k] = {name: strip_prose(s) for name, s in v.items()}
        else:
            out[k] = strip_prose(v)
    return out


def shallow(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with each `$ref` to a nested model replaced by that model's bare type (`{"type": "object"}`)
    and `$defs` dropped: a client checks the result's own fields and their types; the nested models' fields are
    in the tool's description and the docs, and were half of every output schema."""
    defs = schema.get("$defs") or {}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = defs.get(str(node["$ref"]).rsplit("/", 1)[-1], {})
            return {"type": target.get("type", "object"), **({"enum": target["enum"]} if "enum" in target else {})}
        return {k: walk(v) for k, v in node.items() if k != "$defs"}

    return walk(schema)


def trim_output_schemas(mcp: MCPServer) -> None:
    for tool in mcp._tool_manager.list_tools():
        if tool.fn_metadata.output_schema is not None:
            tool.fn_metadata.output_schema = shallow(strip_prose(tool.fn_metadata.output_schema))
            tool.__dict__.pop("output_schema", None)  # Tool.output_schema is a cached_property over fn_metadata
