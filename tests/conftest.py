"""Shared fixtures. Multi-rank tests go through curry_train.train.launch.launch_forkserver (torch preloaded, ~0.3 s a
launch) and batch many checks per launch; the torchrun path is exercised by the CLI tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A throwaway project root: a copy of configs/ and an empty runs/ (tools write only there)."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "runs").mkdir()
    return tmp_path


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
