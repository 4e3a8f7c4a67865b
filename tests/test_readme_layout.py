"""The README's layout table matches the tree: every module of the template and of the server is named in the row of
its folder, and every preset in configs/ is named in the configs row.

    .venv/bin/pytest tests/test_readme_layout.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _rows() -> dict[str, str]:
    section = README[README.index("## Layout"):]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", section, re.M)}


ROWS = _rows()
FOLDERS = ["template/curry_train/", *(f"template/curry_train/{d.name}/" for d in
                                      sorted((REPO / "template" / "curry_train").iterdir())
                                      if d.is_dir() and (d / "__init__.py").exists()), "mcp_server/"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_module_is_named_in_its_folders_row(folder):
    assert folder in ROWS, f"README layout table has no row for {folder}"
    row = ROWS[folder]
    skip = {"__init__", "__main__"}
    missing = [f.name for f in sorted((REPO / folder).glob("*.py")) if f.stem not in skip
               and f.name not in row and f"`{f.stem}`" not in row and f"{f.stem}," not in row]
    assert missing == [], f"{folder}: not in the README's layout table: {missing}"


def test_every_shipped_config_is_named_in_the_configs_row():
    from tests.conftest import PRESETS  # the shipped presets, never what a climb wrote into the checkout

    row = ROWS["configs/"]
    names = [p.stem for p in sorted(PRESETS.glob("*.yaml"))]
    assert names, "no configs found"
    # the row groups a family as `llama3-8b/70b/405b`: expand each backticked entry into full names
    listed = set()
    for entry in re.findall(r"`([^`]+)`", row):
        first, *rest = entry.split("/")
        listed |= {first} | {f"{first.rsplit('-', 1)[0]}-{size}" for size in rest}
    assert sorted(set(names) - listed) == [], "shipped configs missing from the README's configs row"
    assert sorted(listed - set(names)) == [], "the README's configs row names configs that are not shipped"


def test_the_table_names_no_module_that_does_not_exist():
    for folder, row in ROWS.items():
        if not folder.startswith("template/"):
            continue
        for name in re.findall(r"`([a-z_]+\.py)`", row):
            assert (REPO / folder / name).exists(), f"README names {folder}{name}, which does not exist"
