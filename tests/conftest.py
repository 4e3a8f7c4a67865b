"""Shared fixtures. Multi-rank tests go through curry_train.train.launch.launch_forkserver (torch preloaded, ~0.3 s a
launch) and batch many checks per launch; the torchrun path is exercised by the CLI tests."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WRITTEN = "# written by update_config"  # the header update_config puts on every file it writes


def shipped_configs(dest: Path, src: Path = REPO / "configs") -> Path:
    """The presets as shipped, copied to dest/: never what a user (or README command 1's climb) wrote since.

    A file update_config created is skipped (its first version carries WRITTEN); a preset it changed is taken from
    its first saved version in .history/, which is the shipped one. So the tests see the same presets on a fresh
    clone and after `curry-train climb` has written configs/tiny-climb.yaml and configs/.history/.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*.yaml")):
        history = src / ".history" / p.stem
        first = min(history.glob("*.yaml"), default=p) if history.is_dir() else p
        text = first.read_text(encoding="utf-8")
        if not text.startswith(WRITTEN):
            (dest / p.name).write_text(text, encoding="utf-8")
    return dest


# A CURRY_TRAIN_ROOT from the shell would point every tool at a real project: tests set their own (or none).
os.environ.pop("CURRY_TRAIN_ROOT", None)

# The shipped presets for tests that only read one (TINY = PRESETS / "tiny.yaml"); never the checkout's configs/.
PRESETS = shipped_configs(Path(tempfile.mkdtemp(prefix="curry-presets-")) / "configs")
atexit.register(shutil.rmtree, PRESETS.parent, True)


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


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
