"""Every tool a skill names is one of the nine tools of the contract and is registered on the live MCP server.

    .venv/bin/pytest tests/test_skills*.py -q

A tool is named by a code span that starts with `tool_name(`, or by a name on a `**Tools:**` line. Each skill
lists the tools it calls; every call passes its arguments by keyword, with the contract's argument names and the
arguments the server's registered input schema accepts and requires.
"""

from __future__ import annotations

from skills_support import (
    SYMPTOMS,
    TOOLS,
    all_calls,
    all_texts,
    skill_dirs,
    skill_texts,
    tool_calls,
    tools_line_names,
)


def test_every_named_tool_is_one_of_the_nine():
    unknown = [c for c in all_calls() if c.name not in TOOLS]
    unknown += [
        f"{where}: **Tools:** {n}"
        for where, text in all_texts().items()
        for n in tools_line_names(text)
        if n not in TOOLS
    ]
    assert not unknown, "code spans that start with `name(` are tool calls; these are not tools:\n" + "\n".join(
        map(str, unknown)
    )


def test_every_skill_lists_its_tools_and_calls_only_listed_ones():
    problems = []
    for d in skill_dirs():
        text = (d / "SKILL.md").read_text(encoding="utf-8")
        listed = set(tools_line_names(text))
        if not listed:
            problems.append(f"{d.name}: no **Tools:** line")
        called = {c.name for where, t in skill_texts(d).items() for c in tool_calls(where, t)}
        if called - listed:
            problems.append(f"{d.name}: calls {sorted(called - listed)} without listing them")
    assert not problems, "\n".join(problems)


def test_tool_calls_are_keyword_calls_with_contract_arguments():
    problems = []
    for c in all_calls():
        if c.name not in TOOLS:
            continue
        if c.error:
            problems.append(f"{c!r}: {c.error}")
            continue
        accepted, required = TOOLS[c.name]
        if accepted is not None and set(c.kwargs) - accepted:
            problems.append(f"{c!r}: unknown arguments {sorted(set(c.kwargs) - accepted)}")
        if required - set(c.kwargs):
            problems.append(f"{c!r}: missing {sorted(required - set(c.kwargs))}")
        if "overrides" in c.kwargs and not isinstance(c.kwargs["overrides"], dict):
            problems.append(f"{c!r}: overrides is a dict of dotted keys")
        if c.name == "recommend_next" and c.kwargs.get("symptom") not in SYMPTOMS:
            problems.append(f"{c!r}: symptom is one of oom, slow, none")
    assert not problems, "\n".join(problems)


def _live_server():
    """The MCPServer object registered in curry_train_mcp.server."""
    import curry_train_mcp.server as srv
    from mcp.server import MCPServer

    servers = [v for v in vars(srv).values() if isinstance(v, MCPServer)]
    assert servers, "curry_train_mcp.server defines no MCPServer instance"
    return servers[0]


def _live_tools() -> dict[str, dict]:
    import anyio
    from mcp import Client

    server = _live_server()

    async def list_all() -> dict[str, dict]:
        out: dict[str, dict] = {}
        async with Client(server, raise_exceptions=True) as client:
            cursor = None
            while True:
                res = await client.list_tools(cursor=cursor)
                out.update({t.name: t.input_schema for t in res.tools})
                cursor = res.next_cursor
                if not cursor:
                    return out

    return anyio.run(list_all)


def test_live_server_registers_every_tool_the_skills_name_with_their_arguments():
    live = _live_tools()
    assert set(TOOLS) <= set(live), f"the contract's tools missing on the server: {sorted(set(TOOLS) - set(live))}"
    problems = []
    named = {c.name for c in all_calls()} | {n for t in all_texts().values() for n in tools_line_names(t)}
    problems += [f"tool {n!r} is named by a skill but not registered" for n in sorted(named - set(live))]
    for c in all_calls():
        schema = live.get(c.name)
        if schema is None or c.error:
            continue
        props = set(schema.get("properties", {}))
        if set(c.kwargs) - props:
            problems.append(f"{c!r}: the server does not accept {sorted(set(c.kwargs) - props)}")
        if set(schema.get("required", [])) - set(c.kwargs):
            problems.append(f"{c!r}: the server requires {sorted(set(schema['required']) - set(c.kwargs))}")
    assert not problems, "\n".join(problems)
