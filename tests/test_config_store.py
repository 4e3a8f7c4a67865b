"""update_config: validate first, write atomically, keep every replaced version, never lose a concurrent update."""

from __future__ import annotations

import stat
import threading

import pytest
from curry_train.config import ConfigError, load_config
from curry_train.paths import UnsafeName
from curry_train.store.configs import history, update_config


def test_creating_from_a_base_writes_the_resolved_config_and_diffs_against_the_base(project):
    r = update_config("tiny-dp2", {"parallel.dp": 2}, base="tiny", root=project)
    assert r.created and r.written and r.base == "tiny" and r.previous_version is None
    assert [(c.key, c.old, c.new) for c in r.diff] == [("parallel.dp", 1, 2)]
    path = project / "configs" / "local" / "tiny-dp2.yaml"
    assert r.path == str(path) and load_config(path).parallel.dp == 2 and r.config["parallel"]["dp"] == 2
    assert stat.S_IMODE(path.stat().st_mode) & 0o044, "readable like any file the user writes (not mkstemp's 0600)"


def test_updating_keeps_the_replaced_version_in_history(project):
    update_config("mine", {"parallel.dp": 2}, base="tiny", root=project)
    first = (project / "configs" / "local" / "mine.yaml").read_text()
    r = update_config("mine", {"parallel": {"zero": 1}}, root=project)  # nested sections work too
    assert [(c.key, c.old, c.new) for c in r.diff] == [("parallel.zero", 0, 1)]
    assert [str(p) for p in history("mine", root=project)] == [r.previous_version]
    assert r.previous_version.startswith(str(project / "configs" / "local" / ".history" / "mine"))
    assert history("mine", root=project)[0].read_text() == first


def test_a_change_that_changes_nothing_writes_nothing(project):
    update_config("same", {"parallel.dp": 2}, base="tiny", root=project)
    r = update_config("same", {"parallel.dp": 2}, root=project)
    assert not r.written and r.diff == [] and history("same", root=project) == []


def test_an_invalid_config_writes_nothing_and_names_every_field(project):
    before = (project / "configs" / "tiny.yaml").read_bytes()
    with pytest.raises(ConfigError) as e:
        update_config("tiny", {"parallel.tp": 3, "parallel.sp": True}, root=project)
    text = str(e.value)
    assert "model.n_heads" in text and "parallel.tp" in text and "Fix" in text
    assert (project / "configs" / "tiny.yaml").read_bytes() == before
    assert history("tiny", root=project) == [] and not (project / "configs" / "local" / ".history").exists()
    with pytest.raises(ConfigError, match="unknown field"):
        update_config("new", {"parallel.tpp": 2}, base="tiny", root=project)
    assert not (project / "configs" / "local" / "new.yaml").exists()


def test_missing_configs_and_unsafe_names_are_refused_with_the_way_out(project):
    before = sorted(p.name for p in (project / "configs").glob("*.yaml"))
    with pytest.raises(FileNotFoundError, match="tiny"):
        update_config("new", {"parallel.dp": 2}, root=project)  # no base, no existing file
    with pytest.raises(FileNotFoundError, match="available: .*tiny, .*tiny-moe"):
        update_config("new", {}, base="nope", root=project)
    for bad in ("../x", "/etc/passwd", "a/b", "con", "x" * 80):
        with pytest.raises(UnsafeName):
            update_config(bad, {}, base="tiny", root=project)
    assert sorted(p.name for p in (project / "configs").glob("*.yaml")) == before


def test_concurrent_updates_of_one_config_are_serialised_and_none_is_lost(project):
    update_config("shared", {}, base="tiny", root=project)
    changes = [{"train.seed": 7}, {"train.lr": 0.01}, {"train.steps": 3}, {"train.weight_decay": 0.1},
               {"model.rope_theta": 500.0}, {"model.norm_eps": 1e-6}, {"train.global_batch": 16},
               {"parallel.recompute": "full"}]
    errors: list[BaseException] = []

    def worker(ch: dict) -> None:
        try:
            update_config("shared", ch, root=project)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(ch,)) for ch in changes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    final = load_config(project / "configs" / "local" / "shared.yaml")
    assert (final.train.seed, final.train.lr, final.train.steps, final.train.weight_decay, final.model.rope_theta,
            final.model.norm_eps, final.train.global_batch, final.parallel.recompute) == \
        (7, 0.01, 3, 0.1, 500.0, 1e-6, 16, "full")
    assert len(history("shared", root=project)) == len(changes)
    assert not list((project / "configs" / "local").glob(".*.tmp"))  # no half-written temp file left behind
