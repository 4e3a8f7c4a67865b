"""Paths into a tool's structured result, and `${name.path}` references to earlier results.

The path language of the eval conversations (schema in evals/README.md): `rungs[-1].primitive`, dotted keys in
brackets (`config_patch[parallel.zero]`), `[*]` to map over a list, `[field=value]` to pick a record. Used by the
schema check (evals/conversation.py), the assertion engine (evals/checks.py) and the replay (evals/runner.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

_SEG = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]*)\]")
REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)((?:\.[A-Za-z_][A-Za-z0-9_]*|\[[^\]]*\])*)\}")
BRACED = re.compile(r"(?<!\$)\{([^{}]*)\}")  # `{memory.params}` inside an `expr`: a path of this call's result
MISSING = object()


def parse_path(path: str) -> list[Any]:
    """`rungs[-1].primitive` -> ["rungs", -1, "primitive"]; `config_patch[parallel.zero]` keeps the dotted key;
    `[*]` maps the rest of the path over a list; `rungs[rung=zero3]` picks the first record whose field `rung`
    is "zero3" (compared as text). The empty path is the whole result."""
    if not isinstance(path, str):
        raise TypeError(f"path must be a string, got {path!r}")
    segs: list[Any] = []
    pos = 0
    while pos < len(path):
        m = _SEG.match(path, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot parse path {path!r} at {path[pos:]!r}")
        if m.group(1) is not None:
            segs.append(m.group(1))
        else:
            inner = m.group(2).strip().strip("'\"")
            f = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", inner)
            if f:  # `rungs[rung=zero3]`: the first record whose `rung` is "zero3"
                segs.append(("=", f.group(1), f.group(2)))
            else:
                segs.append(int(inner) if re.fullmatch(r"-?\d+", inner) else inner)
        pos = m.end()
    return segs


def get_path(obj: Any, segs: list[Any]) -> Any:
    for i, s in enumerate(segs):
        if s == "*":
            if not isinstance(obj, list):
                return MISSING
            return [get_path(x, segs[i + 1:]) for x in obj]
        if isinstance(s, tuple):
            hits = [x for x in obj if isinstance(x, dict) and str(x.get(s[1])) == s[2]] \
                if isinstance(obj, list) else []
            if not hits:
                return MISSING
            obj = hits[0]
        elif isinstance(s, int):
            if not isinstance(obj, list) or not -len(obj) <= s < len(obj):
                return MISSING
            obj = obj[s]
        elif isinstance(obj, dict) and s in obj:
            obj = obj[s]
        else:
            return MISSING
    return obj


def refs(obj: Any) -> list[str]:
    """The names of the earlier results that `${name...}` references in `obj` point to."""
    if isinstance(obj, str):
        return [m.group(1) for m in REF.finditer(obj)]
    if isinstance(obj, dict):
        return [r for k, v in obj.items() for r in refs(k) + refs(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in refs(v)]
    return []


def substitute(obj: Any, saved: dict[str, Any]) -> Any:
    """Replace `${name.path}` with a value from an earlier result: typed when it is the whole string."""
    if isinstance(obj, str):
        whole = REF.fullmatch(obj)
        if whole:
            return _lookup(whole, saved)
        return REF.sub(lambda m: str(_lookup(m, saved)), obj)
    if isinstance(obj, dict):
        out = {substitute(k, saved): substitute(v, saved) for k, v in obj.items() if k != "..."}
        if "..." in obj:  # `"...": "${rec.config_patch}"` spreads an earlier mapping in; its keys win
            spread = substitute(obj["..."], saved)
            if not isinstance(spread, dict):
                raise LookupError(f"'...' needs a mapping, got {short(spread)}")
            out.update(spread)
        return out
    if isinstance(obj, list):
        return [substitute(v, saved) for v in obj]
    return obj


def _lookup(m: re.Match, saved: dict[str, Any]) -> Any:
    value = get_path(saved.get(m.group(1), MISSING), parse_path(m.group(2)) if m.group(2) else [])
    if value is MISSING:
        raise LookupError(f"${{{m.group(1)}{m.group(2)}}} is missing from the earlier result")
    return value


def short(x: Any, n: int = 160) -> str:
    """A value as it is shown in a failure line: JSON, cut to `n` characters."""
    if x is MISSING:
        return "<missing>"
    s = json.dumps(x, default=str) if not isinstance(x, str) else repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."
