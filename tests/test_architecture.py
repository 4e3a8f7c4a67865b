"""The package layout as a rule: no import cycle anywhere, and imports point one way between the layers.

    .venv/bin/pytest tests/test_architecture.py -q

The graph is built from the source with `ast` (nothing is imported), counting every import, including the ones
inside functions: a lazy import still ties two modules together. For the layers, a module named in a string
counts too: an `importlib.import_module("pkg.mod")` argument, a "pkg.mod:func" entry point, a `-m pkg.mod` command
line, since each loads that module at run time as an import does (docstrings excepted: they describe, they do
not load). The cycle check reads import statements only: a string is how a module loads a plug-in that imports it
back (cli/__init__.py's EXTENSIONS, whose subcommands use the parser helpers), which is no import cycle.
docs/ARCHITECTURE.md draws the same layers.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"curry_train": REPO / "template" / "curry_train", "curry_train_mcp": REPO / "mcp_server",
         "evals": REPO / "evals", "benchmarks": REPO / "benchmarks"}

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contract", ("curry_train", "curry_train.config", "curry_train.rules", "curry_train.paths", "curry_train.mesh",
                  "curry_train.pipeline_split", "curry_train.compat", "curry_train.breakdown",
                  "curry_train.layout_warnings", "curry_train.wrapping", "curry_train.sac_rule")),
    ("template", ("curry_train.model", "curry_train.parallel", "curry_train.train", "curry_train.validation")),
    ("estimator", ("curry_train.estimator",)),
    ("advice", ("curry_train.advice",)),
    ("tools", ("curry_train.measure", "curry_train.store", "curry_train.plots")),
    ("interface", ("curry_train.cli", "curry_train_mcp", "evals", "benchmarks")),
]


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top, root in ROOTS.items():
        for f in root.rglob("*.py"):
            parts = [top, *f.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The longest known module that `name` is or lies inside (a.b.c -> a.b when c is a function)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in MODULES:
            return cand
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


# A string that loads a module: a dotted name of one of the roots, alone or as "module:function", or after "-m ".
_NAME = r"((?:" + "|".join(ROOTS) + r")(?:\.\w+)+)"
_MODULE_STRING = re.compile(rf"^{_NAME}(?::\w+)?$|-m\s+{_NAME}(?=$|\s)")


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def string_imports(source: str) -> set[str]:
    """Dotted module names that the source's string constants load (not its docstrings, nor a string a
    comparison tests a name against: `argv[1] == "curry_train.cli"` loads nothing)."""
    return _string_imports(ast.parse(source))


def _string_imports(tree: ast.Module) -> set[str]:
    docs = _docstrings(tree) | {id(n) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                                for n in ast.walk(node)}
    return {m.group(1) or m.group(2) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            for m in _MODULE_STRING.finditer(node.value.strip())}


def _imports(mod: str, path: Path) -> tuple[set[str], set[str]]:
    """(modules its import statements load, modules its strings load), from one parse of the file."""
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    source = path.read_text(encoding="utf-8")
    out: set[str] = set()
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}  # `if TYPE_CHECKING:` imports never run
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" for a in node.names] or [stem]
        else:
            continue
        for t in targets:
            r = _resolve(t)
            if r and r != mod:
                out.add(r)
    strings = {r for t in _string_imports(tree) if (r := _resolve(t)) and r != mod}  # the same parse
    return out, strings


@functools.cache
def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Built on first use, not at collection: each pytest-xdist worker collects this file, one runs its tests."""
    both = {m: _imports(m, p) for m, p in MODULES.items()}
    return {m: a | b for m, (a, b) in both.items()}, {m: a for m, (a, _) in both.items()}


def graph() -> dict[str, set[str]]:
    """Import statements and module strings: the layers."""
    return _graphs()[0]


def import_graph() -> dict[str, set[str]]:
    """Import statements only: the cycles."""
    return _graphs()[1]


def _layer(mod: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best:
                best, rank = len(pre), i
    return rank


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in import_graph()[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in import_graph():
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_known_edges():
    # A guard against a parser that finds nothing: the test below would then pass vacuously.
    assert "curry_train.config" in graph()["curry_train.estimator"]
    assert "curry_train.parallel.parallelize" in graph()["curry_train.train.loop"]
    assert any(m.startswith("curry_train_mcp.") for m in MODULES)
    assert sum(len(v) for v in graph().values()) > 150
    # edges held only in strings: the torchrun command line, the CLI's extension list
    assert "curry_train.train.rank_main" in graph()["curry_train.train.launch"]
    assert "curry_train_mcp.cli" in graph()["curry_train.cli"]


def test_strings_that_load_a_module_count_as_imports():
    src = '''"""Docstring: run python -m curry_train.cli, see curry_train.measure.bench:bench_job."""
import importlib
a = importlib.import_module("curry_train.measure.bench")
b = "curry_train.measure.memory:memory_job"
c = [sys.executable, "-m", "curry_train.train.rank_main", path]
d = "python -m curry_train.advice.sweep --json"
e = "curry_train.estimator is mentioned in a sentence, which loads nothing"
f = sys.argv[1] == "curry_train.cli"
'''
    assert string_imports(src) == {"curry_train.measure.bench", "curry_train.measure.memory",
                                   "curry_train.train.rank_main", "curry_train.advice.sweep"}


def test_no_import_cycle_anywhere():
    assert _cycles() == [], "import cycles (each line one strongly connected set):\n" + "\n".join(
        " <-> ".join(c) for c in _cycles())


def test_every_module_belongs_to_a_layer():
    assert [m for m in MODULES if _layer(m) < 0] == []


# The estimator computes in one direction, in the order its package docstring lists its files: layout -> model
# states -> activations -> pipeline schedule -> the moments of the step -> peak -> need -> time. A file imports
# only the files before it.
ESTIMATOR_ORDER = ("mla", "layout", "states", "acts", "pipeline", "moments", "phases", "peak", "init", "need",
                   "reserve", "datasheets", "profiles", "compute", "makespan", "comm_ep", "comm")


def test_the_estimator_computes_in_one_direction():
    order = [f"curry_train.estimator.{m}" for m in ESTIMATOR_ORDER]
    assert sorted(order) == sorted(m for m in MODULES if m.startswith("curry_train.estimator."))
    bad = [f"{m} imports {d}" for i, m in enumerate(order) for d in sorted(import_graph()[m])
           if d.startswith("curry_train.estimator") and (d not in order or order.index(d) >= i)]
    assert bad == [], "\n".join(bad)
    doc = (REPO / "template" / "curry_train" / "estimator" / "__init__.py").read_text(encoding="utf-8")
    listed = re.findall(r"^  (\w+)\.py ", doc, flags=re.M)
    assert listed == list(ESTIMATOR_ORDER)


def test_imports_point_down_the_layers():
    bad = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
           for m, deps in sorted(graph().items()) for d in sorted(deps) if _layer(d) > _layer(m)]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("top", ["template/curry_train", "mcp_server", "evals"])
def test_no_module_is_over_400_lines(top):
    long = {str(f.relative_to(REPO)): n for f in (REPO / top).rglob("*.py")
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def test_no_test_file_is_over_400_lines():
    long = {str(f.relative_to(REPO)): n for f in (REPO / "tests").rglob("*.py")
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


# A comment cites the repository's docs (docs/...#section) or a paper, not a tracker the repository does not ship;
# another project's issue (owner/repo issue N, or its URL) is a citation.
_ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
_EXTERNAL = re.compile(r"[\w.-]+/[\w.-]+ issues? #?\d+|https?://", re.IGNORECASE)


def test_no_source_file_cites_an_issue_number():
    cites = [f"{f.relative_to(REPO)}:{i}: {line.strip()[:100]}"
             for top in (*ROOTS.values(), REPO / "tests", REPO / "scripts") for f in sorted(top.rglob("*.py"))
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             if _ISSUE.search(line) and not _EXTERNAL.search(line)]
    assert cites == [], "\n".join(cites)


def test_ruff_check_is_clean():
    """The style rules (pyproject.toml [tool.ruff]: line length 120, imports sorted, pyupgrade) hold everywhere."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[dev]' (scripts/setup.sh does)")
    r = subprocess.run([ruff, "check", "--quiet", str(REPO)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
