"""The server and the plugin checked by the real clients: the Claude Code CLI and the MCP Inspector CLI.

    npm install --prefix .ci/node @anthropic-ai/claude-code @modelcontextprotocol/inspector@^2   # what .ci/run does
    .venv/bin/pytest tests/test_real_clients.py -q

The clients are Node programs from the npm registry. They are looked for on PATH, in the folders of
$CURRY_TRAIN_NODE_BIN (colon-separated) and in .ci/node/node_modules/.bin; a test whose client is missing is
skipped with the reason. Claude Code runs with HOME set to a temporary folder, so it never reads or writes the
user's settings; the server runs against a throwaway project (CURRY_TRAIN_ROOT).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SERVER = [str(Path(sys.executable).with_name("curry-train")), "mcp"]


def _find(name: str) -> str | None:
    dirs = [d for d in os.environ.get("CURRY_TRAIN_NODE_BIN", "").split(":") if d]
    dirs.append(str(REPO / ".ci" / "node" / "node_modules" / ".bin"))
    for d in dirs:
        if (Path(d) / name).is_file():
            return str(Path(d) / name)
    return shutil.which(name)


def _need(name: str, package: str) -> str:
    exe = _find(name)
    if exe is None:
        pytest.skip(f"{name} not installed: `npm install --prefix .ci/node {package}` (or put it on PATH / "
                    "$CURRY_TRAIN_NODE_BIN) to run this check")
    return exe


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def claude(tmp_path: Path) -> tuple[str, dict[str, str]]:
    exe = _need("claude", "@anthropic-ai/claude-code")
    home = tmp_path / "home"
    home.mkdir()
    return exe, {**os.environ, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
                 "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1"}


def test_claude_code_validates_the_plugin_and_its_marketplace(claude, tmp_path):
    exe, env = claude
    for target in (REPO, REPO / ".claude-plugin" / "plugin.json"):
        p = _run([exe, "plugin", "validate", str(target)], env, tmp_path, timeout=120)
        out = p.stdout + p.stderr
        assert p.returncode == 0 and "Validation passed" in out and "error" not in out.lower(), out


@pytest.mark.slow
def test_claude_code_lists_the_readme_server_as_connected_inside_the_checkout(claude, project):
    """README's `claude mcp add -s user curry-train ...`, then `claude mcp list` from inside the checkout: the
    server connects, and nothing in the checkout registers a second `curry-train` (no conflicting scopes)."""
    exe, env = claude
    add = _run([exe, "mcp", "add", "-s", "user", "curry-train", "-e", f"CURRY_TRAIN_ROOT={project}", "--", *SERVER],
               env, REPO, timeout=120)
    assert add.returncode == 0, add.stdout + add.stderr
    p = _run([exe, "mcp", "list"], env, REPO)
    out = p.stdout + p.stderr
    line = next((ln for ln in out.splitlines() if ln.startswith("curry-train:")), "")
    assert "Connected" in line, out
    assert "conflict" not in out.lower() and out.count("curry-train:") == 1, out


@pytest.fixture
def inspector() -> str:
    exe = _need("mcp-inspector", "@modelcontextprotocol/inspector@^2")
    help_text = subprocess.run([exe, "--cli", "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--strict" not in help_text:
        pytest.skip(f"{exe} is an Inspector without --strict (0.x): install @modelcontextprotocol/inspector@^2")
    return exe


@pytest.mark.slow
def test_the_inspector_lists_the_tools_strictly_portable_and_calls_one(inspector, project, tmp_path):
    env = dict(os.environ)
    p = _run([inspector, "--cli", "-e", f"CURRY_TRAIN_ROOT={project}", *SERVER, "--strict", "--method",
              "tools/list"], env, tmp_path)
    assert p.returncode == 0 and '"estimate_memory"' in p.stdout, p.stderr[-3000:]
    assert p.stderr.strip() == "", p.stderr[-3000:]  # --strict prints every portability problem on stderr
    p = _run([inspector, "--cli", "-e", f"CURRY_TRAIN_ROOT={project}", *SERVER, "--method", "tools/call",
              "--tool-name", "estimate_memory", "--tool-arg", "config=tiny"], env, tmp_path)
    assert p.returncode == 0 and '"grad_buffers"' in p.stdout and '"isError": true' not in p.stdout, \
        p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.slow
def test_the_inspector_lists_and_verifies_the_skills(inspector, project, tmp_path):
    """Inspector 2.x reads skills/list only from a server whose initialize declares the skills extension
    (mcp_server/surface.py), and --verify checks each file's digest against what resources/read returns."""
    p = _run([inspector, "--cli", "-e", f"CURRY_TRAIN_ROOT={project}", *SERVER, "--method", "skills/list",
              "--verify"], dict(os.environ), tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    reports = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    names = {r["name"] for r in reports}
    assert {"bench", "stage4-parallel-primitive-intro"} <= names, p.stdout[-2000:]
    assert all(r["outcome"] == "verified" for r in reports), [r for r in reports if r["outcome"] != "verified"]
