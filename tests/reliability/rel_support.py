"""Shared helpers for the reliability tests: process-tree counting, clear-error checks, a raw stdio JSON-RPC client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from curry_train_mcp.jobs import alive, descendants

REPO = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "curry_train.cli", "mcp"]  # what `curry-train mcp` runs

# An error must say what to do, not only that something failed.
# A fix is a verb or a bound the reader can act on, as a whole word: "invalid" or "a list" say no fix.
ACTIONABLE = re.compile(
    r"\b(should|must|fix|use|pass|give|set|available|known|allow(?:ed|s)?|retry|required|pick|choose|e\.g\.|expected|"
    r"at least \S+|at most \S+|list \S+ with|one of|greater|less|call again|larger|fewer|read the)\b", re.IGNORECASE)


def server_env(project: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "CURRY_TRAIN_ROOT": str(project), "PYTHONUNBUFFERED": "1", **extra}


def text_of(result: Any) -> str:
    return "\n".join(b.text for b in result.content if getattr(b, "type", None) == "text")


def assert_clear_error(tool: str, args: dict[str, Any], text: str, field_names: set[str]) -> None:
    """A rejection names the offending field (or the value it got) and says how to fix it; never a bare crash."""
    where = f"{tool}({json.dumps(args, default=repr)[:300]})"
    body = text.removeprefix(f"Error executing tool {tool}").lstrip(":").strip()
    assert body, f"bare crash (the tool raised something unexpected) for {where}: {text!r}"
    assert "Traceback (most recent call last)" not in body, f"traceback leaked for {where}: {text[:500]!r}"
    assert ACTIONABLE.search(body), f"no fix in the error for {where}: {text[:500]!r}"
    mentioned = any(f in body for f in field_names) or any(
        isinstance(v, str) and v and repr(v)[1:-1][:40] in body for v in _leaves(args))
    assert mentioned, f"the error names no field of {sorted(field_names)} for {where}: {text[:500]!r}"


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in (k, *_leaves(v))]
    if isinstance(obj, list):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


# ------------------------------------------------------------------------------------------ processes


def tree(pid: int) -> dict[int, int]:
    """Every process below pid ({pid: start time}), from a /proc scan."""
    return descendants(pid)


def wait_gone(procs: dict[int, int], timeout: float) -> tuple[float, list[int]]:
    """Seconds until none of procs is alive (or the timeout), and the survivors."""
    t0 = time.monotonic()
    while alive(procs) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return time.monotonic() - t0, alive(procs)


# ------------------------------------------------------------------------------------------ raw stdio


class RawServer:
    """`curry-train mcp` over stdio, spoken to line by line (the 2025-06-18 handshake an older host sends)."""

    def __init__(self, project: Path, log: Path):
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([*SERVER, "--log-level", "WARNING"], cwd=project, env=server_env(project),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._id = 0
        self.progress: list[str] = []
        self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "reliability", "version": "0"}}, timeout=120)
        self.notify("notifications/initialized")

    def notify(self, method: str, params: dict | None = None) -> None:
        msg = {"jsonrpc": "2.0", "method": method, **({"params": params} if params is not None else {})}
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def send(self, method: str, params: dict) -> int:
        self._id += 1
        self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": self._id, "method": method, "params": params}) + "\n")
        self.proc.stdin.flush()
        return self._id

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"server exited with {self.proc.poll()}"
        msg = json.loads(line)
        if msg.get("method") == "notifications/progress":
            self.progress.append(msg["params"].get("message") or "")
        return msg

    def request(self, method: str, params: dict, timeout: float = 60) -> dict:
        rid = self.send(method, params)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.read()
            if msg.get("id") == rid:
                return msg
        raise TimeoutError(f"no answer to {method} in {timeout}s")

    def call(self, tool: str, args: dict, timeout: float = 60) -> dict:
        return self.request("tools/call", {"name": tool, "arguments": args}, timeout)["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
