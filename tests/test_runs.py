"""The run ledger and the path rules: safe names only, atomic writes, diffs of two runs."""

from __future__ import annotations

import pytest
from curry_train.config import load_config
from curry_train.paths import UnsafeName, atomic_write_text, check_name, config_path, run_dir
from curry_train.store.runs import Ledger, diff_runs


@pytest.mark.parametrize("bad", ["../etc", "/abs", "a/b", "..", "", "x" * 65, "con", "a\x00b", "-x", ".hidden", 3])
def test_unsafe_names_are_refused(bad):
    with pytest.raises(UnsafeName):
        check_name(bad)


def test_config_paths_stay_inside_configs(project):
    assert config_path("tiny", project) == project / "configs" / "tiny.yaml"
    (project / "configs" / "evil.yaml").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeName):
        config_path("evil", project)
    assert run_dir("train-1", project).parent == project / "runs"


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "a.yaml"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two" and [f.name for f in tmp_path.iterdir()] == ["a.yaml"]


def test_ledger_records_runs_and_diffs_them(project):
    ledger = Ledger(project)
    a = ledger.start("train", load_config(project / "configs/tiny.yaml"), "tiny")
    b = ledger.start("train", load_config(project / "configs/tiny.yaml", {"parallel.dp": 2}), "tiny")
    assert ledger.get(a.run_id).status == "running"
    ledger.finish(a.run_id, status="ok", metrics={"step_time_s": 0.2, "losses": [5.0, 4.0]})
    ledger.finish(b.run_id, status="ok", metrics={"step_time_s": 0.1, "losses": [5.0, 4.0]})
    assert (project / "runs" / a.run_id / "config.yaml").is_file()
    assert (project / "runs" / a.run_id / "metrics.json").is_file()
    d = diff_runs(ledger.get(a.run_id), ledger.get(b.run_id))
    assert [(c.key, c.a, c.b) for c in d.config_changes] == [("parallel.dp", 1, 2)]
    step = next(m for m in d.metric_changes if m.metric == "step_time_s")
    assert step.ratio == pytest.approx(0.5)
    assert "step time x0.50" in d.verdict
    assert {r.run_id for r in ledger.list()} == {a.run_id, b.run_id}
    with pytest.raises(KeyError):
        ledger.get("nope")
