"""Replay the scripted eval conversations against the real curryTrain MCP server over stdio.

    python -m evals                         # every conversation, both protocol eras where the file asks for them
    python -m evals -k zero -v              # only ids containing "zero", with every check printed
    python -m evals --server-command "python /tmp/patched_server.py"   # replay against another server build

For each conversation (evals/conversations/<id>.yaml, schema in evals/README.md) the runner
  1. checks that the user's message routes to the expected skill (evals/routing.py, BM25 over names+descriptions),
  2. reads that skill as a host would activate it (`skill://<name>/SKILL.md`),
  3. makes every scripted tool call through the official MCP client (`mcp.Client` over `stdio_client`) and checks
     every assertion on the structured result (or on the error text, for calls that must fail),
  4. checks the expected final recommendation against the last `recommend_next` result,
then prints one line per conversation and a closing line `N passed, N failed`; the exit status is 1 on any failure.

The server runs in a throwaway project root (a copy of configs/, an empty runs/), so an eval never writes into the
repository. One server process is started per protocol era and shared by the conversations of that era; a
conversation that breaks the connection gets a fresh server for the next one.

The pieces: evals/conversation.py (loading, schema, COVERAGE), evals/paths.py (result paths, `${..}` references),
evals/checks.py (the assertion engine), evals/server.py (the stdio server and its client), evals/live.py (the
optional live-model mode); this module replays and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import yaml

from .checks import check
from .conversation import CONVERSATIONS_DIR, ERAS, EXPENSIVE, SchemaError, launches, validate_conversation
from .paths import MISSING, substitute
from .routing import Router
from .server import Server, default_server_command, make_project, result_text


@dataclass
class Outcome:
    id: str
    failures: list[str] = field(default_factory=list)
    eras: list[str] = field(default_factory=list)
    calls: int = 0
    wall_s: float = 0.0
    checks: list[str] = field(default_factory=list)
    broken_connection: bool = False


async def replay(conv: dict[str, Any], server: Server, out: Outcome) -> None:
    """Make every call of one conversation on one server; append failures to `out`."""
    from mcp import MCPError
    from mcp.types import REQUEST_TIMEOUT

    era = server.era
    try:
        res = await server.client.read_resource(f"skill://{conv['skill']}/SKILL.md")
        text = res.contents[0].text
        if f"name: {conv['skill']}" not in text:
            out.failures.append(f"[{era}] skill://{conv['skill']}/SKILL.md does not carry its front matter")
    except MCPError as e:
        out.failures.append(f"[{era}] skill://{conv['skill']}/SKILL.md is not served: {e}")
    saved: dict[str, Any] = {}
    last_recommendation: Any = MISSING
    for i, call in enumerate(conv["calls"]):
        tool = call["tool"]
        where = f"[{era}] call {i + 1} {tool}"
        if tool not in server.tools:
            out.failures.append(f"{where}: the server has no such tool (has {sorted(server.tools)})")
            continue
        try:
            args = substitute(call.get("args", {}), saved)
        except LookupError as e:
            out.failures.append(f"{where}: {e}")
            continue
        schema_props = set((server.tools[tool].input_schema or {}).get("properties", {}))
        unknown = set(args) - schema_props
        if unknown:
            out.failures.append(f"{where}: arguments {sorted(unknown)} are not in the tool's input schema "
                                f"{sorted(schema_props)}")
            continue
        timeout = call.get("timeout_s", 180 if tool in EXPENSIVE else 60)
        try:
            with anyio.fail_after(timeout):
                result = await server.client.call_tool(tool, args, read_timeout_seconds=timeout)
            is_error, text, data = result.is_error, result_text(result), result.structured_content
        except MCPError as e:  # a JSON-RPC error instead of a tool result
            if e.code == REQUEST_TIMEOUT:
                out.failures.append(f"{where}: no answer within {timeout}s")
                out.broken_connection = True
                return
            is_error, text, data = True, str(e), None
        except TimeoutError:
            out.failures.append(f"{where}: no answer within {timeout}s")
            out.broken_connection = True
            return
        out.calls += 1
        if "error" in call:
            if not is_error:
                out.failures.append(f"{where}: succeeded, but must fail with {call['error']}")
                continue
            missing = [s for s in call["error"] if s.lower() not in text.lower()]
            if missing:
                out.failures.append(f"{where}: error message lacks {missing}: {text[:300]!r}")
            else:
                out.checks.append(f"{where}: error {text[:120]!r}")
            continue
        if is_error:
            out.failures.append(f"{where}: failed: {text[:400]}")
            continue
        if data is None:
            with contextlib.suppress(ValueError):
                data = json.loads(text)
        if "as" in call:
            saved[call["as"]] = data
        for a in call["expect"]:
            reason = check(a, data, saved)
            if reason:
                out.failures.append(f"{where}: {reason}")
            else:
                out.checks.append(f"{where}: {a.get('path', a.get('expr'))} ok")
        if tool == "recommend_next":
            last_recommendation = data
    prim = conv["final"].get("primitive")
    if prim is not None and last_recommendation is not MISSING:
        allowed = prim if isinstance(prim, list) else [prim]
        got = last_recommendation.get("primitive") if isinstance(last_recommendation, dict) else None
        if got not in allowed:
            out.failures.append(f"[{era}] final recommendation: recommend_next says {got!r}, want {allowed} "
                                f"({conv['final']['answer']})")


async def run_all(convs: list[dict[str, Any]], *, command: list[str], router: Router,
                  eras: list[str]) -> list[Outcome]:
    outcomes = {c["id"]: Outcome(id=c["id"]) for c in convs}
    for c in convs:  # routing needs no server
        ranked = router.rank(c["user"])
        if ranked[0][0] != c["skill"]:
            top = ", ".join(f"{n} {s:.2f}" for n, s in ranked[:3])
            score = dict(ranked)[c["skill"]]
            out = outcomes[c["id"]]
            out.failures.append(f"routing: the message selects {ranked[0][0]!r}, not {c['skill']!r} "
                                f"(top: {top}; {c['skill']} {score:.2f}, shared words "
                                f"{router.explain(c['user'], c['skill'])})")
    with tempfile.TemporaryDirectory(prefix="curry-evals-") as tmp:
        for era in eras:
            project = make_project(Path(tmp) / f"project-{era}")  # eras never see each other's configs or runs
            todo = [c for c in convs if era in c.get("eras", ERAS)]
            server: Server | None = None
            start_failed = False
            for c in todo:
                out = outcomes[c["id"]]
                t0 = time.perf_counter()
                if start_failed:
                    out.failures.append(f"[{era}] the server did not start (see the first failure)")
                    continue
                if server is None:
                    server = Server(command, project, era, Path(tmp) / f"server-{era}-{c['id']}.log")
                    try:
                        await server.start()
                    except Exception as e:  # noqa: BLE001 - report any start-up failure as the eval's failure
                        out.failures.append(f"[{era}] the server did not start: {type(e).__name__}: {e}\n"
                                            f"{server.log_tail()}")
                        await server.stop()
                        server, start_failed = None, True
                        continue
                out.eras.append(era)
                try:
                    await replay(c, server, out)
                except Exception as e:  # noqa: BLE001 - a dead connection fails this conversation, not the run
                    out.failures.append(f"[{era}] connection failed: {type(e).__name__}: {e}\n{server.log_tail()}")
                    out.broken_connection = True
                if out.broken_connection:
                    await server.stop()
                    server = None
                    out.broken_connection = False
                out.wall_s += time.perf_counter() - t0
            if server is not None:
                await server.stop()
    return [outcomes[c["id"]] for c in convs]


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals", description=__doc__.splitlines()[0])
    ap.add_argument("-k", dest="pattern", default=None, help="only conversations whose id contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every passed check too")
    ap.add_argument("--era", choices=ERAS, action="append", help="only this protocol era (repeatable)")
    ap.add_argument("--quick", action="store_true", help="skip the conversations that launch torchrun "
                    "(a successful bench or whitebox_compare); for editing evals, not for CI")
    ap.add_argument("--server-command", default=None,
                    help="command line that starts the stdio server (default: curry-train mcp)")
    ap.add_argument("--no-live", action="store_true", help="do not try the live mode (a real model answers the "
                    "same conversations; it runs only with ANTHROPIC_API_KEY and the anthropic package: evals/live.py)")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    router = Router()
    skills = {s.name for s in router.skills}
    convs, schema_failures = [], []
    for p in sorted(CONVERSATIONS_DIR.glob("*.yaml")):
        try:
            c = yaml.safe_load(p.read_text(encoding="utf-8"))
            validate_conversation(c, p.stem, skills)
        except (SchemaError, yaml.YAMLError) as e:
            schema_failures.append((p.stem, str(e)))
            continue
        if a.pattern is not None and a.pattern not in c["id"]:
            continue
        if a.quick and launches(c):
            continue
        convs.append(c)
    command = shlex.split(a.server_command) if a.server_command else default_server_command()
    if "/" in command[0] and not Path(command[0]).is_absolute():  # the server starts in the temp project
        command[0] = str(Path(command[0]).absolute())  # not resolve(): a venv's python is a symlink
    outcomes = anyio.run(lambda: run_all(convs, command=command, router=router, eras=a.era or list(ERAS)))
    passed = failed = 0
    for stem, msg in schema_failures:
        failed += 1
        print(f"FAIL  {stem}: invalid conversation file: {msg}")
    for o in outcomes:
        if o.failures:
            failed += 1
            print(f"FAIL  {o.id}  ({'+'.join(o.eras) or 'no era'}, {_calls(o.calls)}, {o.wall_s:.1f}s)")
            for f in o.failures:
                print("        " + f.replace("\n", "\n        "))
        else:
            passed += 1
            print(f"PASS  {o.id}  ({'+'.join(o.eras)}, {_calls(o.calls)}, {o.wall_s:.1f}s)")
        if a.verbose:
            for line in o.checks:
                print("        ok " + line)
    print(f"# wall time {time.perf_counter() - t0:.1f}s, server: {' '.join(command)}")
    if not a.no_live:
        from .live import run_live

        run_live(convs, command=command)  # prints its own score, or why it is skipped; never changes the exit code
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0
