"""Shared fixtures. Multi-rank tests go through curry_train.train.launch.launch_forkserver (torch preloaded, ~0.3 s a
launch) and batch many checks per launch; the torchrun path is exercised by the CLI tests."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.forkrun import ForkJob

# pytest caches each test module's assertion-rewritten code in tests/__pycache__ only while bytecode may be
# written; under PYTHONDONTWRITEBYTECODE=1 (set on the 2-core machine) every worker re-parses and rewrites ~90 test
# modules at every run, 7 of its 17 CPU-seconds of collection. The modules imported after this line (every test
# module) are cached from the second run on; the source tree is untouched (__pycache__/ is ignored by git).
sys.dont_write_bytecode = False

REPO = Path(__file__).resolve().parents[1]
WRITTEN = "# written by update_config"  # the header update_config puts on every file it writes


def shipped_configs(dest: Path, src: Path = REPO / "configs") -> Path:
    """The presets as shipped, copied to dest/: never what a user (or README command 1's climb) wrote since.

    A file update_config created is skipped (its first version carries WRITTEN); a preset it changed is taken from
    its first saved version in .history/, which is the shipped one. So the tests see the same presets on a fresh
    clone and after an older `curry-train climb` wrote configs/tiny-climb.yaml and configs/.history/ (today's writes
    go to configs/local/, which the glob below does not enter).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*.yaml")):
        history = src / ".history" / p.stem
        first = min(history.glob("*.yaml"), default=p) if history.is_dir() else p
        text = first.read_text(encoding="utf-8")
        if not text.startswith(WRITTEN):
            (dest / p.name).write_text(text, encoding="utf-8")
    return dest


# One intra-op thread per process, set before anything imports torch: the xdist workers and the ranks they start
# share 2 cores, and a second OpenMP thread per worker spins against them (a 50-step tiny run: 4 s alone, ~55 s
# beside three busy workers). The ranks get the same from their launchers (torchrun, launch_forkserver).
os.environ["OMP_NUM_THREADS"] = "1"

# A CURRY_TRAIN_ROOT from the shell would point every tool at a real project: tests set their own (or none).
os.environ.pop("CURRY_TRAIN_ROOT", None)

# The shipped presets for tests that only read one (TINY = PRESETS / "tiny.yaml"); never the checkout's configs/.
PRESETS = shipped_configs(Path(tempfile.mkdtemp(prefix="curry-presets-")) / "configs")
atexit.register(shutil.rmtree, PRESETS.parent, True)
PRESET_NAMES = sorted(p.stem for p in PRESETS.glob("*.yaml"))
# The presets whose plan searches cost 2-10 CPU-s per test on the 2-core machine (benchmarks/suite_cpu.py
# --per-test): a test parametrised over every preset (preset_cases) checks them in the full suite, out of the
# inner loop (`-m "not multirank and not slow"`).
HEAVY_PLANS = frozenset({"deepseek-v3", "gpt3-175b", "megatron-146b", "megatron-1t", "megatron-310b", "mt-nlg-530b"})


def preset_cases() -> list[Any]:
    """Every shipped preset as a parametrize case, the HEAVY_PLANS ones marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY_PLANS else n for n in PRESET_NAMES]


@pytest.fixture(autouse=True)
def _own_project_root(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test runs in a project root of its own (the working directory, which curry_train.paths.project_root
    takes when it holds configs/): a name such as "tiny" resolves to a shipped preset, and a tool that writes
    configs or runs writes there, never into the checkout's configs/ or runs/."""
    root = tmp_path_factory.mktemp("root")
    shipped_configs(root / "configs")
    (root / "runs").mkdir()
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A throwaway project root: the shipped presets in configs/ and an empty runs/ (tools write only there)."""
    shipped_configs(tmp_path / "configs")
    (tmp_path / "runs").mkdir()
    return tmp_path


@pytest.fixture(autouse=True)
def _ranks_forked_unless_torchrun(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a `multirank` test not marked `torchrun`, launch.start_torchrun (and run_torchrun through it) forks the
    ranks from this process's forkserver pool (tests/forkrun.py), and the MCP server's long tools start
    tests/forkworker.py, the real worker forking its ranks likewise. So a test of what the ranks compute (bench,
    train, white-box, climb, an MCP tool) costs one fork per rank, not torchrun's agent and a cold torch import per
    rank; torchrun's own contracts (exit codes, tree kills at deadlines, SIGTERM-ignoring ranks, the OOM marker,
    multi-node agents, cancellation) are the tests marked `torchrun` and those that start a CLI or a server as a
    subprocess, which this cannot reach."""
    node = request.node
    if not node.get_closest_marker("multirank") or node.get_closest_marker("torchrun"):
        return
    import curry_train.train.launch as launch
    import curry_train_mcp.jobs as jobs

    monkeypatch.setattr(launch, "start_torchrun", ForkJob)
    monkeypatch.setattr(jobs, "WORKER", "tests.forkworker")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ------------------------------------------------------------------------------------------ tiers by construction
#
# `-m "not multirank and not slow"` is the inner loop (README, "Tests"). Nobody marks a launching test by hand:
# at collection a test is `multirank` when its body, a fixture it uses, or a helper of the tests/ tree that either
# calls (followed transitively by name) refers to a launcher below, and `slow` when it starts a subprocess. At run
# time the in-process launchers refuse an unmarked test, so a launch the scan cannot see (a tool called by name
# over an in-memory MCP client) fails loudly instead of slowing the fast tier: mark that test by hand.

LAUNCHERS = frozenset({
    "launch_forkserver", "whitebox_batch", "rank_jobs", "run_torchrun", "start_torchrun", "run_whitebox",
    "run_worker", "_long",
})
ARGV_LAUNCHERS = frozenset({"torchrun", "torch.distributed.run"})
SUBPROCESS = frozenset({"subprocess", "Popen", "stdio_client", "StdioServerParameters", "open_process", "RawServer"})
FORKSERVER = frozenset({"launch_forkserver", "whitebox_batch", "rank_jobs"})  # ranks forked from this process's pool


def _code_names(code: Any, out: set[str]) -> None:
    out.update(code.co_names)
    out.update(c for c in code.co_consts if c in ARGV_LAUNCHERS)  # "torchrun" in an argv list
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            _code_names(c, out)


def _names_reached(fn: Any, seen: set[int]) -> set[str]:
    """Names referred to by fn and, transitively, by the tests/ helpers it names (module-level functions and
    classes of the tests tree, looked up in fn's globals)."""
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return set()
    seen.add(id(code))
    names: set[str] = set()
    _code_names(code, names)
    reached = set(names)
    glb = getattr(fn, "__globals__", {})
    for n in names:
        obj = glb.get(n)
        mod = getattr(obj, "__module__", "") or ""
        if obj is None or not (mod.startswith("tests") or mod in _TEST_MODULES):
            continue
        members = [obj] if callable(obj) and hasattr(obj, "__code__") else list(vars(obj).values()) \
            if isinstance(obj, type) else []
        for m in members:
            reached |= _names_reached(m, seen)
    return reached


_TEST_MODULES: set[str] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _TEST_MODULES.update(m for m, mod in sys.modules.items()
                         if str(getattr(mod, "__file__", "") or "").startswith(str(REPO / "tests")))
    lane_of: dict[int, int] = {}
    pool = getattr(sys.modules.get("tests.whitebox_pool"), "whitebox_batch", None)  # imported by the tests using it
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        seen: set[int] = set()
        names = _names_reached(fn, seen)
        for defs in item._fixtureinfo.name2fixturedefs.values():
            for d in defs:
                if d.func not in _HARNESS:  # they name the launchers to refuse or swap them; they launch nothing
                    names |= _names_reached(d.func, seen)
        if names & LAUNCHERS and not item.get_closest_marker("multirank"):
            item.add_marker(pytest.mark.multirank)
        if names & SUBPROCESS and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        pooled = pool is not None and getattr(getattr(item, "module", None), "whitebox_batch", None) is pool
        lane_of[id(item)] = (POOL if pooled else FORKED) if names & FORKSERVER else COLD  # if it launches
    items[:] = _in_lanes(items, lane_of)


# The lanes of launching tests (_in_lanes), in the order the workers take their first batches.
POOL, COLD, FORKED = 0, 1, 2


def _in_lanes(items: list[pytest.Item], lane_of: dict[int, int]) -> list[pytest.Item]:
    """The run order: one lane of launching tests per pytest-xdist worker (three at most), each filling that
    worker's first batch, then the other tests, slow ones first.
    Ranks scattered over every worker cost CPU (409 s and 602 CPU-s with one lane of ranks against 425 s and 835
    CPU-s with --dist=worksteal: oversubscribed ranks cost 40% more CPU), and one lane holding every launching test
    grows to the whole suite's length while the other workers sit idle. Two lanes (the forkserver tests, the rest)
    still left one worker the critical path on the 2-core machine (2026-12-07: 431 s of tests on the forkserver
    worker, 269 s and 249 s on the others; a 441 s suite whose last 170 s ran the cores at 75%). So three lanes:
      POOL    the tests whose white-boxes go through tests/whitebox_pool.py, which shares verdicts only within its
              process (292 s that day);
      COLD    torchrun, the MCP worker, the fault tests, which mostly wait on cold process starts and deadlines,
              and the in-process tool runs whose torchrun `_ranks_forked_unless_torchrun` swaps for a forkserver of
              that worker's own (268 s);
      FORKED  the other forkserver launches (compiled ranks, memory and checkpoint runs: 138 s), whose worker then
              takes most of the rest.
    With two workers FORKED joins COLD. xdist's load scheduler (pytest-xdist 3.8, LoadScheduling) hands worker k
    the k-th batch of len(items) // workers // 4 consecutive tests and the rest one by one to whichever worker
    runs short, so each lane is padded with quick tests to one batch. (--dist=loadgroup would say this by marks,
    but pytest 9 ignores the node id it rewrites.) Without xdist, or when a lane outgrows a batch, the order is
    still launching tests first, which only changes how they spread."""
    ranks = [it for it in items if it.get_closest_marker("multirank")]
    rest = sorted((it for it in items if not it.get_closest_marker("multirank")),
                  key=lambda it: not it.get_closest_marker("slow"))  # stable: slow first
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # set in each xdist worker, which collects
    kinds = [[it for it in ranks if lane_of.get(id(it), POOL) == k] for k in (POOL, COLD, FORKED)]
    lanes = kinds if workers >= 3 else [kinds[POOL], kinds[COLD] + kinds[FORKED]]
    batch = max(2, len(items) // workers // 4) if workers >= 2 else 0
    if batch < max(map(len, lanes)):
        return ranks + rest
    quick = [it for it in rest if not it.get_closest_marker("slow")]  # the pads come from its end
    need = [batch - len(lane) for lane in lanes]
    if len(quick) < sum(need):
        return ranks + rest
    out: list[pytest.Item] = []
    end = len(quick)
    for lane, n in zip(lanes, need):
        out += [*lane, *quick[end - n:end]]
        end -= n
    padded = {id(it) for it in quick[end:]}
    return [*out, *(it for it in rest if id(it) not in padded)]


class UnmarkedLaunch(RuntimeError):
    """A test the collection hook did not mark `multirank` launched ranks in this process."""


@pytest.fixture(autouse=True)
def _launches_only_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    if request.node.get_closest_marker("multirank"):
        yield
        return
    import curry_train.train.launch as launch

    refused: list[str] = []

    def refuse(*_a: Any, **_k: Any) -> None:
        refused.append(request.node.nodeid)
        raise UnmarkedLaunch(f"{request.node.nodeid} launches ranks but is not marked multirank: the collection hook "
                             "(tests/conftest.py, LAUNCHERS) cannot see this launch, so mark the test by hand")

    async def refuse_async(*_a: Any, **_k: Any) -> None:
        refuse()

    # Only the real launchers are guarded: a stand-in a wider-scoped fixture put there (the fuzz tests' fake
    # worker) launches nothing and stays.
    for name in ("launch_forkserver", "start_torchrun"):
        if getattr(getattr(launch, name), "__module__", "") == launch.__name__:
            monkeypatch.setattr(launch, name, refuse)
    app = sys.modules.get("curry_train_mcp.app")  # the MCP server's long tools start a worker, which starts torchrun
    if app is not None and getattr(app.run_worker, "__module__", "") == "curry_train_mcp.jobs":
        monkeypatch.setattr(app, "run_worker", refuse_async)
    yield
    if refused:  # also when the tool under test caught the refusal and answered with an error
        pytest.fail(f"{refused[0]} launches ranks but is not marked multirank (tests/conftest.py, LAUNCHERS): "
                    "mark it by hand", pytrace=False)


_HARNESS = {getattr(f, "__wrapped__", f) for f in (_launches_only_when_marked, _ranks_forked_unless_torchrun)}
