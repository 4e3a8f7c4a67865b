"""Live mode: the same conversations, answered by a real model that drives the real MCP server.

    ANTHROPIC_API_KEY=... python -m evals.live [-k pattern] [--model claude-sonnet-4-5]

`python -m evals` calls this after the scripted replay. It runs only when ANTHROPIC_API_KEY is set and the
`anthropic` package is importable (it is not a dependency of curryTrain: `pip install anthropic`); otherwise it
prints why it is skipped and does nothing.

For each conversation the model gets what a host gives it: the server's instructions and every skill's name and
description (the front matter; the body is read on activation through the `read_skill` tool, which reads
`skill://<name>/SKILL.md` from the server), and the server's tools exactly as `tools/list` describes them. It
sees only the user's message, calls tools through the official MCP client (stdio, a throwaway project root),
and its final answer is scored: correct when it mentions at least one of the conversation's `final.mentions`
(case-insensitive). The score line reports which scripted tools the model also called, and which skill it read.
Scores from a model are not deterministic, so the live result never changes `python -m evals`' exit status;
`python -m evals.live --strict` exits 1 when any answer is scored wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import yaml

MODEL = os.environ.get("CURRY_EVALS_MODEL", "claude-sonnet-4-5")
MAX_TURNS = 12  # model responses per conversation
MAX_RESULT_CHARS = 20_000

READ_SKILL_TOOL = {
    "name": "read_skill",
    "description": "Read a curryTrain skill's full instructions (skill://<name>/SKILL.md). Read the matching skill "
                   "before acting on the user's request.",
    "input_schema": {"type": "object", "properties": {"name": {"type": "string", "description": "Skill name"}},
                     "required": ["name"]},
}


def unavailable() -> str | None:
    """Why live mode cannot run here, or None."""
    reasons = []
    if not os.environ.get("ANTHROPIC_API_KEY"):
        reasons.append("ANTHROPIC_API_KEY is not set")
    try:
        import anthropic  # noqa: F401
    except ImportError:
        reasons.append("the anthropic package is not installed (pip install anthropic)")
    return "; ".join(reasons) or None


def score(answer: str, final: dict[str, Any]) -> tuple[bool, list[str]]:
    """(correct, the mentions found): correct when the answer names at least one expected mention."""
    found = [m for m in final["mentions"] if m.lower() in answer.lower()]
    return bool(found), found


def _system_prompt(instructions: str | None, skills: list[Any]) -> str:
    lines = [instructions or "", "", "Available skills (read one with read_skill before acting):"]
    lines += [f"- {s.name}: {s.description}" for s in skills]
    lines += ["", "Use the tools to get numbers; do not guess them. End with a short, direct recommendation."]
    return "\n".join(lines)


def _blocks(content: list[Any]) -> list[dict[str, Any]]:
    """The assistant turn as request blocks (text and tool_use only)."""
    out = []
    for b in content:
        if b.type == "text":
            out.append({"type": "text", "text": b.text})
        elif b.type == "tool_use":
            out.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.input})
    return out


async def converse(conv: dict[str, Any], client: Any, api: Any, model: str, system: str,
                   tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One conversation with the model; returns the answer, the tools it called and the skills it read."""
    from mcp import MCPError

    from .server import result_text

    messages: list[dict[str, Any]] = [{"role": "user", "content": conv["user"]}]
    called: list[str] = []
    read: list[str] = []
    answer = ""
    for _ in range(MAX_TURNS):
        resp = await api.messages.create(model=model, max_tokens=2048, system=system, tools=tools,
                                         messages=messages)
        messages.append({"role": "assistant", "content": _blocks(resp.content)})
        answer = "\n".join(b.text for b in resp.content if b.type == "text")
        uses = [b for b in resp.content if b.type == "tool_use"]
        if resp.stop_reason != "tool_use" or not uses:
            break
        results = []
        for u in uses:
            try:
                if u.name == "read_skill":
                    read.append(str(u.input.get("name")))
                    res = await client.read_resource(f"skill://{u.input.get('name')}/SKILL.md")
                    text, is_error = res.contents[0].text, False
                else:
                    called.append(u.name)
                    r = await client.call_tool(u.name, u.input, read_timeout_seconds=900)
                    is_error = bool(r.is_error)
                    text = (json.dumps(r.structured_content) if r.structured_content is not None
                            else result_text(r))
            except MCPError as e:
                text, is_error = str(e), True
            results.append({"type": "tool_result", "tool_use_id": u.id, "content": text[:MAX_RESULT_CHARS],
                            "is_error": is_error})
        messages.append({"role": "user", "content": results})
    return {"answer": answer, "called": called, "read": read}


async def _run(convs: list[dict[str, Any]], command: list[str], model: str) -> tuple[int, int]:
    from anthropic import AsyncAnthropic

    from .routing import load_skills
    from .server import Server, make_project

    api = AsyncAnthropic()
    good = bad = 0
    with tempfile.TemporaryDirectory(prefix="curry-evals-live-") as tmp:
        server = Server(command, make_project(Path(tmp) / "project"), "auto", Path(tmp) / "server-live.log")
        await server.start()
        try:
            tools = [{"name": t.name, "description": t.description or "", "input_schema": t.input_schema}
                     for t in server.tools.values()] + [READ_SKILL_TOOL]
            system = _system_prompt(getattr(server.client, "instructions", None), load_skills())
            for conv in convs:
                t0 = time.perf_counter()
                out = await converse(conv, server.client, api, model, system, tools)
                ok, found = score(out["answer"], conv["final"])
                scripted = {c["tool"] for c in conv["calls"]}
                also = sorted(scripted & set(out["called"]))
                good, bad = good + ok, bad + (not ok)
                line = (f"LIVE {'PASS' if ok else 'FAIL'}  {conv['id']}  ({time.perf_counter() - t0:.0f}s; "
                        f"read {out['read'] or '-'}; called {out['called'] or '-'}; scripted tools used "
                        f"{len(also)}/{len(scripted)}; mentions {found or '-'})")
                print(line)
                if not ok:
                    short = " ".join(out["answer"].split())[:300]
                    print(f"        the answer mentions none of {conv['final']['mentions']}: {short!r}")
        finally:
            await server.stop()
    return good, bad


def run_live(convs: list[dict[str, Any]], *, command: list[str], model: str = MODEL) -> tuple[int, int] | None:
    """Run and score every conversation through a real model; None (and a message) when skipped."""
    why = unavailable()
    if why:
        print(f"live mode skipped: {why}")
        return None
    good, bad = anyio.run(_run, convs, command, model)
    print(f"live: {good} of {good + bad} answers scored correct (model {model})")
    return good, bad


def main(argv: list[str] | None = None) -> int:
    from .conversation import CONVERSATIONS_DIR
    from .server import default_server_command

    ap = argparse.ArgumentParser(prog="python -m evals.live", description=__doc__.splitlines()[0])
    ap.add_argument("-k", dest="pattern", default=None, help="only conversations whose id contains this")
    ap.add_argument("--model", default=MODEL, help=f"model id (default {MODEL}; env CURRY_EVALS_MODEL)")
    ap.add_argument("--server-command", default=None, help="command line that starts the stdio server")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any answer is scored wrong")
    a = ap.parse_args(argv)
    convs = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(CONVERSATIONS_DIR.glob("*.yaml"))]
    convs = [c for c in convs if a.pattern is None or a.pattern in c["id"]]
    command = shlex.split(a.server_command) if a.server_command else default_server_command()
    res = run_live(convs, command=command, model=a.model)
    return 1 if a.strict and res is not None and res[1] else 0


if __name__ == "__main__":
    sys.exit(main())
