"""Many calls at once: two benches serialise on the device lock while estimates, diffs and config writes keep
answering, correctly.

    .venv/bin/pytest tests/reliability/test_concurrency.py -q -s      # -s prints the latencies

Two 1-rank benches start together through the in-memory client, and three loops of cheap calls run until both
finish. The benches' ledger intervals must not overlap (one waited for the lock and said so), every cheap result
must equal the one computed alone beforehand, and at least 20 cheap calls must complete while the benches hold the
device (calls queued behind the lock would complete only after it). Their latency is printed, not bounded: speed
lives in benchmarks/server_latency.py. The workers fork their one rank (tests/forkworker.py): the device lock, not
torchrun, is the subject here.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import anyio
import pytest
from curry_train.config import load_config
from curry_train.paths import written_config_path
from curry_train.store.runs import Ledger
from curry_train_mcp.server import mcp
from mcp import Client
from rel_support import text_of

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

CHEAP: list[tuple[str, dict[str, Any]]] = [
    ("estimate_memory", {"config": "tiny"}),
    ("estimate_memory", {"config": "tiny", "overrides": {"parallel.dp": 2, "parallel.zero": 1}}),
    ("estimate_memory", {"config": "llama3-8b", "overrides": {"parallel.dp": 8, "parallel.zero": 3}}),
    ("recommend_next", {"config": "tiny", "symptom": "oom", "overrides": {"hardware.gpu_memory_gib": 0.004}}),
    ("runs_diff", {"run_a": "A", "run_b": "B"}),
]


@pytest.fixture(autouse=True)
def _root(project, monkeypatch):
    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))


def _seed_runs(project) -> dict[str, str]:
    ledger = Ledger(project)
    ids = {}
    for key, dp, t in (("A", 1, 0.2), ("B", 2, 0.1)):
        rec = ledger.start("bench", load_config(project / "configs" / "tiny.yaml", {"parallel.dp": dp}), "tiny")
        ledger.finish(rec.run_id, status="ok", metrics={"step_time_s": t, "peak_memory_bytes": 100})
        ids[key] = rec.run_id
    return ids


def _args(args: dict[str, Any], ids: dict[str, str]) -> dict[str, Any]:
    return {k: ids.get(v, v) if isinstance(v, str) else v for k, v in args.items()}


@pytest.mark.anyio
async def test_benches_serialise_on_the_device_lock_while_cheap_tools_keep_answering_correctly(project):
    ids = _seed_runs(project)
    latencies: dict[str, list[float]] = defaultdict(list)
    during: list[float] = []
    progress: dict[int, list[str]] = {1: [], 2: []}
    benches: dict[int, Any] = {}
    window: dict[str, float] = {}
    writes: list[tuple[str, int]] = []
    async with Client(mcp, raise_exceptions=True) as c:
        reference = {}
        for tool, args in CHEAP:  # each answer computed alone first
            r = await c.call_tool(tool, _args(args, ids))
            assert not r.is_error, text_of(r)
            reference[(tool, repr(args))] = r.structured_content
        done = anyio.Event()

        async def bench(seed: int) -> None:
            async def on_progress(p: float, total: float | None, message: str | None) -> None:
                progress[seed].append(message or "")

            benches[seed] = await c.call_tool("bench", {"config": "tiny", "steps": 1, "warmup": 0, "timeout_s": 300,
                                                        "overrides": {"train.seed": seed}},
                                              progress_callback=on_progress)

        async def cheap(loop: int) -> None:
            n = 0
            while not done.is_set():
                for tool, args in CHEAP:
                    t0 = time.perf_counter()
                    r = await c.call_tool(tool, _args(args, ids))
                    dt = time.perf_counter() - t0
                    latencies[tool].append(dt)
                    if "start" in window and "end" not in window:
                        during.append(dt)
                    assert not r.is_error, text_of(r)
                    assert r.structured_content == reference[(tool, repr(args))], f"{tool} changed under load"
                n += 1
                name, seed = f"conc-{loop}-{n % 3}", 1000 * loop + n  # config writes to distinct names
                r = await c.call_tool("update_config", {"name": name, "changes": {"train.seed": seed},
                                                        "base": "tiny"})
                assert not r.is_error, text_of(r)
                writes.append((name, seed))
                await anyio.sleep(0.25)  # still hundreds of calls while the benches run

        async with anyio.create_task_group() as tg:
            for loop in range(3):
                tg.start_soon(cheap, loop)
            window["start"] = time.monotonic()
            async with anyio.create_task_group() as both:
                both.start_soon(bench, 1)
                both.start_soon(bench, 2)
            window["end"] = time.monotonic()
            done.set()

        for seed, r in benches.items():
            assert not r.is_error, text_of(r)
            out = r.structured_content
            assert out["world_size"] == 1 and out["loss_finite"] and out["peak_memory_bytes"] > 0, out
        runs = {seed: Ledger(project).get(r.structured_content["run_id"]) for seed, r in benches.items()}
        diff = await c.call_tool("runs_diff", {"run_a": runs[1].run_id, "run_b": runs[2].run_id})
        assert [(x["key"], x["a"], x["b"]) for x in diff.structured_content["config_changes"]] == \
            [("train.seed", 1, 2)]

    # the benches ran one after the other: their ledger intervals do not overlap, and one of them waited
    first, second = sorted(runs.values(), key=lambda r: r.created)
    assert first.status == second.status == "ok"
    assert first.finished <= second.created, "two benches held the device at the same time"
    waited = [s for s, msgs in progress.items() if any("waiting for the device lock" in m for m in msgs)]
    assert len(waited) == 1, progress
    # every config write landed as written (the last write to each name wins)
    last = {}
    for name, seed in writes:
        last[name] = seed
    for name, seed in last.items():
        assert load_config(written_config_path(name, project)).train.seed == seed  # configs/local/
    # responsiveness while the device was busy
    bench_wall = window["end"] - window["start"]
    assert len(during) >= 20, f"only {len(during)} cheap calls completed while the benches ran"
    p50, worst = statistics.median(during), max(during)
    print(f"\nconcurrency figures: 2 benches took {bench_wall:.1f}s end to end (serialised: "
          f"{first.finished - first.created:.1f}s + {second.finished - second.created:.1f}s); "
          f"{len(during)} cheap calls meanwhile, latency p50 {p50 * 1e3:.0f} ms, max {worst * 1e3:.0f} ms; "
          + ", ".join(f"{t} p50 {statistics.median(v) * 1e3:.0f} ms" for t, v in latencies.items())
          + f"; {len(writes)} config writes")
