"""The server as hosts run it: a real stdio subprocess (both protocol eras), raw stdout purity, HTTP on loopback.

    .venv/bin/pytest tests/test_mcp_stdio.py -q

The acceptance check of issue 7 is `test_stdio_acceptance`: tools/list shows the nine tools with output schemas,
probe_hardware reports this machine, bench(tiny, steps=3, dp=2) returns world_size 2, a finite loss and a positive
peak, and the stage-4 skill is a listed resource. Two tests launch a 2-rank bench; the rest are cheap.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
NINE = {"probe_hardware", "bench", "whitebox_compare", "update_config", "runs_diff", "estimate_memory",
        "recommend_next", "plan", "capacity_sweep"}
STAGE4 = "skill://stage4-parallel-primitive-intro/SKILL.md"
SERVER = [sys.executable, "-m", "curry_train.cli", "mcp"]  # what `curry-train mcp` runs


def _env(project: Path) -> dict[str, str]:
    return {"CURRY_TRAIN_ROOT": str(project), "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "PATH": os.environ.get("PATH", "")}


def _params(project: Path) -> StdioServerParameters:
    return StdioServerParameters(command=SERVER[0], args=SERVER[1:], cwd=str(project), env=_env(project))


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_stdio_lists_tools_with_output_schemas_and_the_stage4_skill(project, mode):
    async with Client(_params(project), mode=mode, read_timeout_seconds=120) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert NINE <= set(tools), sorted(NINE - set(tools))
        assert all(tools[n].output_schema for n in NINE)
        assert STAGE4 in {r.uri for r in (await c.list_resources()).resources}
        r = await c.call_tool("update_config", {"name": "tiny-zero1", "changes": {"parallel.zero": 1,
                                                                                  "parallel.dp": 2}, "base": "tiny"})
        assert not r.is_error and (project / "configs" / "local" / "tiny-zero1.yaml").is_file()


@pytest.mark.multirank
@pytest.mark.anyio
async def test_stdio_acceptance(project):
    progress: list[str] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async with Client(_params(project), read_timeout_seconds=600) as c:
        assert NINE <= {t.name for t in (await c.list_tools()).tools}
        hw = await c.call_tool("probe_hardware", {})
        assert not hw.is_error, hw.content
        assert hw.structured_content["gpu_count"] == 0 and hw.structured_content["cpu_count"] >= 1
        r = await c.call_tool("bench", {"config": "tiny", "steps": 3, "overrides": {"parallel.dp": 2}},
                              progress_callback=on_progress)
        assert not r.is_error, r.content
        out = r.structured_content
        assert out["world_size"] == 2 and out["loss_finite"] and out["peak_memory_bytes"] > 0
        assert len(out["losses"]) == 4 and all(math.isfinite(x) for x in out["losses"])
        assert out["run_id"] in {x["run_id"] for x in json.loads((await c.read_resource("run://index"))
                                                                   .contents[0].text)}
        assert STAGE4 in {x.uri for x in (await c.list_resources()).resources}
        wb = await c.call_tool("whitebox_compare", {"config": "tiny", "overrides": {"parallel.dp": 2}})
        assert not wb.is_error, wb.content
        assert wb.structured_content["passed"] and wb.structured_content["world_size"] == 2
    assert any("launching 2 rank" in m for m in progress), progress
    assert any(m.startswith("bench: step 3/3") for m in progress), progress


@pytest.mark.multirank
def test_stdout_carries_only_jsonrpc_while_a_multirank_bench_runs(project):
    """What an older host sends (2025-06-18 handshake); every stdout line must parse as JSON-RPC 2.0."""
    msgs = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "bench",
                "arguments": {"config": "tiny", "steps": 2, "overrides": {"parallel.dp": 2}, "plot": True},
                "_meta": {"progressToken": "p1"}}}]
    proc = subprocess.Popen(SERVER, cwd=project, env={**os.environ, **_env(project)}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write("".join(json.dumps(m) + "\n" for m in msgs))
        proc.stdin.flush()
        got: dict = {}
        lines, progress = 0, 0
        deadline = time.monotonic() + 300
        while 2 not in got:  # keep stdin open until the answer arrives: EOF drops in-flight requests
            assert time.monotonic() < deadline, "no answer to the bench call"
            line = proc.stdout.readline()
            assert line, f"server exited: {proc.stderr.read()[-2000:]}"
            msg = json.loads(line)  # fails on any non-JSON line
            assert msg.get("jsonrpc") == "2.0", line
            lines += 1
            progress += msg.get("method") == "notifications/progress"
            if "id" in msg:
                got[msg["id"]] = msg
        result = got[2]["result"]
        assert not result.get("isError"), result
        assert result["structuredContent"]["world_size"] == 2 and progress >= 1
        assert [b["type"] for b in result["content"]] == ["text", "image"]  # plot=true: the memory breakdown PNG
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert lines >= 3


def test_cold_start_to_tools_list_stays_small(project):
    """Spawn -> initialize -> tools/list answered, on the handshake era (2025-11-25) that the Inspector 2.x and
    Claude Code speak. The time is printed, not bounded (the CI box is shared); the answer's size is bounded
    (surface.MAX_TOOLS_LIST_BYTES: output schemas without their prose), and initialize declares the skills
    extension even though that era's schema has no `extensions` field (the Inspector refuses skills/list
    otherwise)."""
    from curry_train_mcp.surface import MAX_TOOLS_LIST_BYTES

    msgs = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}]
    t0 = time.perf_counter()
    proc = subprocess.Popen(SERVER, cwd=project, env={**os.environ, **_env(project)}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        proc.stdin.write("".join(json.dumps(m) + "\n" for m in msgs))
        proc.stdin.flush()
        answers = {}
        while 2 not in answers:
            line = proc.stdout.readline()
            msg = json.loads(line)
            answers[msg.get("id")] = (msg, len(line.encode()))
        elapsed = time.perf_counter() - t0
        msg, size = answers[2]
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert NINE <= {t["name"] for t in msg["result"]["tools"]}
    assert size < MAX_TOOLS_LIST_BYTES, f"tools/list is {size} bytes"
    assert all(t.get("outputSchema") for t in msg["result"]["tools"])  # trimmed, not dropped
    caps = answers[1][0]["result"]["capabilities"]
    assert caps.get("extensions", {}).get("io.modelcontextprotocol/skills") == {}, caps
    print(f"cold start to tools/list: {elapsed:.2f}s; tools/list {size} bytes")  # benchmarks/server_latency.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.anyio
async def test_http_serves_on_loopback_and_refuses_a_foreign_host_header(project):
    import httpx2

    port = _free_port()
    proc = subprocess.Popen([*SERVER, "--http", "--port", str(port)], cwd=project,  # noqa: ASYNC220
                            env={**os.environ, **_env(project)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with anyio.fail_after(60):
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    await anyio.sleep(0.1)
        async with Client(f"http://127.0.0.1:{port}/mcp", mode="legacy") as c:
            assert NINE <= {t.name for t in (await c.list_tools()).tools}
        async with httpx2.AsyncClient() as h:
            r = await h.post(f"http://127.0.0.1:{port}/mcp", headers={"Host": "evil.example.com",
                                                                      "Content-Type": "application/json",
                                                                      "Accept": "application/json, text/event-stream"},
                             content=b"{}")
        assert r.status_code == 421
    finally:
        proc.terminate()
        proc.wait(30)


def test_install_skills_copies_every_skill_into_a_claude_skills_folder(tmp_path):
    dest = tmp_path / "skills"
    cmd = [sys.executable, "-m", "curry_train.cli", "install-skills", "--dest", str(dest), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    installed = json.loads(r.stdout)["installed"]
    expected = sorted(p.parent.name for p in (REPO / "skills").glob("*/SKILL.md"))
    assert installed == expected and "stage4-parallel-primitive-intro" in installed
    for name in installed:
        assert (dest / name / "SKILL.md").read_bytes() == (REPO / "skills" / name / "SKILL.md").read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 1 and "--force" in again.stderr  # never overwrites without --force
    forced = subprocess.run([*cmd, "--force"], capture_output=True, text=True, timeout=120, check=False)
    assert forced.returncode == 0 and json.loads(forced.stdout)["installed"] == expected
