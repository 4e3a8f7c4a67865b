"""Replay the scripted eval conversations against the real curryTrain MCP server over stdio.

    python -m evals                         # every conversation, both protocol eras where the file asks for them
    python -m evals -k zero -v              # only ids containing "zero", with every check printed
    python -m evals --server-command "python /tmp/patched_server.py"   # replay against another server build

For each conversation (evals/conversations/<id>.yaml, schema in evals/README.md) the runner
  1. checks that the user's message routes to the expected skill (evals/routing.py, BM25 over names+descriptions),
  2. reads that skill as a host would activate it (`skill://<name>/SKILL.md`),
  3. makes every scripted tool call through the official MCP client (`mcp.Client` over `stdio_client`) and checks
     every assertion on the structured result (or on the error text, for calls that must fail),
  4. checks the expected final recommendation against the last `recommend_next` result,
then prints one line per conversation and a closing line `N passed, N failed`; the exit status is 1 on any failure.

The server runs in a throwaway project root (a copy of configs/, an empty runs/), so an eval never writes into the
repository. One server process is started per protocol era and shared by the conversations of that era; a
conversation that breaks the connection gets a fresh server for the next one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import yaml

from .routing import Router

ROOT = Path(__file__).resolve().parent.parent
CONVERSATIONS_DIR = Path(__file__).resolve().parent / "conversations"

TOOLS = {
    "probe_hardware": {"measure"},
    "bench": {"config", "steps", "warmup", "overrides"},
    "whitebox_compare": {"config", "steps", "overrides", "inject"},
    "update_config": {"name", "changes", "base"},
    "runs_diff": {"run_a", "run_b"},
    "estimate_memory": {"config", "overrides"},
    "recommend_next": {"config", "symptom", "overrides"},
    "plan": {"model", "gpus_per_node", "nodes", "gpu_memory_gib", "seq_len", "global_batch"},
    "capacity_sweep": None,  # config plus sweep options; checked against the live input schema instead
}
EXPENSIVE = {"bench", "whitebox_compare"}  # torchrun launches: a handful of conversations only
PRIMITIVES = ("none", "recompute", "zero1", "zero2", "zero3", "tp", "pp", "ep", "cp", "dp")
ERAS = ("auto", "legacy")

# What the conversation set as a whole must exercise: every rung and anti-pattern of the stage-4 ladder, plus the
# tool flows and bad input. A conversation lists the tags it covers in `covers`.
COVERAGE = {
    "single-gpu-oom": "one device runs out of memory -> recompute first",
    "ddp-oom": "plain DDP runs out of memory -> shard (ZeRO)",
    "zero-stage": "the lowest ZeRO stage that fits",
    "recompute": "activation recompute after full sharding, before TP",
    "tp-after-fsdp-recompute": "TP only when ZeRO-3 + recompute still does not fit, and within a node",
    "no-tp-before-fsdp": "anti-pattern: TP before FSDP",
    "pp-across-nodes": "PP across nodes when communication-bound",
    "no-pp-single-node": "anti-pattern: PP inside one node",
    "ep-moe": "EP for MoE models",
    "no-ep-dense": "anti-pattern: EP for a dense model",
    "cp-long-context": "CP for long sequences",
    "no-cp-short-context": "anti-pattern: CP without proven need",
    "nothing-to-add": "the config fits and is not communication-bound: add nothing",
    "more-gpus": "only more GPUs help",
    "plan": "the planner climbs the ladder",
    "estimate": "memory estimate",
    "capacity": "capacity sweep",
    "hardware": "hardware probe",
    "bench": "a measured step benchmark",
    "whitebox": "white-box parity against the single-device reference",
    "runs-diff": "two runs, then runs_diff",
    "update-config": "write a config",
    "invalid-config": "bad input: an invalid config is refused with the field named",
    "unknown-config": "bad input: an unknown config name",
    "path-traversal": "bad input: a name that is a path is refused",
}
OPERATORS = {"equals", "not_equals", "in", "not_in", "all_in", "gt", "ge", "lt", "le", "approx", "contains",
             "not_contains", "icontains", "exists", "length", "min_length", "matches", "ordered_as", "type"}
TYPES = {"int": int, "float": (int, float), "number": (int, float), "str": str, "bool": bool, "list": list,
         "dict": dict, "null": type(None)}
CONVERSATION_KEYS = {"id", "user", "skill", "covers", "eras", "calls", "final", "notes"}
CALL_KEYS = {"tool", "args", "as", "expect", "error", "timeout_s", "why"}
FINAL_KEYS = {"answer", "primitive", "mentions"}


# ----------------------------------------------------------------------------------------------- schema


class SchemaError(ValueError):
    pass


def load_conversation(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    validate_conversation(data, path.stem)
    return data


def load_all(directory: Path = CONVERSATIONS_DIR) -> list[dict[str, Any]]:
    return [load_conversation(p) for p in sorted(directory.glob("*.yaml"))]


def validate_conversation(c: Any, stem: str | None = None, skills: set[str] | None = None) -> None:
    """Raise SchemaError naming the first thing wrong with one conversation."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise SchemaError(f"{stem or '?'}: {msg}")

    need(isinstance(c, dict), "a conversation is a mapping")
    need(not (set(c) - CONVERSATION_KEYS), f"unknown keys {sorted(set(c) - CONVERSATION_KEYS)}")
    for k in ("id", "user", "skill", "covers", "calls", "final"):
        need(k in c, f"missing {k!r}")
    need(isinstance(c["id"], str) and re.fullmatch(r"[a-z0-9][a-z0-9-]*", c["id"]) is not None, "id: kebab-case")
    need(stem is None or c["id"] == stem, f"id {c['id']!r} must equal the file name {stem!r}")
    need(isinstance(c["user"], str) and len(c["user"].split()) >= 4, "user: the user's message, a sentence")
    need(isinstance(c["skill"], str), "skill: the expected skill name")
    need(skills is None or c["skill"] in skills, f"skill {c['skill']!r} is not in skills/")
    need(isinstance(c["covers"], list) and c["covers"], "covers: a non-empty list of coverage tags")
    bad = [t for t in c["covers"] if t not in COVERAGE]
    need(not bad, f"covers: unknown tags {bad}; known: {sorted(COVERAGE)}")
    eras = c.get("eras", list(ERAS))
    need(isinstance(eras, list) and eras and set(eras) <= set(ERAS), f"eras: a non-empty subset of {list(ERAS)}")
    need(isinstance(c["calls"], list) and c["calls"], "calls: a non-empty list")
    names: set[str] = set()
    for i, call in enumerate(c["calls"]):
        where = f"calls[{i}]"
        need(isinstance(call, dict), f"{where}: a mapping")
        need(not (set(call) - CALL_KEYS), f"{where}: unknown keys {sorted(set(call) - CALL_KEYS)}")
        tool = call.get("tool")
        need(tool in TOOLS, f"{where}: tool {tool!r} is not one of {sorted(TOOLS)}")
        args = call.get("args", {})
        need(isinstance(args, dict), f"{where}: args must be a mapping")
        allowed = TOOLS[tool]
        need(allowed is None or not (set(args) - allowed), f"{where}: {tool} takes {sorted(allowed or [])}")
        need(("expect" in call) != ("error" in call), f"{where}: exactly one of expect (success) or error (failure)")
        if "error" in call:
            need(isinstance(call["error"], list) and call["error"] and all(isinstance(s, str) for s in call["error"]),
                 f"{where}: error is a non-empty list of substrings the message must contain")
        else:
            need(isinstance(call["expect"], list) and call["expect"], f"{where}: expect is a non-empty list")
            for j, a in enumerate(call["expect"]):
                need(isinstance(a, dict) and ("path" in a) != ("expr" in a),
                     f"{where}.expect[{j}]: needs exactly one of path or expr")
                ops = set(a) - {"path", "expr", "why"}
                need(len(ops) == 1 and ops <= OPERATORS,
                     f"{where}.expect[{j}]: exactly one operator of {sorted(OPERATORS)}, got {sorted(ops)}")
                try:
                    for p in [a["path"]] if "path" in a else [m.group(1) for m in _BRACED.finditer(a["expr"])]:
                        parse_path(p.strip())
                except (ValueError, TypeError) as e:
                    raise SchemaError(f"{stem}: {where}.expect[{j}]: {e}") from None
                if "type" in a:
                    need(a["type"] in TYPES, f"{where}.expect[{j}]: type one of {sorted(TYPES)}")
                for op in ops & {"gt", "ge", "lt", "le"}:  # YAML reads 7.5e9 as a string: write 7.5e+9
                    v = a[op]
                    need((isinstance(v, (int, float)) and not isinstance(v, bool)) or
                         (isinstance(v, str) and _REF.fullmatch(v) is not None),
                         f"{where}.expect[{j}]: {op} needs a number or a ${{ref}}, got {v!r}")
        for ref in _refs(args):
            need(ref in names, f"{where}: ${{{ref}...}} refers to no earlier call saved with `as: {ref}`")
        if "as" in call:
            need(isinstance(call["as"], str) and call["as"].isidentifier(), f"{where}: as must be an identifier")
            names.add(call["as"])
        for ref in _refs(call.get("expect", [])):  # expectations may also use this call's own result
            need(ref in names, f"{where}: ${{{ref}...}} refers to no call saved with `as: {ref}`")
    f = c["final"]
    need(isinstance(f, dict) and not (set(f) - FINAL_KEYS), f"final: keys among {sorted(FINAL_KEYS)}")
    need(isinstance(f.get("answer"), str) and f["answer"], "final.answer: the expected recommendation in words")
    need(isinstance(f.get("mentions"), list) and f["mentions"], "final.mentions: words a correct answer contains")
    if "primitive" in f:
        prims = f["primitive"] if isinstance(f["primitive"], list) else [f["primitive"]]
        need(all(p in PRIMITIVES for p in prims), f"final.primitive: among {list(PRIMITIVES)}")
        need(any(call["tool"] == "recommend_next" and "expect" in call for call in c["calls"]),
             "final.primitive needs a successful recommend_next call to check it against")


def launches(conv: dict[str, Any]) -> bool:
    """Whether a conversation starts torchrun: a bench / whitebox_compare call that must succeed."""
    return any(c["tool"] in EXPENSIVE and "expect" in c for c in conv["calls"])


def _refs(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [m.group(1) for m in _REF.finditer(obj)]
    if isinstance(obj, dict):
        return [r for k, v in obj.items() for r in _refs(k) + _refs(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in _refs(v)]
    return []


# ----------------------------------------------------------------------------------------------- paths and values

_SEG = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]*)\]")
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)((?:\.[A-Za-z_][A-Za-z0-9_]*|\[[^\]]*\])*)\}")
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


def substitute(obj: Any, saved: dict[str, Any]) -> Any:
    """Replace `${name.path}` with a value from an earlier result: typed when it is the whole string."""
    if isinstance(obj, str):
        whole = _REF.fullmatch(obj)
        if whole:
            return _lookup(whole, saved)
        return _REF.sub(lambda m: str(_lookup(m, saved)), obj)
    if isinstance(obj, dict):
        out = {substitute(k, saved): substitute(v, saved) for k, v in obj.items() if k != "..."}
        if "..." in obj:  # `"...": "${rec.config_patch}"` spreads an earlier mapping in; its keys win
            spread = substitute(obj["..."], saved)
            if not isinstance(spread, dict):
                raise LookupError(f"'...' needs a mapping, got {_short(spread)}")
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


_BRACED = re.compile(r"(?<!\$)\{([^{}]*)\}")
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

    tree = ast.parse(_BRACED.sub(put, text), mode="eval")
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
    shown = _short(got)
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
    return f"{path}: got {shown}, want {op} {_short(want)}{why}"


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


def _short(x: Any, n: int = 160) -> str:
    if x is MISSING:
        return "<missing>"
    s = json.dumps(x, default=str) if not isinstance(x, str) else repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------- the server


def make_project(tmp: Path) -> Path:
    """A throwaway project root: the repository's configs (no history) and an empty runs/."""
    (tmp / "configs").mkdir(parents=True)
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        shutil.copy2(p, tmp / "configs" / p.name)
    (tmp / "runs").mkdir()
    return tmp


def default_server_command() -> list[str]:
    """`curry-train mcp` from the same environment as this interpreter."""
    script = Path(sys.executable).with_name("curry-train")
    if script.exists():
        return [str(script), "mcp"]
    return [sys.executable, "-m", "curry_train.cli", "mcp"]


def server_env(project: Path) -> dict[str, str]:
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
    env = {k: v for k, v in os.environ.items() if not secret.search(k)}
    env["CURRY_TRAIN_ROOT"] = str(project)  # the server's project root (also its cwd): never the repository
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _open_log(path: Path) -> Any:
    """The server's stderr goes here (printed on failure), never onto the runner's output."""
    return path.open("a", encoding="utf-8")


@dataclass
class Server:
    """One stdio server process and the connected client, for one protocol era."""

    command: list[str]
    project: Path
    era: str
    log: Path
    client: Any = None
    _stack: contextlib.AsyncExitStack | None = None
    tools: dict[str, Any] = field(default_factory=dict)

    async def start(self) -> None:
        from mcp import Client, StdioServerParameters, stdio_client

        params = StdioServerParameters(command=self.command[0], args=self.command[1:], cwd=str(self.project),
                                       env=server_env(self.project))
        self._stack = contextlib.AsyncExitStack()
        errlog = self._stack.enter_context(_open_log(self.log))
        # No cancel scope around the entry: the client's task group must outlive it (anyio nesting rules).
        self.client = await self._stack.enter_async_context(
            Client(stdio_client(params, errlog=errlog), mode=self.era, read_timeout_seconds=180))
        self.tools = {t.name: t for t in (await self.client.list_tools()).tools}

    async def stop(self) -> None:
        if self._stack is not None:  # closing stdin ends the server; the SDK kills it if it lingers
            with contextlib.suppress(Exception):
                await self._stack.aclose()
        self._stack, self.client = None, None

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def result_text(result: Any) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content if getattr(b, "type", "") == "text")


# ----------------------------------------------------------------------------------------------- replay


@dataclass
class Outcome:
    id: str
    failures: list[str] = field(default_factory=list)
    eras: list[str] = field(default_factory=list)
    calls: int = 0
    wall_s: float = 0.0
    checks: list[str] = field(default_factory=list)
    broken_connection: bool = False


async def replay(conv: dict[str, Any], server: Server, out: Outcome) -> None:
    """Make every call of one conversation on one server; append failures to `out`."""
    from mcp import MCPError
    from mcp.types import REQUEST_TIMEOUT

    era = server.era
    try:
        res = await server.client.read_resource(f"skill://{conv['skill']}/SKILL.md")
        text = res.contents[0].text
        if f"name: {conv['skill']}" not in text:
            out.failures.append(f"[{era}] skill://{conv['skill']}/SKILL.md does not carry its front matter")
    except MCPError as e:
        out.failures.append(f"[{era}] skill://{conv['skill']}/SKILL.md is not served: {e}")
    saved: dict[str, Any] = {}
    last_recommendation: Any = MISSING
    for i, call in enumerate(conv["calls"]):
        tool = call["tool"]
        where = f"[{era}] call {i + 1} {tool}"
        if tool not in server.tools:
            out.failures.append(f"{where}: the server has no such tool (has {sorted(server.tools)})")
            continue
        try:
            args = substitute(call.get("args", {}), saved)
        except LookupError as e:
            out.failures.append(f"{where}: {e}")
            continue
        schema_props = set((server.tools[tool].input_schema or {}).get("properties", {}))
        unknown = set(args) - schema_props
        if unknown:
            out.failures.append(f"{where}: arguments {sorted(unknown)} are not in the tool's input schema "
                                f"{sorted(schema_props)}")
            continue
        timeout = call.get("timeout_s", 180 if tool in EXPENSIVE else 60)
        try:
            with anyio.fail_after(timeout):
                result = await server.client.call_tool(tool, args, read_timeout_seconds=timeout)
            is_error, text, data = result.is_error, result_text(result), result.structured_content
        except MCPError as e:  # a JSON-RPC error instead of a tool result
            if e.code == REQUEST_TIMEOUT:
                out.failures.append(f"{where}: no answer within {timeout}s")
                out.broken_connection = True
                return
            is_error, text, data = True, str(e), None
        except TimeoutError:
            out.failures.append(f"{where}: no answer within {timeout}s")
            out.broken_connection = True
            return
        out.calls += 1
        if "error" in call:
            if not is_error:
                out.failures.append(f"{where}: succeeded, but must fail with {call['error']}")
                continue
            missing = [s for s in call["error"] if s.lower() not in text.lower()]
            if missing:
                out.failures.append(f"{where}: error message lacks {missing}: {text[:300]!r}")
            else:
                out.checks.append(f"{where}: error {text[:120]!r}")
            continue
        if is_error:
            out.failures.append(f"{where}: failed: {text[:400]}")
            continue
        if data is None:
            with contextlib.suppress(ValueError):
                data = json.loads(text)
        if "as" in call:
            saved[call["as"]] = data
        for a in call["expect"]:
            reason = check(a, data, saved)
            if reason:
                out.failures.append(f"{where}: {reason}")
            else:
                out.checks.append(f"{where}: {a.get('path', a.get('expr'))} ok")
        if tool == "recommend_next":
            last_recommendation = data
    prim = conv["final"].get("primitive")
    if prim is not None and last_recommendation is not MISSING:
        allowed = prim if isinstance(prim, list) else [prim]
        got = last_recommendation.get("primitive") if isinstance(last_recommendation, dict) else None
        if got not in allowed:
            out.failures.append(f"[{era}] final recommendation: recommend_next says {got!r}, want {allowed} "
                                f"({conv['final']['answer']})")


async def run_all(convs: list[dict[str, Any]], *, command: list[str], router: Router,
                  eras: list[str]) -> list[Outcome]:
    outcomes = {c["id"]: Outcome(id=c["id"]) for c in convs}
    for c in convs:  # routing needs no server
        ranked = router.rank(c["user"])
        if ranked[0][0] != c["skill"]:
            top = ", ".join(f"{n} {s:.2f}" for n, s in ranked[:3])
            score = dict(ranked)[c["skill"]]
            out = outcomes[c["id"]]
            out.failures.append(f"routing: the message selects {ranked[0][0]!r}, not {c['skill']!r} "
                                f"(top: {top}; {c['skill']} {score:.2f}, shared words "
                                f"{router.explain(c['user'], c['skill'])})")
    with tempfile.TemporaryDirectory(prefix="curry-evals-") as tmp:
        for era in eras:
            project = make_project(Path(tmp) / f"project-{era}")  # eras never see each other's configs or runs
            todo = [c for c in convs if era in c.get("eras", ERAS)]
            server: Server | None = None
            start_failed = False
            for c in todo:
                out = outcomes[c["id"]]
                t0 = time.perf_counter()
                if start_failed:
                    out.failures.append(f"[{era}] the server did not start (see the first failure)")
                    continue
                if server is None:
                    server = Server(command, project, era, Path(tmp) / f"server-{era}-{c['id']}.log")
                    try:
                        await server.start()
                    except Exception as e:  # noqa: BLE001 - report any start-up failure as the eval's failure
                        out.failures.append(f"[{era}] the server did not start: {type(e).__name__}: {e}\n"
                                            f"{server.log_tail()}")
                        await server.stop()
                        server, start_failed = None, True
                        continue
                out.eras.append(era)
                try:
                    await replay(c, server, out)
                except Exception as e:  # noqa: BLE001 - a dead connection fails this conversation, not the run
                    out.failures.append(f"[{era}] connection failed: {type(e).__name__}: {e}\n{server.log_tail()}")
                    out.broken_connection = True
                if out.broken_connection:
                    await server.stop()
                    server = None
                    out.broken_connection = False
                out.wall_s += time.perf_counter() - t0
            if server is not None:
                await server.stop()
    return [outcomes[c["id"]] for c in convs]


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals", description=__doc__.splitlines()[0])
    ap.add_argument("-k", dest="pattern", default=None, help="only conversations whose id contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every passed check too")
    ap.add_argument("--era", choices=ERAS, action="append", help="only this protocol era (repeatable)")
    ap.add_argument("--quick", action="store_true", help="skip the conversations that launch torchrun "
                    "(a successful bench or whitebox_compare); for editing evals, not for CI")
    ap.add_argument("--server-command", default=None,
                    help="command line that starts the stdio server (default: curry-train mcp)")
    ap.add_argument("--no-live", action="store_true", help="do not try the live mode (a real model answers the "
                    "same conversations; it runs only with ANTHROPIC_API_KEY and the anthropic package: evals/live.py)")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    router = Router()
    skills = {s.name for s in router.skills}
    convs, schema_failures = [], []
    for p in sorted(CONVERSATIONS_DIR.glob("*.yaml")):
        try:
            c = yaml.safe_load(p.read_text(encoding="utf-8"))
            validate_conversation(c, p.stem, skills)
        except (SchemaError, yaml.YAMLError) as e:
            schema_failures.append((p.stem, str(e)))
            continue
        if a.pattern is not None and a.pattern not in c["id"]:
            continue
        if a.quick and launches(c):
            continue
        convs.append(c)
    command = shlex.split(a.server_command) if a.server_command else default_server_command()
    if "/" in command[0] and not Path(command[0]).is_absolute():  # the server starts in the temp project
        command[0] = str(Path(command[0]).absolute())  # not resolve(): a venv's python is a symlink
    outcomes = anyio.run(lambda: run_all(convs, command=command, router=router, eras=a.era or list(ERAS)))
    passed = failed = 0
    for stem, msg in schema_failures:
        failed += 1
        print(f"FAIL  {stem}: invalid conversation file: {msg}")
    for o in outcomes:
        if o.failures:
            failed += 1
            print(f"FAIL  {o.id}  ({'+'.join(o.eras) or 'no era'}, {_calls(o.calls)}, {o.wall_s:.1f}s)")
            for f in o.failures:
                print("        " + f.replace("\n", "\n        "))
        else:
            passed += 1
            print(f"PASS  {o.id}  ({'+'.join(o.eras)}, {_calls(o.calls)}, {o.wall_s:.1f}s)")
        if a.verbose:
            for line in o.checks:
                print("        ok " + line)
    print(f"# wall time {time.perf_counter() - t0:.1f}s, server: {' '.join(command)}")
    if not a.no_live:
        from .live import run_live

        run_live(convs, command=command)  # prints its own score, or why it is skipped; never changes the exit code
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0
