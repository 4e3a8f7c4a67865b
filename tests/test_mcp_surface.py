"""What every MCP tool inherits from the server plumbing (mcp_server/surface.py, server.py, cli.py): arguments
that default like the CLI's, choices in any case, argument errors in the product's words, the bearer scheme in
any case, and a taken port reported before anything claims to serve.

    .venv/bin/pytest tests/test_mcp_surface.py -q

The tools/list size and the skills extension on a handshake-era initialize are measured over a real stdio session
in tests/test_mcp_stdio.py; the Inspector's own skills/list in tests/test_real_clients.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import pytest
from curry_train.cli import build_parser
from curry_train_mcp.cli import BearerAuth
from curry_train_mcp.server import mcp
from mcp import Client

from tests.reliability.rel_support import text_of

# Each tool and the CLI subcommand that calls the same function.
CLI_OF = {"probe_hardware": "probe", "bench": "bench", "whitebox_compare": "whitebox", "update_config": "update-config",
          "estimate_memory": "estimate", "recommend_next": "recommend", "plan": "plan", "capacity_sweep": "sweep",
          "climb": "climb"}
# Where the two differ on purpose. The CLI runs the embedded `tiny` when --config is left out (README command 1);
# over MCP the assistant names the config it means, so a forgotten argument is an error, not a tiny run.
DIFFERS = {"config": "required over MCP: the assistant names its config"}
PYDANTIC = ("pydantic", "errors.pydantic.dev", "[type=", "validation error for", "input_value=", "Arguments\n")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_tool_argument_defaults_like_the_cli_option_of_the_same_name():
    subs, compared = _subcommands(), 0
    for tool in mcp._tool_manager.list_tools():
        if tool.name not in CLI_OF:
            continue
        cli = {a.dest: a for a in subs[CLI_OF[tool.name]]._actions}
        required = set(tool.parameters.get("required", []))
        for name, schema in tool.parameters["properties"].items():
            if name not in cli or name in DIFFERS:
                continue
            opt = cli[name]
            assert (name in required) == bool(opt.required), f"{tool.name}.{name}: required differs from the CLI"
            if not opt.required and (opt.default or schema.get("default")):  # None and False are both "off"
                assert schema.get("default") == opt.default, \
                    f"{tool.name}.{name}: default {schema.get('default')!r}, the CLI's {opt.default!r}"
            compared += 1
    assert compared >= 25  # the test compares, it does not skip everything


@pytest.mark.anyio
async def test_plan_takes_the_memory_from_the_gpu_as_the_cli_does():
    async with Client(mcp) as c:
        r = await c.call_tool("plan", {"model": "llama3-8b", "gpu": "A100-40"})
    assert not r.is_error, text_of(r)
    p = r.structured_content
    assert p["gpu_memory_gib"] == 40 and p["gpus_per_node"] == 8 and p["nodes"] == 1


@pytest.mark.anyio
async def test_string_choices_match_in_any_case():
    from curry_train_mcp.surface import choice_fields

    tool = mcp._tool_manager.get_tool("recommend_next")
    assert choice_fields(tool.fn_metadata.arg_model)["symptom"] == {"oom": "oom", "slow": "slow", "none": "none"}
    async with Client(mcp) as c:
        upper = await c.call_tool("recommend_next", {"config": "tiny", "symptom": "OOM"})
        lower = await c.call_tool("recommend_next", {"config": "tiny", "symptom": "oom"})
        bad = await c.call_tool("recommend_next", {"config": "tiny", "symptom": "Explodes"})
    assert not upper.is_error, text_of(upper)
    assert upper.structured_content == lower.structured_content and upper.structured_content["symptom"] == "oom"
    assert bad.is_error and "symptom" in text_of(bad) and "'oom', 'slow' or 'none'" in text_of(bad)


@pytest.mark.anyio
async def test_argument_errors_name_the_field_the_value_and_the_fix_in_plain_words():
    async with Client(mcp) as c:
        missing = {t.name: await c.call_tool(t.name, {}) for t in (await c.list_tools()).tools
                   if t.input_schema.get("required")}
        neg = await c.call_tool("plan", {"model": "llama3-8b", "gpus_per_node": -1})
        typo = await c.call_tool("bench", {"config": "tiny", "steps": "three"})
    assert len(missing) >= 7
    for name, r in missing.items():
        text = text_of(r)
        assert r.is_error and "pass it (it is required)" in text, (name, text)
        assert not [p for p in PYDANTIC if p in text], (name, text)
    for r, field, value, fix in ((neg, "gpus_per_node", "-1", "at least 1"), (typo, "steps", "three", "whole")):
        text = text_of(r)
        assert r.is_error and field in text and value in text and fix in text, text
        assert not [p for p in PYDANTIC if p in text], text


@pytest.mark.anyio
async def test_the_bearer_scheme_matches_in_any_case_and_the_token_exactly():
    seen: list[int] = []

    async def app(scope, receive, send):
        seen.append(200)

    async def send(msg):
        if msg["type"] == "http.response.start":
            seen.append(msg["status"])

    auth = BearerAuth(app, "s3cret-token-0123456789")
    for header, status in ((b"Bearer s3cret-token-0123456789", 200), (b"bearer s3cret-token-0123456789", 200),
                           (b"BEARER  s3cret-token-0123456789", 200), (b"bearer S3CRET-token-0123456789", 401),
                           (b"Basic s3cret-token-0123456789", 401), (b"s3cret-token-0123456789", 401), (b"", 401)):
        seen.clear()
        await auth({"type": "http", "headers": [(b"authorization", header)] if header else []}, None, send)
        assert seen == [status], (header, seen)


def test_a_taken_port_is_an_error_before_any_serving_line(project):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "curry_train.cli", "mcp", "--http", "--port", str(port)],
                           capture_output=True, text=True, timeout=120, cwd=project,
                           env={**os.environ, "CURRY_TRAIN_ROOT": str(project)})
    assert p.returncode == 2 and "serving MCP" not in p.stderr, p.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr and "--port" in p.stderr
    assert p.stdout == "" and json.dumps(p.stderr).count("Traceback") == 0
