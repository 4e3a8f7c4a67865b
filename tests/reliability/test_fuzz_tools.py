"""Property-based fuzzing of every tool's arguments, through the in-memory client and a real stdio server.

    .venv/bin/pytest tests/reliability/test_fuzz_tools.py -q -s      # -s prints the figures per tool

For each of the nine tools hypothesis draws argument dicts that are mostly wrong (path-like and unicode names, wrong
types, out-of-range numbers, unknown or contradictory overrides, unknown arguments, missing required ones) with a
few valid cheap ones. Properties: every call answers within its bound (no hang), the server never crashes (an
error is never the SDK's bare "Error executing tool <name>", the text of a crash), every rejection names the field
or the value it refused and says how to fix it, and no long job is launched with input that should be refused.

Cost: a long tool (bench, white-box, measured probe or sweep) is never launched here. In memory its launcher
(`run_worker`) is replaced by a stand-in that checks the request is valid and answers with a canned result or a
worker failure of each kind; over stdio every long-tool call carries a defect that must be caught before launch,
and the ledger is checked to be empty afterwards. The cheap-but-not-free tools (plan, capacity_sweep) get a budget
of successful calls, after which every case carries a defect. `derandomize=True`: CI replays the same cases.
The argument strategies and the forced defects are in tests/reliability/fuzz_strategies.py.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from curry_train.advice.sweep import SweepResult
from curry_train.config import flatten, load_config
from curry_train.measure.bench import BenchResult, MemoryBreakdown
from curry_train.measure.hardware import HardwareReport
from curry_train.store.runs import Ledger
from curry_train_mcp import server as server_mod
from curry_train_mcp.jobs import WorkerError
from fuzz_strategies import STRATEGIES, TOOLS, with_defect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from rel_support import SERVER, assert_clear_error, text_of

from tests.conftest import shipped_configs

pytestmark = pytest.mark.slow

# Cases per tool. The default is sized for CI's five-minute suite (about 25 s for all tools on the 2-core
# machine); CURRY_TEST_FULL=1 is the nightly budget (800 in memory, 250 over stdio), and CURRY_FUZZ_MEMORY /
# CURRY_FUZZ_STDIO set either outright. derandomize=True: the CI cases are the first cases of the nightly run.
_FULL = os.environ.get("CURRY_TEST_FULL") == "1"
CASES = {"memory": int(os.environ.get("CURRY_FUZZ_MEMORY", "800" if _FULL else "120")),
         "stdio": int(os.environ.get("CURRY_FUZZ_STDIO", "250" if _FULL else "40"))}
CALL_BOUND_S = 60.0  # a single call slower than this is a hang (the slowest valid case here takes ~1 s)
LONG = {"bench", "whitebox_compare", "probe_hardware"}
BUDGET = {"plan": 25, "capacity_sweep": 10}  # successful (computed) calls per transport before defects are forced
STATS: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))

# ------------------------------------------------------------------------------------------ the launch stand-in

CANNED = {
    "bench": BenchResult(run_id="bench-canned", config_name="tiny", world_size=1, device="cpu", parallel={"dp": 1},
                         steps=1, warmup=0, step_time_s=0.1, tokens_per_s=1.0, peak_memory_bytes=1,
                         memory_breakdown=MemoryBreakdown(), memory_budget_bytes=1, loss_finite=True, oom=False,
                         wall_s=0.1).model_dump(mode="json"),
    "whitebox": {"passed": True, "world_size": 1, "steps": 1, "losses_ref": [1.0], "losses_parallel": [1.0],
                 "loss_max_diff": 0.0, "grad_norm_ref": [1.0], "grad_norm_parallel": [1.0], "worst_parameter": None,
                 "first_diverging_layer": None, "tolerance": {"loss": 0.0}, "n_params_compared": 1},
    "probe": HardwareReport(gpu_count=0, cpu_count=2, source="none").model_dump(mode="json"),
    "sweep": SweepResult(config="tiny", mode="measured", budget_bytes=1, usable_bytes=1, micro_batch=1, family=[],
                         rungs=[], seconds=0.0).model_dump(mode="json"),
}
OUTCOMES = ["result", "invalid", "failed", "busy", "cancelled", "bug", "timeout", "result"]


class FakeLauncher:
    """Stands in for jobs.run_worker: checks that what reached the launch is valid, answers every outcome in turn."""

    def __init__(self, root: Path):
        self.root = root
        self.outcomes = itertools.cycle(OUTCOMES)
        self.last: str | None = None

    async def __call__(self, task: str, args: dict[str, Any], *, ctx: Any = None, deadline_s: float, label: str,
                       root: str | None = None) -> dict[str, Any]:
        from curry_train.measure.service import resolve

        assert task in CANNED, task
        json.dumps(args)  # the request must travel as JSON
        assert 0 < deadline_s <= 24 * 3600, deadline_s
        if "config" in args:  # nothing may launch with a config that does not validate
            cfg, _ = resolve(args["config"], args.get("overrides") or {}, self.root)
            if args.get("inject") is not None:  # ... nor with a planted bug that cannot apply to it
                from curry_train.validation.inject import check

                check(args["inject"], cfg)
        self.last = next(self.outcomes)
        if self.last == "result":
            return CANNED[task]
        if self.last == "timeout":
            raise TimeoutError
        raise WorkerError(self.last, f"simulated {self.last} outcome of the {task} worker")


# ------------------------------------------------------------------------------------------ fixtures


def _fuzz_project(base: Path) -> tuple[Path, list[str]]:
    """A throwaway project with two finished bench runs (RUN_A, RUN_B in the strategies) for runs_diff."""
    project = base / "project"
    shipped_configs(project / "configs")
    (project / "runs").mkdir()
    ledger = Ledger(project)
    ids = []
    for dp in (1, 2):
        rec = ledger.start("bench", load_config(project / "configs" / "tiny.yaml", {"parallel.dp": dp}), "tiny")
        ledger.finish(rec.run_id, status="ok", metrics={"step_time_s": 0.1 * dp, "peak_memory_bytes": 100,
                                                          "losses": [5.0, 4.0]})
        ids.append(rec.run_id)
    return project, ids


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    project, ids = _fuzz_project(tmp_path_factory.mktemp("fuzz"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CURRY_TRAIN_ROOT", str(project))
        fake = FakeLauncher(project)
        mp.setattr("curry_train_mcp.app.run_worker", fake)  # the name app._long calls
        yield project, ids, fake
    _print_figures()


@pytest.fixture(scope="module")
def memory_client(fuzz_env):
    with start_blocking_portal() as portal:
        cm = portal.wrap_async_context_manager(portal.call(lambda: Client(server_mod.mcp, raise_exceptions=True)))
        client = cm.__enter__()
        try:
            yield portal, client
        finally:
            cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def stdio_mcp(fuzz_env):
    project, _, _ = fuzz_env
    env = {"CURRY_TRAIN_ROOT": str(project), "PATH": os.environ.get("PATH", ""),
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    params = StdioServerParameters(command=sys.executable, args=[*SERVER[1:], "--log-level", "ERROR"],
                                   cwd=str(project), env=env)
    log = open(project.parent / "stdio-server.log", "w")  # noqa: SIM115 - closed below
    with start_blocking_portal() as portal:
        cm = portal.wrap_async_context_manager(portal.call(
            lambda: Client(stdio_client(params, errlog=log), mode="legacy", read_timeout_seconds=CALL_BOUND_S)))
        client = cm.__enter__()
        try:
            yield portal, client
        finally:
            cm.__exit__(None, None, None)
            log.close()


async def _call(client: Client, tool: str, args: dict[str, Any]) -> Any:
    with anyio.fail_after(CALL_BOUND_S):
        return await client.call_tool(tool, args)


def _field_names(tool: str, args: Any) -> set[str]:
    """The fields a refusal of this call may name: the arguments it gave (with the keys of a dict argument, e.g. an
    override), and the required ones it left out. Not every parameter of the tool, nor every config key: an error
    that names a field the call never touched names the wrong one."""
    given = set(args) if isinstance(args, dict) else set()
    fields = given | set(server_mod.mcp._tool_manager.get_tool(tool).parameters.get("required", []))
    for v in (args or {}).values() if isinstance(args, dict) else []:
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            fields |= set(v) | set(flatten(v))
    return {f for f in fields if f}


def _resolve_ids(args: dict[str, Any], ids: list[str]) -> dict[str, Any]:
    return {k: (ids[0] if v == "RUN_A" else ids[1] if v == "RUN_B" else v) for k, v in args.items()}


def _check(tool: str, transport: str, args: dict[str, Any], result: Any, launched: str | None,
           wrong: str | None) -> None:
    s = STATS[(tool, transport)]
    s["cases"] += 1
    text = text_of(result)
    if launched is not None:
        s["launch_reached"] += 1
    if not result.is_error:
        s["ok"] += 1
        assert result.structured_content is not None, f"{tool}: a success without structured content"
        return
    s["rejected"] += 1
    if launched is not None and launched != "result":  # a worker failure of that kind, mapped by server._long
        assert tool in text, f"the error does not say which tool failed: {text[:300]}"
        assert any(w in text.lower() for w in ("retry", "fix", "read the", "killed", "server log")), text
        return
    assert_clear_error(tool, args, text, _field_names(tool, args))
    if wrong is not None:  # one field was made wrong: the error names it (or the value it refused)
        value = args[wrong]
        named = wrong in text or (isinstance(value, str) and value and repr(value)[1:-1][:40] in text) or (
            isinstance(value, dict) and any(str(k) in text for k in value))
        assert named, f"{tool}: {wrong}={value!r} refused without naming it: {text[:400]}"


def _run_case(client_fixture: tuple, tool: str, transport: str, case: tuple[dict[str, Any], str | None], pick: int,
              fuzz_env) -> None:
    portal, client = client_fixture
    _, ids, fake = fuzz_env
    args, wrong = case
    args = _resolve_ids(args, ids)
    stats = STATS[(tool, transport)]
    spent = stats["ok"] >= BUDGET.get(tool, 1 << 30)
    if (transport == "stdio" and tool in LONG) or (tool in BUDGET and (spent or (transport == "stdio" and
                                                                                 args.get("measured") is True))):
        # the case may be wrong elsewhere already (chaos), so the refusal may name that field instead of the defect's
        args, wrong = with_defect(tool, args, pick)[0], None
    fake.last = None
    t0 = time.perf_counter()
    result = portal.call(_call, client, tool, args)
    stats["seconds"] += time.perf_counter() - t0
    _check(tool, transport, args, result, fake.last if transport == "memory" else None, wrong)


FUZZ = {"deadline": None, "derandomize": True, "database": None, "print_blob": True,
        "suppress_health_check": list(HealthCheck)}


# ------------------------------------------------------------------------------------------ the properties


@pytest.mark.parametrize("tool", TOOLS)
def test_in_memory_fuzzing_never_crashes_hangs_or_launches_bad_input(tool, memory_client, fuzz_env):
    @settings(max_examples=CASES["memory"], **FUZZ)
    @given(case=STRATEGIES[tool], pick=st.integers(0, 99))
    def run(case: tuple[dict[str, Any], str | None], pick: int) -> None:
        _run_case(memory_client, tool, "memory", case, pick, fuzz_env)

    run()


@pytest.mark.parametrize("tool", TOOLS)
def test_stdio_fuzzing_never_crashes_hangs_or_launches(tool, stdio_mcp, fuzz_env):
    @settings(max_examples=CASES["stdio"], **FUZZ)
    @given(case=STRATEGIES[tool], pick=st.integers(0, 99))
    def run(case: tuple[dict[str, Any], str | None], pick: int) -> None:
        _run_case(stdio_mcp, tool, "stdio", case, pick, fuzz_env)

    run()
    portal, client = stdio_mcp
    tools = portal.call(client.list_tools)  # still serving
    assert tool in {t.name for t in tools.tools}
    project, ids, _ = fuzz_env
    assert {r.run_id for r in Ledger(project).list(100)} == set(ids), "a long tool launched over stdio"


def test_unknown_arguments_are_refused_and_named(memory_client, fuzz_env):
    """A typo ("step" for "steps") must not silently run a different measurement than the caller asked for."""
    portal, client = memory_client
    for tool, args in [("bench", {"config": "tiny", "step": 3}), ("estimate_memory", {"config": "tiny", "dp": 2}),
                       ("update_config", {"name": "fz-x", "changes": {}, "base": "tiny", "force": True})]:
        r = portal.call(_call, client, tool, args)
        text = text_of(r)
        assert r.is_error, f"{tool} accepted an unknown argument: {text[:200]}"
        bad = next(k for k in args if k not in ("config", "name", "changes", "base"))
        assert bad in text and "takes" in text, text


def _print_figures() -> None:
    if not STATS:
        return
    lines = ["", "fuzz figures: tool  transport  cases  ok  rejected  launch_reached  seconds"]
    per_tool: dict[str, float] = defaultdict(float)
    for (tool, transport), s in sorted(STATS.items()):
        per_tool[tool] += s["cases"]
        lines.append(f"  {tool:17s} {transport:6s} {int(s['cases']):5d} {int(s['ok']):5d} {int(s['rejected']):5d} "
                     f"{int(s['launch_reached']):5d} {s['seconds']:7.2f}")
    lines.append("  cases per tool (both transports): " + ", ".join(f"{t}={int(n)}" for t, n in per_tool.items()))
    print("\n".join(lines))


def test_the_clear_error_check_fails_an_error_naming_an_untouched_field_or_no_fix():
    """The check itself can fail: the field must be one the call gave (or a required one it left out), and the fix
    a whole word of ACTIONABLE ("invalid" or "a list" is no fix)."""
    args = {"config": "tiny", "steps": 0}
    fields = _field_names("bench", args)
    assert "warmup" not in fields and "train.seq_len" not in fields  # a parameter or config key not touched
    assert_clear_error("bench", args, "steps=0: use steps >= 1", fields)
    for text in ("warmup=0: use warmup >= 1", "steps=0 is invalid", "steps: not a list"):
        with pytest.raises(AssertionError):
            assert_clear_error("bench", args, text, fields)
