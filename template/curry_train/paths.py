"""Where configs and runs live, and the only names a tool argument may turn into a path.

The project root is, in order: an explicit `root` argument, the current directory if it holds `configs/`, else the
checkout this package was installed from (editable install). Tools only ever write under `<root>/configs/local/` and
`<root>/runs/`, through `written_config_path()` / `run_dir()`, which accept restricted names, never paths.

Two kinds of config share one namespace: the presets shipped in `configs/` (read-only to the tools) and the configs
the tools write (`update_config`, `climb`) in `configs/local/`, with their history in `configs/local/.history/`.
The repository ignores `configs/local/` (and `runs/`), so README command 1 then command 2 leave `git status` clean
(docs/INTEGRATION.md, "Where files go"). A written config shadows the preset of the same name: `config_path` reads
configs/local/<name>.yaml when it exists, else configs/<name>.yaml.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Windows device names: a config called "con" cannot be created on a shared drive.
RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


class UnsafeName(ValueError):
    """A config name or run id that is not a plain safe name."""


def check_name(name: object, what: str = "name") -> str:
    """A plain file name: letters, digits, `_`, `.`, `-`; no path separators, no `..`, <= 64 chars."""
    # fullmatch, not match: `$` also matches before a trailing newline, so match() let "tiny\n" through and
    # update_config created "configs/tiny\n.yaml" (found by tests/reliability/test_fuzz_tools.py).
    # A trailing '.' is refused too: Windows drops it, so "tiny." and "tiny" would be one file there.
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name or name.endswith("."):
        raise UnsafeName(
            f"{what} {name!r} is not allowed: use 1-64 letters, digits, '_', '.', '-' (no '/', no '..', "
            "no trailing '.'), e.g. 'tiny' or 'my-run.2'"
        )
    if name.split(".")[0].lower() in RESERVED:
        raise UnsafeName(f"{what} {name!r} is a reserved device name; pick another")
    return name


def project_root(root: str | Path | None = None) -> Path:
    if root is not None:
        return Path(root).resolve()
    cwd = Path.cwd()
    if (cwd / "configs").is_dir():
        return cwd.resolve()
    return Path(__file__).resolve().parents[2]  # template/curry_train/paths.py -> checkout root


def configs_dir(root: str | Path | None = None) -> Path:
    return project_root(root) / "configs"


LOCAL = "local"  # the folder of configs/ the tools write into; .gitignore names it


def written_dir(root: str | Path | None = None) -> Path:
    """configs/local/: every config a tool writes, and .history/ of their previous versions."""
    return configs_dir(root) / LOCAL


def config_names(root: str | Path | None = None) -> list[str]:
    """Every config a name can resolve to: the written ones and the presets, sorted, each once."""
    return sorted({p.stem for d in (configs_dir(root), written_dir(root)) for p in d.glob("*.yaml")})


def runs_dir(root: str | Path | None = None) -> Path:
    d = project_root(root) / "runs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _inside(path: Path, parent: Path) -> Path:
    """Refuse anything that resolves outside `parent` (a symlink pointing out, say)."""
    resolved = path.resolve()
    if resolved != parent.resolve() and parent.resolve() not in resolved.parents:
        raise UnsafeName(f"{path} resolves outside {parent}; refusing")
    return path


def written_config_path(name: str, root: str | Path | None = None) -> Path:
    """configs/local/<name>.yaml: where a tool writes the config `name` (a trailing .yaml is accepted)."""
    name = name[:-5] if isinstance(name, str) and name.endswith(".yaml") else name
    check_name(name, "config name")
    # a preset of this name symlinked out of configs/ is not a config name: refuse it here too, rather than let a
    # written config shadow it (tests/reliability/test_paths.py)
    _inside(configs_dir(root) / f"{name}.yaml", configs_dir(root))
    return _inside(written_dir(root) / f"{name}.yaml", configs_dir(root))


def config_path(name: str, root: str | Path | None = None) -> Path:
    """The file a config name such as 'tiny' reads: the written configs/local/<name>.yaml, else the preset
    configs/<name>.yaml (which may not exist; callers report it with config_names())."""
    written = written_config_path(name, root)
    if written.is_file():
        return written
    d = configs_dir(root)
    return _inside(d / written.name, d)


def run_dir(run_id: str, root: str | Path | None = None) -> Path:
    check_name(run_id, "run id")
    d = runs_dir(root)
    return _inside(d / run_id, d)


def resolve_config_arg(arg: str, root: str | Path | None = None) -> Path:
    """CLI `--config`: a path to an existing YAML file (read-only use), or a config name under configs/.

    A YAML path that does not exist is reported as such, with the configs there are (`configs/nope.yaml` used to
    fall through to the name check and get "is not allowed (no '/')")."""
    p = Path(arg)
    if p.suffix in (".yaml", ".yml"):
        if p.is_file():
            return p
        if len(p.parts) > 1:  # a path, not a bare 'tiny.yaml' (that one is the name 'tiny', checked below)
            have = ", ".join(config_names(root)) or "(none)"
            raise FileNotFoundError(f"config file {arg} does not exist; available configs in {configs_dir(root)}: "
                                    f"{have} (pass one of these names, or an existing YAML path)")
    return config_path(arg, root)


def _umask() -> int:
    """The process umask, read without setting it (os.umask(0) would briefly loosen it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc (macOS): the classic read-by-setting, restored at once
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write-then-rename in the same folder, fsync'd: a reader sees the old file or the new one, never half.

    The new file keeps the mode of the file it replaces, or gets what a plain open() would give (0666 & ~umask,
    usually 0644): mkstemp's 0600 would make every config and run record private to the writer.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
