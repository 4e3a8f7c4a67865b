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
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from rel_support import REPO, SERVER, assert_clear_error, text_of

pytestmark = pytest.mark.slow

# per tool; CURRY_FUZZ_MEMORY / CURRY_FUZZ_STDIO scale them (e.g. 10x for a long local run)
CASES = {"memory": int(os.environ.get("CURRY_FUZZ_MEMORY", "800")),
         "stdio": int(os.environ.get("CURRY_FUZZ_STDIO", "250"))}
CALL_BOUND_S = 60.0  # a single call slower than this is a hang (the slowest valid case here takes ~1 s)
LONG = {"bench", "whitebox_compare", "probe_hardware"}
BUDGET = {"plan": 25, "capacity_sweep": 10}  # successful (computed) calls per transport before defects are forced
STATS: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))

# ------------------------------------------------------------------------------------------ strategies

GOOD_CONFIGS = ["tiny", "tiny-moe"]
BAD_NAMES = ["", ".", "..", "../configs/tiny", "../../etc/passwd", "/etc/passwd", "configs/tiny", "tiny/", "tiny\n",
             "tiny\x00", "\x00", "con", "CON", "nul.yaml", "aux", "com1", "lpt9.txt", "x" * 65, "y" * 1000, "tiny.",
             " tiny", "tiny ", "\uff54\uff49\uff4e\uff59", "tiny;rm -rf ~", "$(id)", "~/x", "C:\\x", "tiny\\..\\x",
             "-rf", ".hidden", "%2e%2e%2f", "\u202etiny", "nope", "Tiny", "tiny.yml", "tiny.yaml/", "\ttiny"]
REAL_KEYS = sorted(flatten(load_config(REPO / "configs" / "tiny.yaml").to_dict()))
BAD_KEYS = ["", ".", "parallel", "parallel.", ".dp", "parallel.dp.x", "a.b.c", "model.__class__", "__proto__",
            "parallel.nope", "PARALLEL.DP", "parallel..dp", "hardware.gpu_memory_gib.0", "train", "x" * 300]
VALID_OVERRIDES = [{}, {"parallel.dp": 2}, {"parallel.zero": 1, "parallel.dp": 2}, {"parallel.recompute": "full"},
                   {"hardware.gpu_memory_gib": 0.004}, {"parallel.tp": 2}, {"train.seed": 3}, {"parallel": {"dp": 2}}]
INVALID_OVERRIDES = [{"parallel.nope": 1}, {"parallel.tp": 3}, {"parallel.dp": 0}, {"parallel.dp": "two"},
                     {"train.seq_len": -1}, {"parallel.recompute": "sometimes"}, {"": 1}, {"parallel": 1}]
NOT_BOOL = st.sampled_from(["maybe", 2, -1, 0.5, [], {}, [True], "tru", "enabled", None])  # lax bool refuses these

JUNK = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([-1, 0, 2**31, 2**63, 10**30, -(10**30), 10**400]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e-300, 1e300, -0.0, 5e-324]),
    st.text(max_size=30), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                max_size=2))


def names(good: list[str]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(good), st.sampled_from(BAD_NAMES), st.text(max_size=70),
                     st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True), JUNK)


OVERRIDE_VALUE = st.one_of(JUNK, st.sampled_from([1, 2, 3, 4, 0, "full", "none", "selective", "1f1b", "bfloat16",
                                                  True, False, 1e-6, 1e9, 10**12]))
OVERRIDES = st.one_of(
    st.sampled_from(VALID_OVERRIDES), st.sampled_from(INVALID_OVERRIDES),
    st.dictionaries(st.one_of(st.sampled_from(REAL_KEYS), st.sampled_from(BAD_KEYS), st.text(max_size=20)),
                    OVERRIDE_VALUE, max_size=4),
    JUNK)


def ints(lo: int, hi: int) -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo - 1, hi + 1, -5, 3.5, "5", "five"]), JUNK)


def args_for(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Usually every required argument, some optional ones, sometimes an unknown one; now and then a missing one."""
    base = st.fixed_dictionaries(required, optional=optional)
    extra = st.dictionaries(
        st.sampled_from(["step", "config_name", "override", "path", "cmd", "__class__"]), JUNK, min_size=1,
        max_size=1)
    first = list(required)[:1]

    def shape(t: tuple[dict, dict, int]) -> dict[str, Any]:
        args, unknown, how = t
        if how == 0:  # a required argument missing
            return {k: v for k, v in args.items() if k not in first}
        if how == 1:  # an argument the tool does not take
            return {**args, **unknown}
        return args

    return st.tuples(base, extra, st.integers(0, 9)).map(shape)


BOOL = st.one_of(st.booleans(), NOT_BOOL)
TIMEOUT = st.one_of(st.sampled_from([0, -1, 1e-9, 86401, "soon", 900.0]), st.floats(0.1, 3600), JUNK)
HW = st.one_of(st.none(), st.sampled_from(["A100-40", "A100-80", "H100", "H200", "CPU", "B300", "h100", "", "\x00"]),
               JUNK)
RUN_IDS = st.one_of(st.sampled_from(["RUN_A", "RUN_B", "bench-nope", "../runs", "ledger.sqlite3", ".device.lock",
                                     "/etc", "run\n"]), names(["bench-20250101-000000-abcdef"]))

CHAOS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "probe_hardware": args_for({}, {"measure": BOOL}),
    "bench": args_for({"config": names(GOOD_CONFIGS)},
                      {"steps": ints(1, 1000), "warmup": ints(0, 100), "overrides": OVERRIDES, "plot": BOOL,
                       "timeout_s": TIMEOUT}),
    "whitebox_compare": args_for({"config": names(GOOD_CONFIGS)},
                                 {"steps": ints(1, 50), "overrides": OVERRIDES, "timeout_s": TIMEOUT,
                                  "inject": st.one_of(st.none(), names(["data-same-rows", "replica-lr", "nope"]))}),
    "update_config": args_for({"name": names(["fz-a", "fz-b", "fz-c.2"]), "changes": OVERRIDES},
                              {"base": st.one_of(st.none(), names(GOOD_CONFIGS))}),
    "runs_diff": args_for({"run_a": RUN_IDS, "run_b": RUN_IDS}, {}),
    "estimate_memory": args_for({"config": names(GOOD_CONFIGS + ["llama3-8b"])},
                                {"overrides": OVERRIDES, "hardware": HW, "plot": st.one_of(st.just(False), NOT_BOOL)}),
    "recommend_next": args_for({"config": names(GOOD_CONFIGS + ["llama3-8b"])},
                               {"symptom": st.one_of(st.sampled_from(["oom", "slow", "none", None, "OOM", "fast"]),
                                                     JUNK),
                                "overrides": OVERRIDES, "measured_peak_bytes": st.one_of(st.none(), ints(1, 2**50)),
                                "hardware": HW}),
    "plan": args_for({"model": names(GOOD_CONFIGS + ["llama3-8b"]),
                      "gpus_per_node": st.one_of(st.sampled_from([1, 2, 8]), ints(1, 1024)),
                      "nodes": st.one_of(st.sampled_from([1, 2, 4]), ints(1, 100_000)),
                      "gpu_memory_gib": st.one_of(st.sampled_from([0.001, 1.0, 80]), st.floats(-1, 5000), JUNK),
                      "seq_len": st.one_of(st.sampled_from([2, 64, 4096]), ints(2, 10**7)),
                      "global_batch": st.one_of(st.sampled_from([1, 8, 256]), ints(1, 10**8))},
                     {"micro_batch": st.one_of(st.sampled_from([1, 2, 1000]), ints(1, 10**9)), "hardware": HW,
                      "plot": st.one_of(st.just(False), NOT_BOOL)}),
    "capacity_sweep": args_for({"config": names(GOOD_CONFIGS)},
                               {"overrides": OVERRIDES, "measured": BOOL,
                                "rungs": st.one_of(st.none(), st.lists(st.sampled_from(["single", "zero3", "tp2",
                                                                                        "bogus", ""]), max_size=2),
                                                   JUNK),
                                "max_micro_batch": ints(1, 1 << 20), "max_runs_per_rung": ints(1, 64),
                                "timeout_s": TIMEOUT}),
}

# Valid arguments (the long tools' launches go to the stand-in in memory; cheap tools compute for real).
STEADY_OVERRIDES = st.sampled_from(VALID_OVERRIDES[:6])
VALID: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "probe_hardware": st.fixed_dictionaries({}, optional={"measure": st.booleans()}),
    "bench": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS)}, optional={
        "steps": st.integers(1, 1000), "warmup": st.integers(0, 100), "overrides": STEADY_OVERRIDES,
        "plot": st.booleans(), "timeout_s": st.floats(1, 3600)}),
    "whitebox_compare": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS)}, optional={
        "steps": st.integers(1, 50), "overrides": STEADY_OVERRIDES, "timeout_s": st.floats(1, 3600)}),
    "update_config": st.fixed_dictionaries({"name": st.sampled_from(["fz-a", "fz-b", "fz-c.2"]),
                                            "changes": st.one_of(STEADY_OVERRIDES, st.fixed_dictionaries(
                                                {"train.seed": st.integers(0, 2**31)}))},
                                           optional={"base": st.sampled_from(GOOD_CONFIGS)}),
    "runs_diff": st.fixed_dictionaries({"run_a": st.sampled_from(["RUN_A", "RUN_B"]),
                                        "run_b": st.sampled_from(["RUN_A", "RUN_B"])}),
    "estimate_memory": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS + ["llama3-8b"])}, optional={
        "overrides": STEADY_OVERRIDES, "hardware": st.sampled_from([None, "A100-80", "H100", "CPU"])}),
    "recommend_next": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS + ["llama3-8b"])}, optional={
        "symptom": st.sampled_from(["oom", "slow", "none", None]), "overrides": STEADY_OVERRIDES,
        "measured_peak_bytes": st.one_of(st.none(), st.integers(1, 2**40)),
        "hardware": st.sampled_from([None, "H100", "CPU"])}),
    "plan": st.fixed_dictionaries({"model": st.sampled_from(GOOD_CONFIGS), "gpus_per_node": st.sampled_from([1, 2, 8]),
                                   "nodes": st.sampled_from([1, 2]), "gpu_memory_gib": st.sampled_from([0.01, 1.0, 80]),
                                   "seq_len": st.sampled_from([64, 256]), "global_batch": st.sampled_from([8, 64])},
                                  optional={"micro_batch": st.sampled_from([1, 2])}),
    "capacity_sweep": st.fixed_dictionaries({"config": st.sampled_from(GOOD_CONFIGS)}, optional={
        "overrides": STEADY_OVERRIDES, "measured": st.booleans(), "rungs": st.sampled_from([None, ["single"]]),
        "max_micro_batch": st.integers(1, 64), "max_runs_per_rung": st.integers(1, 8)}),
}


def mutated(tool: str) -> st.SearchStrategy[tuple[dict[str, Any], str]]:
    """Valid arguments with one field replaced by a wrong value: the error must name that field."""
    props = server_mod.mcp._tool_manager.get_tool(tool).parameters.get("properties", {})
    nullable = {k for k, v in props.items() if {"type": "null"} in v.get("anyOf", [])}  # None is valid there
    bad = st.one_of(JUNK, NOT_BOOL, st.sampled_from(BAD_NAMES[:20]), st.sampled_from(INVALID_OVERRIDES))
    return st.tuples(VALID[tool], st.sampled_from(sorted(props)), bad).filter(
        lambda t: not (t[2] is None and t[1] in nullable)).map(lambda t: ({**t[0], t[1]: t[2]}, t[1]))


EDGE_VALUES = [0, 1, 2, 3, 7, 10**9, 10**15, 2**63, 1e-12, 0.5, 1e300, "full", "bfloat16", True, False, ""]
EDGE_OVERRIDES = st.dictionaries(st.sampled_from(REAL_KEYS), st.sampled_from(EDGE_VALUES), min_size=1, max_size=2)


def edge(tool: str) -> st.SearchStrategy[tuple[dict[str, Any], None]]:
    """Valid arguments whose overrides push one or two real config keys to an edge (0, 1, huge, tiny): where a
    divide-by-zero or an overflow deep in the estimator would hide."""
    if tool == "update_config":
        return VALID[tool].flatmap(lambda a: EDGE_OVERRIDES.map(lambda o: ({**a, "changes": o}, None)))
    return VALID[tool].flatmap(lambda a: EDGE_OVERRIDES.map(lambda o: ({**a, "overrides": o}, None)))


# (arguments, the field a rejection must name or None): chaos, one wrong field, edge values, or valid.
STRATEGIES: dict[str, st.SearchStrategy[tuple[dict[str, Any], str | None]]] = {
    tool: st.one_of(CHAOS[tool].map(lambda a: (a, None)), mutated(tool),
                    *([edge(tool)] if tool not in ("probe_hardware", "runs_diff", "plan") else []),
                    VALID[tool].map(lambda a: (a, None)))
    for tool in CHAOS
}
TOOLS = sorted(STRATEGIES)

# Defects that must be caught before anything runs: (argument, value). Used over stdio for the long tools (always)
# and for plan / capacity_sweep once their budget of computed calls is spent.
DEFECTS = {
    "probe_hardware": [("measure", v) for v in ["maybe", 2, [], {}, 0.5, "tru", None]],
    "bench": [("config", "../configs/tiny"), ("config", "nope"), ("config", "tiny\n"), ("steps", 0), ("steps", "x"),
              ("warmup", 101), ("overrides", {"parallel.nope": 1}), ("overrides", {"parallel.tp": 3}),
              ("overrides", [1]), ("timeout_s", 0), ("timeout_s", -5), ("stepz", 3)],
    "whitebox_compare": [("config", "/etc/passwd"), ("config", "con"), ("steps", 51), ("steps", None),
                         ("overrides", {"parallel.dp": 0}), ("timeout_s", "soon"), ("stepz", 1),
                         ("inject", "nope"), ("inject", "ep-expert-unreduced"), ("inject", 3)],
    "plan": [("model", "../x"), ("gpus_per_node", 0), ("nodes", -1), ("gpu_memory_gib", 0), ("seq_len", 1),
             ("global_batch", "many"), ("micro_batch", 0)],
    "capacity_sweep": [("config", "a/b"), ("max_micro_batch", 0), ("max_runs_per_rung", 65), ("rungs", ["bogus"]),
                       ("overrides", {"model.n_heads": 3}), ("measured", "maybe")],
}


def with_defect(tool: str, args: dict[str, Any], pick: int) -> dict[str, Any]:
    key, value = DEFECTS[tool][pick % len(DEFECTS[tool])]
    if tool == "capacity_sweep" and args.get("measured") is True:
        args = {**args, "measured": False}
    return {**args, key: value}


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
    shutil.copytree(REPO / "configs", project / "configs")
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
        mp.setattr(server_mod, "run_worker", fake)
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
    fields = set(server_mod.mcp._tool_manager.get_tool(tool).parameters.get("properties", {}))
    fields |= {"config", "name", "run", "argument"} | set(REAL_KEYS)
    for v in (args or {}).values() if isinstance(args, dict) else []:
        if isinstance(v, dict):
            fields |= {str(k) for k in v} | set(flatten(v)) if all(isinstance(k, str) for k in v) else set()
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
        args, wrong = with_defect(tool, args, pick), None
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
