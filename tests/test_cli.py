"""The CLI end to end through real torchrun, once per contract: exit 0 (a passing white-box, recorded), exit 1 (a
failed parity check naming the parameter), exit 3 (a run that cannot finish), a two-rank train with progress and a
checkpoint saved under torchrun's environment; exit 2 on bad input with nothing launched. Every other test of what
the ranks compute forks them from the forkserver (tests/conftest.py `_ranks_forked_unless_torchrun`, whitebox_pool);
the other torchrun contracts are the two-agent multi-node run (tests/test_multinode.py) and, marked `torchrun`, the
MCP worker's rank faults: a hang killed at its deadline with its tree, a SIGTERM-ignoring rank, the OOM marker
(tests/reliability/test_faults.py), and a cancelled bench (tests/test_mcp_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multirank


def _cli(*args, root):
    return subprocess.run([sys.executable, "-m", "curry_train.cli", *args, "--root", str(root)],
                          capture_output=True, text=True, timeout=300)


def test_whitebox_dp2_through_torchrun_passes_and_is_recorded(project):
    r = _cli("whitebox", "--config", "tiny", "--set", "parallel.dp=2", "--json", root=project)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["passed"] and out["world_size"] == 2 and out["run_id"].startswith("whitebox-")
    assert (project / "runs" / out["run_id"] / "metrics.json").is_file()


def test_invalid_config_exits_2_naming_fields_before_any_process_starts(project):
    r = _cli("whitebox", "--config", "tiny", "--set", "parallel.tp=3", "--json", root=project)
    assert r.returncode == 2 and r.stdout == ""
    assert "model.n_heads" in r.stderr and "parallel.tp" in r.stderr
    assert not (project / "runs" / "ledger.sqlite3").exists()  # nothing recorded, nothing launched


def test_broken_variant_exits_1_and_names_the_parameter(project):
    r = _cli("whitebox", "--config", "tiny", "--set", "parallel.dp=2", "--json",
             "--break-grad-sync", "layers.0.attention.wv.weight", root=project)
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert not out["passed"] and out["worst_parameter"]["name"].endswith("layers.0.attention.wv.weight")


def test_a_run_that_cannot_finish_exits_3_not_1(project):
    r = _cli("whitebox", "--config", "tiny", "--set", "parallel.dp=2", "--timeout", "0.5", "--json", root=project)
    assert r.returncode == 3 and r.stdout == "", (r.returncode, r.stderr[-2000:])
    assert "could not finish" in r.stderr


def test_train_through_torchrun_reports_progress_saves_and_resumes_in_another_layout(project, tmp_path, capsys):
    """Two ranks (ZeRO-3) through torchrun: progress on stderr, the single-device run's losses, a checkpoint saved
    by DCP under torchrun's environment; it resumes at TP 2 x ZeRO-2 on four ranks (forked: the resume's rank code
    is the same under either launcher) and the run continues as if never interrupted."""
    import torch
    from curry_train.cli import main
    from curry_train.config import load_config
    from curry_train.train.loop import run_training

    ck = tmp_path / "ck"
    r = _cli("train", "--config", "tiny", "--set", "parallel.dp=2", "--set", "parallel.zero=3", "--set",
             "train.steps=4", "--checkpoint-dir", str(ck), "--save-every", "2", "--json", root=project)
    assert r.returncode == 0, r.stderr[-2000:]
    first = json.loads(r.stdout)["metrics"]
    assert first["world_size"] == 2 and first["last_loss"] < first["first_loss"]
    err = r.stderr
    assert "launching 2 rank(s)" in err and "step 1/4: loss" in err and "step 4/4: loss" in err
    assert err.index("launching") < err.index("step 1/4")
    assert (ck / "step-000002" / "curry_meta.json").is_file()
    torch.set_num_threads(1)
    ref = run_training(load_config(project / "configs" / "tiny.yaml", {"train.steps": 4}))["losses"]
    assert first["losses"] == pytest.approx(ref, rel=1e-5)
    assert main(["train", "--config", "tiny", "--root", str(project), "--json", "--set", "train.steps=4",
                 "--set", "parallel.dp=2", "--set", "parallel.tp=2", "--set", "parallel.zero=2",
                 "--resume", str(ck / "step-000002")]) == 0
    resumed = json.loads(capsys.readouterr().out)["metrics"]
    assert resumed["start_step"] == 2 and resumed["world_size"] == 4
    assert first["losses"][:2] + resumed["losses"] == pytest.approx(ref, rel=1e-5)


def test_unknown_config_name_lists_the_available_ones(project):
    r = _cli("train", "--config", "nope", root=project)
    assert r.returncode == 2 and "tiny" in r.stderr
    r = _cli("train", "--config", "../etc/passwd", root=project)
    assert r.returncode == 2 and "not allowed" in r.stderr
