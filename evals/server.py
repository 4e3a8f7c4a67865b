"""The curryTrain MCP server as the evals see it: one stdio process in a throwaway project root, and its client.

Shared by the scripted replay (evals/runner.py) and the live mode (evals/live.py). The server is started the
way a host starts it (`curry-train mcp` over stdio, through the official `mcp` client), with the repository's
configs copied into a temporary root, so an eval never writes into the repository.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def make_project(tmp: Path) -> Path:
    """A throwaway project root: the repository's configs (no history) and an empty runs/."""
    (tmp / "configs").mkdir(parents=True)
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        shutil.copy2(p, tmp / "configs" / p.name)
    (tmp / "runs").mkdir()
    return tmp


def default_server_command() -> list[str]:
    """`curry-train mcp` from the same environment as this interpreter."""
    script = Path(sys.executable).with_name("curry-train")
    if script.exists():
        return [str(script), "mcp"]
    return [sys.executable, "-m", "curry_train.cli", "mcp"]


def server_env(project: Path) -> dict[str, str]:
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
    env = {k: v for k, v in os.environ.items() if not secret.search(k)}
    env["CURRY_TRAIN_ROOT"] = str(project)  # the server's project root (also its cwd): never the repository
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _open_log(path: Path) -> Any:
    """The server's stderr goes here (printed on failure), never onto the runner's output."""
    return path.open("a", encoding="utf-8")


@dataclass
class Server:
    """One stdio server process and the connected client, for one protocol era."""

    command: list[str]
    project: Path
    era: str
    log: Path
    client: Any = None
    _stack: contextlib.AsyncExitStack | None = None
    tools: dict[str, Any] = field(default_factory=dict)

    async def start(self) -> None:
        from mcp import Client, StdioServerParameters, stdio_client

        params = StdioServerParameters(command=self.command[0], args=self.command[1:], cwd=str(self.project),
                                       env=server_env(self.project))
        self._stack = contextlib.AsyncExitStack()
        errlog = self._stack.enter_context(_open_log(self.log))
        # No cancel scope around the entry: the client's task group must outlive it (anyio nesting rules).
        self.client = await self._stack.enter_async_context(
            Client(stdio_client(params, errlog=errlog), mode=self.era, read_timeout_seconds=180))
        self.tools = {t.name: t for t in (await self.client.list_tools()).tools}

    async def stop(self) -> None:
        if self._stack is not None:  # closing stdin ends the server; the SDK kills it if it lingers
            with contextlib.suppress(Exception):
                await self._stack.aclose()
        self._stack, self.client = None, None

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def result_text(result: Any) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content if getattr(b, "type", "") == "text")
