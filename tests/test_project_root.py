"""Tests never read or write the checkout's configs/ or runs/: each test has a project root of
its own holding only the shipped presets, so the README's command 1 (a climb that writes configs/local/tiny-climb.yaml
and configs/local/.history/) followed by command 2 (the tests) passes.

    .venv/bin/pytest tests/test_project_root.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

from curry_train.paths import configs_dir, project_root
from curry_train.store.configs import update_config

from tests.conftest import PRESETS, REPO, WRITTEN, shipped_configs

SHIPPED = {p.stem for p in PRESETS.glob("*.yaml")}


def test_each_test_runs_in_its_own_project_root_with_only_the_shipped_presets():
    root = project_root()
    assert root != REPO.resolve() and REPO.resolve() not in root.parents
    assert {p.stem for p in configs_dir().glob("*.yaml")} == SHIPPED
    assert {"tiny", "tiny-moe", "llama3-8b"} <= SHIPPED and not [n for n in SHIPPED if n.endswith("-climb")]
    assert not [p for p in PRESETS.glob("*.yaml") if p.read_text(encoding="utf-8").startswith(WRITTEN)]


def test_the_copy_skips_what_a_climb_wrote_and_restores_a_changed_preset(tmp_path: Path):
    """What command 1 leaves in a checkout, reproduced with the real writer (update_config)."""
    checkout = tmp_path / "checkout"
    shipped_configs(checkout / "configs")
    shipped = (checkout / "configs" / "tiny.yaml").read_text(encoding="utf-8")
    update_config("tiny-climb", {"parallel.dp": 2}, "tiny", root=checkout)  # the climb's rung config
    update_config("tiny-climb", {"parallel.zero": 3}, root=checkout)  # its next rung: a .history/ entry
    update_config("tiny", {"train.seed": 7}, root=checkout)  # someone edits a preset in place
    assert (checkout / "configs" / "local" / ".history").is_dir()
    assert (checkout / "configs" / "tiny.yaml").read_text(encoding="utf-8") == shipped  # presets are never written
    copy = shipped_configs(tmp_path / "copy" / "configs", src=checkout / "configs")
    assert {p.name for p in copy.iterdir()} == {f"{n}.yaml" for n in SHIPPED}  # no tiny-climb, no .history
    assert (copy / "tiny.yaml").read_text(encoding="utf-8") == shipped  # the shipped version, not the edit


def test_no_test_reads_the_checkouts_configs_or_runs():
    """Tests take presets from PRESETS / the `project` fixture; a direct path into the checkout is a bug."""
    pattern = re.compile(r"""(REPO|parents\[\d\])\s*/\s*["'](configs|runs)["']""")
    offenders = [f"{f.relative_to(REPO)}:{i}" for f in (REPO / "tests").rglob("*.py") if f.name != "conftest.py"
                 for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert offenders == []
