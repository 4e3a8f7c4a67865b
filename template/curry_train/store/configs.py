"""Write configs safely: validate first, keep every previous version, replace the file atomically.

    curry-train update-config tiny-dp2 --base tiny --set parallel.dp=2 --json

`update_config(name, changes, base=None)` starts from config `base` (or the current config `name`), applies dotted
`changes`, validates the whole config (ConfigError -> nothing is written), saves the version it replaces under
configs/local/.history/<name>/<UTC time>.yaml, then writes configs/local/<name>.yaml by write-then-rename. The
shipped presets in configs/ are never written (curry_train/paths.py: configs/local/ is ignored by the repository,
so a climb leaves the checkout clean); updating a preset's name writes configs/local/<name>.yaml, which shadows it.
Writers of the same name are serialised by an advisory lock, so two concurrent updates never lose one another.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from curry_train.breakdown import JsonValue
from curry_train.config import ConfigError, Problem, dump_yaml, flatten, from_dict, load_yaml
from curry_train.paths import _inside, atomic_write_text, config_names, config_path, written_config_path, written_dir


class ConfigChange(BaseModel):
    key: str = Field(description="Dotted key, e.g. parallel.dp")
    old: JsonValue = Field(description="Value before (null when the config is new)")
    new: JsonValue = Field(description="Value after (null when the key was removed)")


class ConfigUpdate(BaseModel):
    name: str
    path: str = Field(description="The file written (configs/local/<name>.yaml).")
    created: bool = Field(description="True when configs/local/<name>.yaml did not exist before.")
    written: bool = Field(description="False when the changes left the config as it was (nothing written).")
    base: str | None = Field(description="The config the changes were applied to.")
    previous_version: str | None = Field(None, description="Where the replaced version was saved (history).")
    diff: list[ConfigChange] = Field(
        description="Every key whose value changed, against the replaced version (or the base, for a new config).")
    config: dict[str, Any] = Field(description="The resolved config now in the file.")


def available(root: str | Path | None = None) -> list[str]:
    return config_names(root)


def _missing(name: str, root: str | Path | None) -> FileNotFoundError:
    return FileNotFoundError(f"no config {name!r}; available: {', '.join(available(root)) or '(none)'}")


def history_dir(name: str, root: str | Path | None = None) -> Path:
    stem = written_config_path(name, root).stem  # validates the name
    # a .history (or .history/<name>) symlinked out of configs/local/ must not carry writes elsewhere
    return _inside(written_dir(root) / ".history" / stem, written_dir(root))


def history(name: str, root: str | Path | None = None) -> list[Path]:
    """Saved previous versions of configs/local/<name>.yaml, oldest first."""
    d = history_dir(name, root)
    return sorted(d.glob("*.yaml")) if d.is_dir() else []


@contextlib.contextmanager
def _locked(name: str, root: str | Path | None) -> Iterator[None]:
    d = _inside(written_dir(root) / ".history", written_dir(root))
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f".{history_dir(name, root).name}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _normalise(changes: dict[str, Any] | None) -> dict[str, Any]:
    """Accept dotted keys ({"parallel.dp": 2}) or sections ({"parallel": {"dp": 2}})."""
    if changes is None:
        return {}
    if not isinstance(changes, dict):
        raise ConfigError([Problem(fields=["changes"], message="changes must be a mapping of dotted keys",
                                   fix='pass e.g. {"parallel.dp": 2}')])
    out: dict[str, Any] = {}
    for k, v in changes.items():
        if isinstance(v, dict) and "." not in str(k):
            out.update({f"{k}.{kk}": vv for kk, vv in flatten(v).items()})
        else:
            out[k] = v
    return out


def _remove_stale_temps(target: Path) -> None:
    """Temp files a writer killed mid-write left behind (atomic_write_text names them .<file>.<random>.tmp).

    Only called under the name's lock: every writer of this name holds it while its temp file exists, and the
    kernel drops a dead writer's lock, so any such file seen here belongs to a writer that died.
    """
    patterns = [(target.parent, f".{target.name}.*.tmp")]
    hist = target.parent / ".history" / target.stem
    if hist.is_dir():
        patterns.append((hist, ".*.yaml.*.tmp"))
    for folder, pattern in patterns:
        for stale in folder.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


def _flat_existing(path: Path) -> dict[str, Any]:
    """The current file, resolved with defaults when it parses; raw keys when it was hand-edited into garbage."""
    try:
        raw = load_yaml(path)
    except ConfigError:
        return {}
    try:
        return flatten(from_dict(raw, validate=False).to_dict())
    except ConfigError:
        return flatten(raw) if isinstance(raw, dict) else {}


def update_config(name: str, changes: dict[str, Any] | None, base: str | None = None, *,
                  root: str | Path | None = None, base_raw: dict[str, Any] | None = None) -> ConfigUpdate:
    """Validate `base` (or the current `name`) + `changes`, then atomically write configs/local/<name>.yaml.

    `base_raw` is a base that is no file (a config imported from elsewhere, store/hf_import.py): the changes
    apply to it, and `base` is then only the label the header and the result name it by."""
    target = written_config_path(name, root)
    name = target.stem
    if base_raw is not None:
        base_path, base = None, base or "<given>"
    elif base is not None:
        base_path = config_path(base, root)
        if not base_path.is_file():
            raise _missing(base, root)
        base = base_path.stem
    elif config_path(name, root).is_file():  # the written config, else the preset it will shadow
        base_path, base = config_path(name, root), name
    else:
        raise FileNotFoundError(f"no config {name!r} to update; pass base (one of: {', '.join(available(root))}) "
                                "to create it from an existing config")
    dotted = _normalise(changes)

    def read_base() -> dict[str, Any]:
        return copy.deepcopy(base_raw) if base_path is None else load_yaml(base_path)

    from_dict(read_base(), dotted)  # ConfigError here: nothing written, not even the lock file
    with _locked(name, root):
        _remove_stale_temps(target)
        new_cfg = from_dict(read_base(), dotted)  # again under the lock: the base may have changed
        created = not target.is_file()
        if not created:
            old = _flat_existing(target)
        else:
            old = _flat_existing(base_path) if base_path is not None else \
                flatten(from_dict(read_base(), validate=False).to_dict())
        new = new_cfg.to_dict()
        flat = flatten(new)
        diff = [ConfigChange(key=k, old=old.get(k), new=flat.get(k))
                for k in sorted(set(old) | set(flat)) if old.get(k) != flat.get(k)]
        if not created and not diff:  # nothing to change: no new version, no history entry
            return ConfigUpdate(name=name, path=str(target), created=False, written=False, base=base, diff=[],
                                config=new)
        saved = None
        if not created:
            hist = history_dir(name, root)
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}Z"
            saved_path = hist / f"{stamp}.yaml"
            atomic_write_text(saved_path, target.read_text(encoding="utf-8"))
            saved = str(saved_path)
        header = f"# written by update_config from {base} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
        atomic_write_text(target, header + dump_yaml(new_cfg))  # keeps the old mode; new files get 0666 & ~umask
    return ConfigUpdate(name=name, path=str(target), created=created, written=True, base=base,
                        previous_version=saved, diff=diff, config=new)
