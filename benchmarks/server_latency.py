"""MCP server latency over stdio: cold start to the tools/list answer, and estimate_memory per-call latency.

    .venv/bin/python benchmarks/server_latency.py [--starts 5] [--calls 200]

cold_start_s: spawn `python -m curry_train.cli mcp` -> initialize -> tools/list answered (median of --starts
fresh processes; the same command `curry-train mcp` runs). estimate_p50_ms / p99: round trips of
estimate_memory(config="llama3-8b", overrides={...}) on one warm session, cycling through a few layouts so no
result can come from a cache. Goals (BENCHMARKS.md): cold start < 1.0 s, p50 < 20 ms. Final line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [{"parallel.dp": 8, "parallel.zero": z, "parallel.tp": 1, "parallel.sp": False} for z in (0, 1, 2, 3)] + [
    {"parallel.dp": 4, "parallel.tp": 2, "parallel.zero": 3}, {"parallel.dp": 2, "parallel.tp": 4, "parallel.zero": 3}]


def _params(root: Path) -> StdioServerParameters:
    env = {"CURRY_TRAIN_ROOT": str(root), "PATH": os.environ.get("PATH", "")}
    return StdioServerParameters(command=sys.executable, args=["-m", "curry_train.cli", "mcp"], cwd=str(root), env=env)


async def cold_start(root: Path) -> float:
    t0 = time.perf_counter()
    async with Client(_params(root), read_timeout_seconds=60) as c:
        await c.list_tools()
        return time.perf_counter() - t0


async def estimate_latency(root: Path, calls: int) -> list[float]:
    out = []
    async with Client(_params(root), read_timeout_seconds=60) as c:
        await c.call_tool("estimate_memory", {"config": "llama3-8b"})  # warm the imports
        for i in range(calls):
            t0 = time.perf_counter()
            r = await c.call_tool("estimate_memory", {"config": "llama3-8b", "overrides": LAYOUTS[i % len(LAYOUTS)]})
            out.append(time.perf_counter() - t0)
            if r.is_error:
                raise RuntimeError(r.content[0].text)
    return out


async def main_async(starts: int, calls: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="curry_latency_"))
    shutil.copytree(REPO / "configs", root / "configs")
    colds = [await cold_start(root) for _ in range(starts)]
    lat = sorted(await estimate_latency(root, calls))
    return {"cold_start_s": round(statistics.median(colds), 3), "cold_start_max_s": round(max(colds), 3),
            "estimate_p50_ms": round(1e3 * lat[len(lat) // 2], 2),
            "estimate_p99_ms": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
            "calls": calls, "starts": starts, "goals": {"cold_start_s": 1.0, "estimate_p50_ms": 20}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    print(json.dumps(anyio.run(main_async, a.starts, a.calls)))


if __name__ == "__main__":
    main()
