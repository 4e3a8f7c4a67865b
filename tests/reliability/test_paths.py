"""Names, not paths: config names and run ids resolve under configs/ and runs/, and nothing is written elsewhere.

    .venv/bin/pytest tests/reliability/test_paths.py -q

The attack battery goes through the MCP tools and resources (in-memory client) against a project that sits in a
folder with an `outside/` sibling; symlinks from configs/ and runs/ point there. The whole parent folder is
snapshotted before and after: the only paths allowed to change are the ledger files under runs/.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from curry_train.paths import RESERVED, UnsafeName, atomic_write_text, check_name, config_path, run_dir
from curry_train.store.configs import update_config
from curry_train_mcp.server import mcp
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client
from rel_support import text_of

from tests.conftest import PRESETS, shipped_configs

ATTACK_NAMES = ["../x", "../../outside/owned", "../outside/owned", "/tmp/owned", "a/b", "a\\b", "x\x00y", "\x00",
                "x" * 65, "x" * 10_000, "con", "CON", "con.yaml", "NUL", "aux.txt", "com1", "LPT9", "tiny\n", "\ntiny",
                ".", "..", "", "~", "~root", "tiny.", ".tiny", "-tiny", " tiny", "tiny ", "tiny\r", "ti ny",
                "\u202etiny", "\uff54iny", "t\u0131ny", "%2e%2e", "tiny/.", "./tiny", "tiny.yaml/..", "$HOME",
                "dir-out/owned", "link-out/../x"]


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (symlinks not followed): type, size, mtime, mode, link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st_ = p.lstat()
            out[str(p.relative_to(root))] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns,
                                             stat.S_IMODE(st_.st_mode),
                                             os.readlink(p) if p.is_symlink() else None)
    return out


@pytest.fixture
def walled(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """outer/project (configs + runs) and outer/outside, with symlinks from the project pointing outside."""
    outer = tmp_path / "outer"
    project, outside = outer / "project", outer / "outside"
    shipped_configs(project / "configs")
    (project / "runs").mkdir()
    outside.mkdir()
    (outside / "target.yaml").write_text((PRESETS / "tiny.yaml").read_text(encoding="utf-8"))
    (outside / "secret.txt").write_text("not for the model\n")
    (outside / "rundir").mkdir()
    (outside / "rundir" / "memory.png").write_bytes(b"\x89PNG\r\n\x1a\nsecret")
    (project / "configs" / "link-out.yaml").symlink_to(outside / "target.yaml")
    (project / "configs" / "dir-out").symlink_to(outside)
    (project / "runs" / "run-out").symlink_to(outside / "rundir")
    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))
    return outer, project


def _calls(config: str, run: str) -> list[tuple[str, dict]]:
    return [("update_config", {"name": config, "changes": {"parallel.dp": 2}, "base": "tiny"}),
            ("update_config", {"name": "fresh", "changes": {}, "base": config}),
            ("estimate_memory", {"config": config}), ("recommend_next", {"config": config}),
            ("bench", {"config": config, "steps": 1}), ("whitebox_compare", {"config": config}),
            ("capacity_sweep", {"config": config}), ("runs_diff", {"run_a": run, "run_b": run}),
            ("plan", {"model": config, "gpus_per_node": 8, "nodes": 1, "gpu_memory_gib": 80, "seq_len": 64,
                      "global_batch": 8})]


@pytest.mark.anyio
async def test_no_tool_or_resource_writes_or_reads_outside_the_project(walled):
    outer, _ = walled
    before = _snapshot(outer)
    refusals = 0
    async with Client(mcp, raise_exceptions=True) as c:
        # every name that is not a plain name, as a config and as a run id; then the symlinks out of the project:
        # configs/link-out.yaml -> outside/target.yaml, runs/run-out -> outside/rundir
        for config, run in [*[(bad, bad) for bad in ATTACK_NAMES], ("link-out", "run-out")]:
            for tool, args in _calls(config, run):
                r = await c.call_tool(tool, args)
                assert r.is_error, f"{tool} accepted {args}: {text_of(r)[:300]}"
                assert "Error executing tool " + tool != text_of(r).strip(), f"{tool} crashed on {args}"
                refusals += 1
            for uri in (f"config://{config}", f"run://{run}", f"run://{run}/memory.png"):
                with pytest.raises(Exception):  # noqa: B017 - not found / invalid URI, whichever the SDK raises
                    await c.read_resource(uri)
        names = {entry["name"] for entry in json.loads(
            (await c.read_resource("config://index")).contents[0].text)}
        assert "link-out" not in names and "tiny" in names
    assert refusals == (len(ATTACK_NAMES) + 1) * 9
    after = _snapshot(outer)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    allowed = {k for k in changed if k.startswith("project/runs/ledger.sqlite3") or k == "project/runs"}
    assert changed == allowed, f"written outside the ledger: {sorted(changed - allowed)}"
    assert (outer / "outside" / "target.yaml").read_bytes() == (PRESETS / "tiny.yaml").read_bytes()


@pytest.mark.anyio
async def test_a_history_folder_symlinked_out_of_configs_is_refused_not_followed(walled):
    outer, project = walled
    (outer / "outside" / "hist").mkdir()
    (project / "configs" / "local").mkdir()
    (project / "configs" / "local" / ".history").symlink_to(outer / "outside" / "hist")
    before = _snapshot(outer / "outside")
    async with Client(mcp, raise_exceptions=True) as c:
        r = await c.call_tool("update_config", {"name": "tiny", "changes": {"train.seed": 5}})
    assert r.is_error and "outside" in text_of(r), text_of(r)
    assert _snapshot(outer / "outside") == before
    assert "seed: 0" in (project / "configs" / "tiny.yaml").read_text(encoding="utf-8")


@settings(max_examples=1500 if os.environ.get("CURRY_TEST_FULL") == "1" else 300, deadline=None, derandomize=True,
          database=None)  # CI budget; CURRY_TEST_FULL=1 is the nightly one
@given(st.one_of(st.text(max_size=80), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,70}\n?", fullmatch=True),
                 st.sampled_from(ATTACK_NAMES)))
def test_every_accepted_name_is_a_plain_file_name_inside_its_folder(name):
    """Property: whatever check_name accepts is one plain, portable path component under configs/ or runs/."""
    try:
        check_name(name)
    except UnsafeName as e:
        assert "not allowed" in str(e) or "reserved" in str(e)
        return
    assert 1 <= len(name) <= 64 and name.isascii() and name.isprintable()
    assert "/" not in name and "\\" not in name and "\x00" not in name and ".." not in name
    assert not name.startswith((".", "-")) and not name.endswith(".") and name.strip() == name
    assert name.split(".")[0].lower() not in RESERVED
    root = Path("/nonexistent-root")
    assert config_path(name, root).parent == root / "configs"


def test_run_dirs_and_config_paths_stay_in_their_folders(tmp_path):
    for name in ("tiny", "a.b-c_d", "x" * 64):
        assert config_path(name, tmp_path).parent == tmp_path / "configs"
        assert run_dir(name, tmp_path).parent == tmp_path / "runs"
    (tmp_path / "runs" / "escape").symlink_to(tmp_path)
    with pytest.raises(UnsafeName):
        run_dir("escape", tmp_path)


def test_new_files_are_readable_like_a_plain_write_and_replaced_files_keep_their_mode(tmp_path):
    old = os.umask(0o022)
    try:
        p = tmp_path / "a.yaml"
        atomic_write_text(p, "one")
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, oct(p.stat().st_mode)  # not mkstemp's 0600
        os.chmod(p, 0o600)  # the user made it private: a rewrite keeps it private
        atomic_write_text(p, "two")
        assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == "two"
        os.umask(0o027)
        q = tmp_path / "b.yaml"
        atomic_write_text(q, "x")
        assert stat.S_IMODE(q.stat().st_mode) == 0o640
    finally:
        os.umask(old)


def test_configs_and_run_records_written_by_the_tools_are_0644(project):
    from curry_train.config import load_config
    from curry_train.store.runs import Ledger

    old = os.umask(0o022)
    try:
        update_config("mine", {"parallel.dp": 2}, base="tiny", root=project)
        update_config("mine", {"parallel.zero": 1}, root=project)
        ledger = Ledger(project)
        rec = ledger.start("bench", load_config(project / "configs" / "tiny.yaml"), "tiny")
        ledger.finish(rec.run_id, status="ok", metrics={"x": 1})
    finally:
        os.umask(old)
    hist = next((project / "configs" / "local" / ".history" / "mine").glob("*.yaml"))
    for p in (project / "configs" / "local" / "mine.yaml", hist, project / "runs" / rec.run_id / "config.yaml",
              project / "runs" / rec.run_id / "metrics.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, (p, oct(p.stat().st_mode))
