"""docs/CONTRACTS.md and docs/ARCHITECTURE.md quote function signatures; each must exist with those parameters.

    .venv/bin/pytest tests/test_docs_contracts.py -q

Every inline-code call in the two pages, `name(a, b=1, ...)` or `module.name(a)`, is looked up with `ast` (nothing
is imported) among the functions, methods and classes of curry_train and curry_train_mcp: a quoted name must be
defined there (or be torch's or pydantic's, listed below), and its quoted parameters must be parameters of that
definition in the quoted order (a class: its __init__, or its fields in order). `...` stands for parameters left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "docs" / "CONTRACTS.md", REPO / "docs" / "ARCHITECTURE.md"]
ROOTS = {"curry_train": REPO / "template" / "curry_train", "curry_train_mcp": REPO / "mcp_server"}
EXTERNAL = {"full_tensor", "fully_shard", "ZeroRedundancyOptimizer", "AdamW", "init_device_mesh",  # torch's
            "Field"}  # pydantic's
CALL = re.compile(r"`((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(([^`()]*)\)")


def _params(node: ast.AST) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        a = node.args
        names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        names += [f"*{a.vararg.arg}"] if a.vararg else []
        return [n for n in names if n not in ("self", "cls")]
    assert isinstance(node, ast.ClassDef)
    init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
    if init is not None:
        return _params(init)
    return [b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]


def _definitions() -> dict[str, list[tuple[str, list[str]]]]:
    """name -> [(qualified module.[Class.]name, parameters)] for every function, method and class."""
    out: dict[str, list[tuple[str, list[str]]]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.setdefault(node.name, []).append((f"{prefix}.{node.name}", _params(node)))
                visit(node.body, f"{prefix}.{node.name}")

    for top, root in ROOTS.items():
        for f in root.rglob("*.py"):
            mod = ".".join([top, *f.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")
            visit(ast.parse(f.read_text(encoding="utf-8")).body, mod)
    return out


DEFS = _definitions()


def quoted_calls() -> list[tuple[str, str, list[str]]]:
    """(page, dotted name, quoted parameter names) of every inline-code call in the pages."""
    calls = []
    for page in DOCS:
        for m in CALL.finditer(page.read_text(encoding="utf-8")):
            args = [a.strip() for a in m.group(2).split(",") if a.strip()]
            names = [re.split(r"[=:]", a)[0].strip() for a in args]
            calls.append((page.name, m.group(1), [n for n in names if n not in ("...", "*")]))
    return calls


def _matches(quoted: list[str], params: list[str]) -> bool:
    """Each quoted name is a parameter, in order (a quoted literal such as "dp" matches positionally)."""
    it = iter(params)
    return all(any(q == p or q.strip("\"'").isdigit() or q.startswith(("\"", "'", "{", "[")) for p in it)
               for q in quoted)


def test_the_pages_quote_signatures_at_all():
    assert len(quoted_calls()) > 30  # a parser that finds nothing would pass the test below vacuously


@pytest.mark.parametrize(("page", "name", "quoted"), quoted_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_quoted_signature_exists_with_its_parameters(page, name, quoted):
    short = name.rpartition(".")[2]
    if short in EXTERNAL:
        return
    cands = [(q, p) for q, p in DEFS.get(short, []) if name == short or q.endswith("." + name)]
    assert cands, f"{page}: `{name}(...)` is not defined in curry_train or curry_train_mcp"
    found = [f"{q}({', '.join(p)})" for q, p in cands]
    assert any(_matches(quoted, p) for _, p in cands), f"{page}: `{name}({', '.join(quoted)})` is none of {found}"


def test_a_renamed_parameter_is_caught():
    params = dict(DEFS["forward_backward"])["curry_train.train.loop.forward_backward"]
    assert _matches(["par", "step"], params)
    assert not _matches(["par", "inputs", "targets"], params)
