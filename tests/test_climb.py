"""The main job: `curry-train climb` walks the ladder until the budget fits, one white-boxed primitive per rung.

The loop is tested with bench / white-box replaced by the estimator (no launch); a short real climb checks that
each rung resumes the previous rung's checkpoint (the loss curve continues the single-device run); the last test
is the README's command for real (torchrun, the advisor, the estimator, the white-box), marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from curry_train.cli import climb as climb_mod
from curry_train.cli.climb import climb, format_table
from curry_train.config import load_config
from curry_train.estimator import estimate_memory
from curry_train.measure import bench as bench_mod
from curry_train.measure import service
from curry_train.measure.bench import BenchResult, EstimateSide, MemoryBreakdown
from curry_train.measure.preflight import cpu_rank_cap
from curry_train.model.gpt import build_model
from curry_train.store.configs import history

REAL_BENCH = bench_mod.bench


@pytest.fixture
def fake_runs(monkeypatch):
    """bench = the estimator's total (+1%); whitebox passes unless a layout is listed in `broken`."""
    calls: dict[str, list] = {"bench": [], "whitebox": [], "recommend": [], "resume": [], "wb_resume": []}
    broken: list[dict] = []

    def fake_bench(name, steps=5, warmup=1, overrides=None, *, root=None, timeout=0, cancel=None, progress=None,
                   resume=None, save_checkpoint=False, micro_batches=None):
        assert micro_batches == "all"  # the rungs are one training run: every rung benches the whole step
        cfg, _ = service.resolve(name, overrides, root)
        calls["resume"].append(resume)
        start = int(resume.rsplit("-", 1)[1]) if resume else 0
        ck = (Path(root) / "runs" / f"bench-{len(calls['bench']) + 1}" / "checkpoints"
              / f"step-{start + warmup + steps:06d}")
        if save_checkpoint:
            ck.mkdir(parents=True)  # an empty stand-in: the climb only passes it on, and deletes it when done
        ck = str(ck)
        est = estimate_memory(cfg).memory
        peak = int(est.total * 1.01)
        calls["bench"].append(cfg.parallel.model_dump())
        budget = int(cfg.hardware.gpu_memory_gib * 2**30)
        return BenchResult(
            run_id=f"bench-{len(calls['bench'])}", config_name=name, world_size=cfg.world_size, device="cpu",
            parallel=cfg.parallel.model_dump(), steps=steps, warmup=warmup, step_time_s=0.01, tokens_per_s=1.0,
            peak_memory_bytes=peak, memory_breakdown=MemoryBreakdown(peak=peak), memory_budget_bytes=budget,
            losses=[5.0] * (warmup + steps), loss_finite=True, oom=peak > budget,
            estimate=EstimateSide(**{k: getattr(est, k) for k in ("params", "grads", "optimizer", "activations",
                                                                 "other", "total")}), wall_s=0.1,
            start_step=start, resumed_from=resume, checkpoint=ck if save_checkpoint else None)

    def fake_whitebox(name, overrides=None, *, steps=None, root=None, timeout=0, cancel=None, inject=None,
                      resume_checkpoint=None):
        assert steps is None  # the default horizon per rung: two updates at least (validation/horizon.py)
        cfg, _ = service.resolve(name, overrides, root)
        calls["whitebox"].append(cfg.parallel.model_dump())
        calls["wb_resume"].append(resume_checkpoint)
        return SimpleNamespace(passed=cfg.parallel.model_dump() not in broken, run_id=f"wb-{len(calls['whitebox'])}")

    monkeypatch.setattr("curry_train.measure.bench.bench", fake_bench)
    monkeypatch.setattr(service, "whitebox", fake_whitebox)
    return SimpleNamespace(calls=calls, broken=broken)


def _advisor(monkeypatch, steps: list[tuple[str, dict]]):
    seq = iter(steps)

    def rec(name, root, measured_peak_bytes):
        primitive, patch = next(seq, ("none", {}))
        return SimpleNamespace(primitive=primitive, config_patch=patch, reason=f"because {primitive}")

    monkeypatch.setattr(climb_mod, "_recommend", rec)


LADDER = [("recompute", {"parallel.recompute": "full"}), ("zero3", {"parallel.dp": 2, "parallel.zero": 3}),
          ("zero3", {"parallel.dp": 4})]


def test_climbs_one_white_boxed_primitive_per_rung_until_the_budget_fits(project, fake_runs, monkeypatch):
    _advisor(monkeypatch, LADDER)
    tiny = (project / "configs" / "tiny.yaml").read_bytes()
    budget = int(estimate_memory("tiny", {"parallel.dp": 4, "parallel.zero": 3, "parallel.recompute": "full"},
                                 root=project).memory.total * 1.02)
    r = climb("tiny", budget, root=project)
    assert [g.primitive for g in r.rungs] == ["baseline", "recompute", "zero3", "zero3"]
    assert r.fits and r.rungs[-1].fits and not any(g.fits for g in r.rungs[:-1])
    assert [g.parity for g in r.rungs] == ["ref", "passed", "passed", "passed"]
    assert r.final_parallel["dp"] == 4 and r.final_parallel["recompute"] == "full"
    assert all(g.predicted_bytes and g.measured_bytes for g in r.rungs)
    assert (project / "configs" / "tiny.yaml").read_bytes() == tiny  # the base is never rewritten
    assert len(history("tiny-climb", root=project)) == 3  # one saved version per applied primitive
    table = format_table(r)
    assert "predicted" in table and "measured" in table and "parity" in table and "FITS" in table
    assert len(fake_runs.calls["whitebox"]) == 3  # every rung after the baseline
    # one training run: each rung resumes the checkpoint the rung before saved, at its step
    assert fake_runs.calls["resume"] == [None] + [g.checkpoint for g in r.rungs[:-1]]
    assert [g.start_step for g in r.rungs] == [0, 4, 8, 12] and r.rungs[0].resumed_from is None
    assert all(g.resumed_from == p.checkpoint for p, g in zip(r.rungs, r.rungs[1:]))
    assert "4-7" in table and "12-15" in table
    # parity covers the run: each resumed rung is white-boxed from the checkpoint it resumed (validation/resume.py)
    assert fake_runs.calls["wb_resume"] == [g.resumed_from for g in r.rungs[1:]] and all(fake_runs.calls["wb_resume"])
    assert [g.parity_from for g in r.rungs[1:]] == [g.resumed_from for g in r.rungs[1:]]
    # disk: each rung's checkpoint is deleted once the next rung has resumed it and saved its own
    assert [g.checkpoint_deleted for g in r.rungs] == [True, True, True, False]
    assert [Path(g.checkpoint).exists() for g in r.rungs] == [False, False, False, True]


def test_keep_checkpoints_keeps_every_rungs_checkpoint(project, fake_runs, monkeypatch):
    _advisor(monkeypatch, LADDER[:1])
    r = climb("tiny", 1000, root=project, max_rungs=1, keep_checkpoints=True)
    assert len(r.rungs) == 2 and not any(g.checkpoint_deleted for g in r.rungs)
    assert all(Path(g.checkpoint).exists() for g in r.rungs)


def test_a_lost_checkpoint_stops_the_climb_with_a_clear_error(project, fake_runs, monkeypatch):
    import shutil

    from curry_train.config import ConfigError

    fake = bench_mod.bench  # the fixture's: its checkpoints are empty folders

    def bench(*a, resume=None, **k):  # rung 0 fake, its checkpoint then lost; rung 1 the real bench, which checks it
        if resume:
            return REAL_BENCH(*a, resume=resume, **k)
        r = fake(*a, resume=resume, **k)
        shutil.rmtree(r.checkpoint)
        return r

    monkeypatch.setattr(bench_mod, "bench", bench)
    _advisor(monkeypatch, LADDER)
    with pytest.raises(ConfigError, match="rung 1 cannot resume from the checkpoint rung 0 saved") as e:
        climb("tiny", 1000, root=project)
    assert "does not exist" in str(e.value) and "never" in str(e.value)
    assert len(fake_runs.calls["bench"]) == 1 and not list((project / "runs").glob("*/spec.json"))


@pytest.mark.multirank
def test_each_rung_resumes_the_previous_rungs_checkpoint_for_real(project, monkeypatch):
    """The real bench, checkpoint and white-box of every rung, their ranks forked (tests/forkrun.py): what is
    tested is the ranks' resume across layouts; the CLI's own resume through torchrun is test_checkpoint.py's."""
    import torch
    from curry_train.train.loop import setup, train_step

    _advisor(monkeypatch, [("zero3", {"parallel.dp": 2, "parallel.zero": 3})])
    r = climb("tiny", 1000, root=project, steps=2, max_rungs=1)  # over budget: baseline + one rung, then stop
    base, z3 = r.rungs
    assert base.checkpoint and base.checkpoint.endswith("step-000003") and base.start_step == 0
    assert str(project / "runs" / base.bench_run) in base.checkpoint  # under the rung's own run folder
    assert z3.resumed_from == base.checkpoint and z3.start_step == 3 and z3.checkpoint.endswith("step-000006")
    assert z3.parity == "passed"
    assert base.checkpoint_deleted and not Path(base.checkpoint).exists() and Path(z3.checkpoint).is_dir()
    # the 12 B/param the README and climb.py quote: fp32 weights + AdamW's two moments, plus DCP's framing
    # (~2 KB per saved tensor piece: 3 per parameter per rank here) and its .metadata
    params = list(build_model(load_config(project / "configs" / "tiny.yaml")).parameters())
    n = sum(p.numel() for p in params)
    size = sum(f.stat().st_size for f in Path(z3.checkpoint).rglob("*") if f.is_file())
    assert 12 * n <= size <= 12 * n + 2500 * 3 * len(params) * 2 + 100_000, (size, 12 * n)
    torch.set_num_threads(1)
    cfg = load_config(project / "configs" / "local" / "tiny-climb.yaml", {"parallel.dp": 1, "parallel.zero": 0})
    par = setup(cfg)
    ref = [train_step(par, s, read=True).loss for s in range(6)]  # the same 6 steps, uninterrupted, on one device
    print(json.dumps({"reference": ref, "climb": base.losses + z3.losses}))
    assert base.losses + z3.losses == pytest.approx(ref, rel=1e-5)



def test_the_climb_config_is_fitted_to_this_machine(project, fake_runs, monkeypatch):
    _advisor(monkeypatch, [])
    r = climb("tiny", 10**9, root=project)
    assert r.fits and len(r.rungs) == 1
    cfg = load_config(project / "configs" / "local" / "tiny-climb.yaml")
    cap = cpu_rank_cap(os.cpu_count() or 1)  # the preflight's cap, the same for the climb and every launch
    assert cfg.hardware.device == "cpu" and cfg.hardware.gpus_per_node <= cap
    assert cfg.hardware.gpu_memory_gib == pytest.approx(10**9 / 2**30)


def test_a_failed_parity_check_stops_the_climb(project, fake_runs, monkeypatch):
    _advisor(monkeypatch, LADDER)
    base = load_config(project / "configs/tiny.yaml").parallel.model_dump()
    fake_runs.broken.append({**base, "recompute": "full"})
    r = climb("tiny", 1000, root=project)
    assert [g.parity for g in r.rungs] == ["ref", "FAILED"] and not r.fits and "parity FAILED" in r.stopped


def test_the_climb_stops_when_the_advisor_has_no_rung_left_or_repeats_itself(project, fake_runs, monkeypatch):
    _advisor(monkeypatch, [("recompute", {"parallel.recompute": "full"})])
    r = climb("tiny", 1000, root=project)
    assert len(r.rungs) == 2 and not r.fits and "no further rung" in r.stopped
    _advisor(monkeypatch, [("recompute", {"parallel.recompute": "full"})] * 2)
    r = climb("tiny", 1000, root=project, name="again")
    assert len(r.rungs) == 2 and "repeated" in r.stopped


def test_bad_arguments_are_refused_before_anything_runs(project, fake_runs, tmp_path):
    (tmp_path / "elsewhere.yaml").write_text((project / "configs" / "tiny.yaml").read_text())
    with pytest.raises(ValueError, match="must be in"):
        climb(str(tmp_path / "elsewhere.yaml"), 10**6, root=project)
    with pytest.raises(ValueError, match="never rewrites"):
        climb("tiny", 10**6, root=project, name="tiny")
    with pytest.raises(ValueError, match="positive"):
        climb("tiny", 0, root=project)
    with pytest.raises(FileNotFoundError, match="tiny-moe"):
        climb("nope", 10**6, root=project)
    assert fake_runs.calls["bench"] == []


def _readme_climb(project: Path) -> dict:
    """The README's command 1 as JSON. CI has run it already (.ci/run, command 1 with --json into the file named by
    CURRY_README_CLIMB_JSON), so the suite checks that run instead of climbing a second time; elsewhere the climb
    runs here when CURRY_TEST_FULL=1 (the nightly tier), and the test skips otherwise."""
    done = os.environ.get("CURRY_README_CLIMB_JSON")
    if done:
        return json.loads(Path(done).read_text(encoding="utf-8"))
    if os.environ.get("CURRY_TEST_FULL") != "1":
        pytest.skip("the README climb runs as CI's command 1 (CURRY_README_CLIMB_JSON); CURRY_TEST_FULL=1 runs it here")
    r = subprocess.run([sys.executable, "-m", "curry_train.cli", "climb", "--config", "configs/tiny.yaml",
                        "--memory-budget", str(climb_mod.README_BUDGET), "--root", str(project), "--json"],
                       capture_output=True, text=True, timeout=900, cwd=project, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.slow
@pytest.mark.multirank
def test_the_readme_climb_runs_for_real_and_fits_in_at_least_three_rungs(project):
    out = _readme_climb(project)
    assert out["fits"] and len(out["rungs"]) >= 4  # baseline + at least three primitives
    assert out["memory_budget_bytes"] == climb_mod.README_BUDGET  # the README's command, not another climb
    assert all(g["parity"] in ("ref", "passed") for g in out["rungs"])
    rungs = out["rungs"]  # one training run: rung k resumed rung k-1's checkpoint, at the step it reached
    assert all(g["resumed_from"] == p["checkpoint"] and g["start_step"] == p["start_step"] + len(p["losses"])
               for p, g in zip(rungs, rungs[1:]))
    assert [g["checkpoint_deleted"] for g in rungs] == [True] * (len(rungs) - 1) + [False]


def test_a_climb_leaves_a_git_checkout_clean(tmp_path, fake_runs, monkeypatch):
    """README command 1 then command 2 leave `git status --porcelain` empty: the climb's configs and their history
    go to configs/local/, which the repository's .gitignore names, and its runs to the ignored runs/. A checkout
    copy (this .gitignore + the shipped presets) committed in a fresh repository, climbed with the real writers."""
    from tests.conftest import REPO, shipped_configs

    checkout = tmp_path / "checkout"
    shipped_configs(checkout / "configs")
    (checkout / ".gitignore").write_text((REPO / ".gitignore").read_text(encoding="utf-8"), encoding="utf-8")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "shipped"]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    _advisor(monkeypatch, LADDER)
    budget = int(estimate_memory("tiny", {"parallel.dp": 4, "parallel.zero": 3, "parallel.recompute": "full"},
                                 root=checkout).memory.total * 1.02)
    r = climb("tiny", budget, root=checkout)
    assert r.fits and len(history("tiny-climb", root=checkout)) == 3  # it wrote, and versioned, the rung config
    status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=all"], check=True,
                            capture_output=True, text=True).stdout
    assert status == "", status


def test_a_cancelled_climb_passes_the_cancel_to_every_launch_and_starts_no_further_rung(project, fake_runs,
                                                                                        monkeypatch):
    """What the MCP tool's worker relies on: SIGTERM sets `cancel`; the launch in flight gets it (its launcher kills
    the ranks' process group, curry_train/train/launch.py) and no rung starts after it."""
    import threading

    from curry_train.train.launch import LaunchError

    cancel, seen = threading.Event(), []
    fake = bench_mod.bench

    def bench(*a, cancel=None, **k):
        seen.append(cancel)
        r = fake(*a, cancel=cancel, **k)
        cancel.set()  # the client cancels while rung 0 runs
        return r

    monkeypatch.setattr(bench_mod, "bench", bench)
    _advisor(monkeypatch, LADDER)
    with pytest.raises(LaunchError, match="cancelled"):
        climb("tiny", 1000, root=project, cancel=cancel)
    assert seen == [cancel] and len(fake_runs.calls["whitebox"]) == 0


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.anyio
async def test_climb_over_mcp_is_the_cli_climb(project, monkeypatch):
    """The `climb` tool runs the CLI's climb in a worker: the same rung the CLI's advisor picks for the measured
    peak, one training run across the rungs (the losses of 3 + 3 steps are the uninterrupted single-device run's,
    as test_each_rung_resumes_the_previous_rungs_checkpoint_for_real checks for the CLI), the same configs and
    ledger, and a progress notification for every rung. The worker forks its ranks (tests/forkworker.py): what
    is tested is the tool and the climb, and torchrun is tests/test_cli.py's."""
    import torch
    from curry_train.store.runs import Ledger
    from curry_train.train.loop import setup, train_step
    from curry_train_mcp.server import mcp
    from mcp import Client

    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))
    progress: list[str] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async with Client(mcp) as c:
        r = await c.call_tool("climb", {"config": "TINY".lower(), "memory_budget": 1000, "max_rungs": 1,
                                        "steps": 2}, progress_callback=on_progress)
    assert not r.is_error, r.content[0].text[-3000:]
    out = r.structured_content
    base, rung = out["rungs"]
    before = history("tiny-climb", root=project)  # the rung-0 config, as the CLI climb saw it before rung 1
    assert len(before) == 1  # one saved version per applied primitive, as the CLI
    cli_next = climb_mod._recommend(str(before[0]), project, base["measured_bytes"])  # what the CLI climb applies
    assert rung["primitive"] == cli_next.primitive and rung["patch"] == cli_next.config_patch
    assert out["final_parallel"] == rung["parallel"] and rung["parity"] == "passed"
    assert rung["resumed_from"] == base["checkpoint"] and rung["start_step"] == 3 and base["checkpoint_deleted"]
    assert [f"rung {i}:" in " ".join(progress) for i in (0, 1)] == [True, True]
    kinds = sorted(rec.kind for rec in Ledger(project).list(20))
    assert kinds == ["bench", "bench", "whitebox"], kinds
    torch.set_num_threads(1)
    cfg = load_config(project / "configs" / "local" / "tiny-climb.yaml", {"parallel.recompute": "none"})
    par = setup(cfg)
    ref = [train_step(par, s, read=True).loss for s in range(6)]  # the same 6 steps, uninterrupted, on one device
    assert base["losses"] + rung["losses"] == pytest.approx(ref, rel=1e-5)
