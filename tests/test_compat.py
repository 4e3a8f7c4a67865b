"""Torch outside the supported range fails at import in one line, and the CLI exits 2 with that line.

The old torch is faked by a `torch-VERSION.dist-info` placed first on PYTHONPATH: `importlib.metadata` finds it
before the real torch, which is exactly what curry_train's check reads (it never imports torch).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from curry_train import compat

CLI_SCRIPT = Path(sys.executable).with_name("curry-train")


def _fake_torch(tmp_path: Path, version: str) -> dict[str, str]:
    site = tmp_path / "fake-site"
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1", "2.14.1", "2.15.0", "3.0.0"])
def test_supported_versions_pass(version):
    assert compat.torch_problem(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.9.1+cu128", "2.6.0", "1.13.1", "garbage"])
def test_older_versions_name_both_versions_and_the_feature(version):
    msg = compat.torch_problem(version)
    assert msg is not None and "\n" not in msg
    assert f"torch {version} is installed" in msg and "torch>=2.13" in msg
    assert "PipelineStage(get_mesh=...)" in msg  # the newest API without an older spelling


def test_shimmed_api_is_never_the_reason_and_every_api_is_in_the_minimum(monkeypatch):
    assert all(a.since <= compat.MINIMUM for a in compat.APIS)
    assert compat.parse(compat.TESTED[0]) == compat.MINIMUM
    assert [a.api for a in compat.APIS if a.shim] == ["dist.all_gather_single / reduce_scatter_single"]
    # With only the shimmed API newer than 2.12, a 2.12 torch is refused for being untested, not for that API.
    monkeypatch.setattr(compat, "APIS", tuple(a for a in compat.APIS if a.shim or a.since <= (2, 12)))
    msg = compat.torch_problem("2.12.1")
    assert "all_gather_single" not in msg and "2.13 is the oldest torch the suite and the evals were run on" in msg
    assert "DeviceMesh._unflatten" in compat.torch_problem("2.9.1")  # 2.10, the newest API a 2.9 lacks


def test_every_listed_api_is_in_the_installed_torch(monkeypatch):
    assert compat.missing_apis() == []
    # the probe really looks: an API this torch lacks, or a keyword it does not take, is reported by name
    fake = [compat.Api("no such api", (2, 13), "-", "-", ("torch.distributed", "no_such_collective", None)),
            compat.Api("no such keyword", (2, 13), "-", "-",
                       ("torch.distributed.pipelining", "Schedule1F1B.__init__", "no_such_keyword"))]
    monkeypatch.setattr(compat, "APIS", compat.APIS + tuple(fake))
    assert compat.missing_apis() == ["no such api", "no such keyword"]


def test_missing_torch_is_reported(monkeypatch):
    def absent(name):
        raise compat.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.metadata, "version", absent)
    msg = compat.torch_problem()
    assert msg is not None and "torch is not installed" in msg
    with pytest.raises(compat.TorchVersionError, match="torch is not installed"):
        compat.check_torch()


@pytest.mark.parametrize("argv, cli", [
    (["/v/bin/python", "/v/bin/curry-train", "whitebox"], True),
    (["python", "-m", "curry_train.cli", "runs"], True),
    (["python", "-X", "dev", "-m", "curry_train.cli.__main__"], True),
    (["python", "-m", "pytest", "-q"], False),
    (["python", "-c", "import curry_train"], False),
    (["python", "train.py"], False),
    (["python"], False),
])
def test_entry_is_cli(argv, cli):
    assert compat.entry_is_cli(argv) is cli


def test_import_below_minimum_raises_one_line_import_error(tmp_path):
    env = _fake_torch(tmp_path, "2.9.1")
    code = ("import sys\ntry:\n    import curry_train\nexcept ImportError as e:\n"
            "    print(type(e).__name__, e, sep=': '); sys.exit(3)\n")
    r = _run([sys.executable, "-c", code], env, tmp_path)
    assert r.returncode == 3, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and line.startswith("TorchVersionError: curry_train needs torch>=2.13")
    assert "torch 2.9.1 is installed" in line
    # uncaught, the last line of the traceback is that same one line
    r = _run([sys.executable, "-c", "import curry_train"], env, tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].endswith(line.split(": ", 1)[1])


@pytest.mark.parametrize("entry", ["module", "script"])
def test_cli_below_minimum_exits_2_with_one_line(project, entry):
    if entry == "script" and not CLI_SCRIPT.exists():
        pytest.skip("no curry-train console script next to this interpreter")
    cmd = [sys.executable, "-m", "curry_train.cli"] if entry == "module" else [str(CLI_SCRIPT)]
    r = _run([*cmd, "estimate", "--config", "tiny", "--json", "--root", str(project)],
             _fake_torch(project, "2.12.1"), project)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("curry-train: curry_train needs torch>=2.13 but torch 2.12.1 is installed;")


def test_cli_with_supported_torch_still_runs(project):
    r = _run([sys.executable, "-m", "curry_train.cli", "estimate", "--config", "tiny", "--json", "--root",
              str(project)], _fake_torch(project, "2.14.1"), project)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("{")
