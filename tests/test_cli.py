"""The CLI end to end through torchrun: exit codes 0 / 1 / 2, one JSON object on stdout, nothing launched on bad
input."""

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


def test_train_runs_two_ranks_and_loss_falls(project):
    r = _cli("train", "--config", "tiny", "--set", "parallel.dp=2", "--set", "train.steps=20", "--json", root=project)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout)["metrics"]
    assert m["world_size"] == 2 and m["last_loss"] < m["first_loss"]


def test_unknown_config_name_lists_the_available_ones(project):
    r = _cli("train", "--config", "nope", root=project)
    assert r.returncode == 2 and "tiny" in r.stderr
    r = _cli("train", "--config", "../etc/passwd", root=project)
    assert r.returncode == 2 and "not allowed" in r.stderr
