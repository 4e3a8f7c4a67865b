"""The assertion engine: one `expect` entry of an eval conversation checked against a tool's structured result.

An assertion is a path (evals/paths.py) or an arithmetic `expr` over paths, and exactly one operator of
OPERATORS (the schema in evals/README.md). `check` returns None when it holds, else the one-line reason that
`python -m evals` prints under FAIL.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from .paths import BRACED, MISSING, get_path, parse_path, short, substitute

OPERATORS = {"equals", "not_equals", "in", "not_in", "all_in", "gt", "ge", "lt", "le", "approx", "contains",
             "not_contains", "icontains", "exists", "length", "min_length", "matches", "ordered_as", "type"}
TYPES = {"int": int, "float": (int, float), "number": (int, float), "str": str, "bool": bool, "list": list,
         "dict": dict, "null": type(None)}
_ARITH = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub,
          ast.FloorDiv, ast.Mod, ast.Pow)


def evaluate(expr: str, result: Any, saved: dict[str, Any]) -> Any:
    """`({memory.params} + {memory.grads}) / {param_count}`: arithmetic over paths of the result (and `${..}`
    values of earlier ones). Only numbers and + - * / // % ** are allowed."""
    text = substitute(expr, saved)
    if not isinstance(text, str):
        return text
    values: list[Any] = []

    def put(m: re.Match) -> str:
        v = get_path(result, parse_path(m.group(1).strip()))
        if v is MISSING:
            raise LookupError(f"{{{m.group(1)}}} is missing from the result")
        values.append(v)
        return f"({v!r})"

    tree = ast.parse(BRACED.sub(put, text), mode="eval")
    bad = [type(n).__name__ for n in ast.walk(tree) if not isinstance(n, _ARITH)]
    if bad or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError(f"expr {expr!r}: only arithmetic over numbers is allowed (found {bad or values})")
    return eval(compile(tree, "<expr>", "eval"), {"__builtins__": {}})  # arithmetic only: the AST is checked above


def check(assertion: dict[str, Any], result: Any, saved: dict[str, Any]) -> str | None:
    """None when the assertion holds, else a one-line reason."""
    path = assertion.get("path", assertion.get("expr"))
    (op, want), = ((k, v) for k, v in assertion.items() if k not in ("path", "expr", "why"))
    want = substitute(want, saved)
    if "expr" in assertion:
        try:
            got = evaluate(assertion["expr"], result, saved)
        except (LookupError, ValueError, ZeroDivisionError, SyntaxError) as e:
            return f"{path}: {e}"
    else:
        got = get_path(result, parse_path(path))
    shown = short(got)
    if op == "exists":
        return None if (got is not MISSING) == bool(want) else f"{path}: exists={got is not MISSING}, want {want}"
    if got is MISSING:
        return f"{path}: missing from the result (keys: {sorted(result) if isinstance(result, dict) else '-'})"
    ok: bool
    try:
        if op == "equals":
            ok = _eq(got, want)
        elif op == "not_equals":
            ok = not _eq(got, want)
        elif op == "in":
            ok = any(_eq(got, w) for w in want)
        elif op == "not_in":
            ok = not any(_eq(got, w) for w in want)
        elif op == "all_in":  # every element of a list (e.g. `ranked[*].parallel.pp`) is one of `want`
            ok = isinstance(got, list) and all(any(_eq(x, w) for w in want) for x in got)
        elif op in ("gt", "ge", "lt", "le"):
            ok = _num(got) and {"gt": got > want, "ge": got >= want, "lt": got < want, "le": got <= want}[op]
        elif op == "approx":
            target, rel = (want["value"], want.get("rel", 0.05)) if isinstance(want, dict) else (want, 0.05)
            ok = _num(got) and math.isclose(got, target, rel_tol=rel, abs_tol=want.get("abs", 0.0)
                                            if isinstance(want, dict) else 0.0)
        elif op == "contains":
            ok = _contains(got, want, fold=False)
        elif op == "icontains":
            ok = _contains(got, want, fold=True)
        elif op == "not_contains":
            ok = not _contains(got, want, fold=False)
        elif op == "length":
            ok = len(got) == want
        elif op == "min_length":
            ok = len(got) >= want
        elif op == "matches":
            ok = isinstance(got, str) and re.search(want, got) is not None
        elif op == "ordered_as":  # the items of `got` that appear in `want` come in `want`'s order
            idx = [want.index(x) for x in got if x in want]
            ok = idx == sorted(idx)
        elif op == "type":
            ok = isinstance(got, TYPES[want]) and not (want in ("int", "float", "number") and isinstance(got, bool))
        else:  # pragma: no cover - the schema check rejects unknown operators
            return f"{path}: unknown operator {op}"
    except TypeError as e:
        return f"{path}: {op} {want!r} not applicable to {shown} ({e})"
    if ok:
        return None
    why = f" ({assertion['why']})" if "why" in assertion else ""
    return f"{path}: got {shown}, want {op} {short(want)}{why}"


def _num(x: Any) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise TypeError("not a number")
    return True


def _eq(a: Any, b: Any) -> bool:
    """Equality where True is not 1: booleans only equal booleans; 2 equals 2.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _contains(got: Any, want: Any, *, fold: bool) -> bool:
    if isinstance(got, str):
        return (want.lower() in got.lower()) if fold else (want in got)
    if isinstance(got, dict):
        return want in got
    if isinstance(got, list):
        if fold and isinstance(want, str):
            return any(isinstance(x, str) and want.lower() in x.lower() for x in got)
        if isinstance(want, dict):  # a list of records: one record has every key/value of `want`
            return any(isinstance(x, dict) and all(k in x and _eq(x[k], v) for k, v in want.items()) for x in got)
        return any(_eq(x, want) for x in got)
    raise TypeError("contains needs a string, list or mapping")
