"""Shared by the skill-pack tests (tests/test_skills*.py): the contract the skills are checked against, the Agent
Skills front-matter validator, the extraction of tool calls, paths, config keys and CLI examples from the Markdown,
and the resolution of the configs those examples name. Helpers only: the tests live in the test files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml
from curry_train import config as C

ROOT = Path(__file__).resolve().parents[1]
SKILLS_DIR = ROOT / "skills"

EXPECTED_SKILLS = {
    "stage4-parallel-primitive-intro",
    "stage4-capacity-sweep",
    "bench",
    "whitebox-validation",
    "primitive-recompute",
    "primitive-distributed-optimizer",
    "primitive-tp-linear",
    "primitive-pipeline-schedule",
    "primitive-experts",
    "primitive-topk-router",
    "primitive-context-parallel",
}

# The tool contract (docs/CONTRACTS.md): name -> (accepted arguments, required arguments). `capacity_sweep(config, ...)`
# takes more arguments than the contract fixes, so only `config` is known here; the live-server test checks the
# rest against the registered input schema.
TOOLS: dict[str, tuple[set[str] | None, set[str]]] = {
    "probe_hardware": ({"measure"}, set()),
    "bench": ({"config", "steps", "warmup", "overrides"}, {"config"}),
    "whitebox_compare": ({"config", "steps", "overrides", "inject"}, {"config"}),
    "update_config": ({"name", "changes", "base"}, {"name", "changes"}),
    "runs_diff": ({"run_a", "run_b"}, {"run_a", "run_b"}),
    "estimate_memory": ({"config", "overrides"}, {"config"}),
    "recommend_next": ({"config", "symptom", "overrides"}, {"config"}),
    "plan": ({"model", "gpus_per_node", "nodes", "gpu_memory_gib", "seq_len", "global_batch"}, {"model"}),
    "capacity_sweep": (None, {"config"}),
    "climb": ({"config", "memory_budget", "overrides", "name", "steps", "max_rungs", "keep_checkpoints"},
              {"config", "memory_budget"}),
    "import_hf_config": ({"path_or_json", "name", "accept", "seq_len"}, {"path_or_json", "name"}),
    "export_layout": ({"config", "framework", "overrides"}, {"config", "framework"}),
}
CONFIG_TOOLS = {"bench", "whitebox_compare", "estimate_memory", "recommend_next", "capacity_sweep"}
SYMPTOMS = {"oom", "slow", "none", None}
CONFIG_NAMES = {"tiny", "tiny-moe", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "mixtral-8x7b"}
CLI_COMMANDS = {
    "train",
    "whitebox",
    "runs",
    "bench",
    "estimate",
    "recommend",
    "plan",
    "sweep",
    "climb",
    "mcp",
    "install-skills",
    "import-hf",
    "export",
}

# Entry points the skills name, and the template file that must define each (the planned layout).
SYMBOL_FILES = {
    "apply_ddp": "parallel/ddp.py",
    "build_zero1_optimizer": "parallel/zero.py",
    "apply_fsdp": "parallel/fsdp.py",
    "apply_recompute": "parallel/recompute.py",
    "apply_tp": "parallel/tensor_parallel.py",
    "apply_pp": "parallel/pipeline.py",
    "apply_ep": "parallel/expert_parallel.py",
    "apply_cp": "parallel/context_parallel.py",
    "parallelize": "parallel/parallelize.py",
    "TopKRouter": "model/moe.py",
    "Experts": "model/experts.py",
    "expert_load": "model/moe.py",
    "attention_work": "parallel/context_parallel.py",
}

# ---------------------------------------------------------------------------------------------------------------
# Agent Skills front-matter validator (agentskills.io/specification; anthropics/skills quick_validate.py)

ALLOWED_KEYS = {"name", "description", "license", "allowed-tools", "metadata", "compatibility"}
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
MAX_NAME, MAX_DESCRIPTION, MAX_COMPATIBILITY, MAX_BODY_LINES = 64, 1024, 500, 500


def split_front_matter(text: str) -> tuple[str, str]:
    """(front-matter block, body); raises ValueError when the file does not open with a `---` block."""
    if not text.startswith("---\n"):
        raise ValueError("SKILL.md must start with a '---' front-matter line")
    end = text.find("\n---\n", 3)
    if end < 0:
        raise ValueError("front matter is not closed by a '---' line")
    return text[4:end], text[end + 5 :]


def validate_skill_dir(skill_dir: Path) -> list[str]:
    """Every spec violation of one skill folder; an empty list means valid."""
    md = skill_dir / "SKILL.md"
    if not md.is_file():
        return [f"{skill_dir.name}: missing SKILL.md"]
    try:
        block, body = split_front_matter(md.read_text(encoding="utf-8"))
        meta = yaml.safe_load(block)
    except (ValueError, yaml.YAMLError) as e:
        return [f"{skill_dir.name}: {e}"]
    if not isinstance(meta, dict):
        return [f"{skill_dir.name}: front matter is not a mapping"]
    errors = []
    extra = set(meta) - ALLOWED_KEYS
    if extra:
        errors.append(f"unexpected front-matter keys {sorted(extra)}; allowed {sorted(ALLOWED_KEYS)}")
    name, desc = meta.get("name"), meta.get("description")
    if not isinstance(name, str) or not name:
        errors.append("'name' must be a non-empty string")
    else:
        if len(name) > MAX_NAME:
            errors.append(f"name is {len(name)} chars (max {MAX_NAME})")
        if not NAME_RE.match(name):
            errors.append(f"name {name!r} is not lowercase kebab-case ([a-z0-9], single hyphens, none at the ends)")
        if name != skill_dir.name:
            errors.append(f"name {name!r} differs from its folder {skill_dir.name!r}")
    if not isinstance(desc, str) or not desc.strip():
        errors.append("'description' must be a non-empty string")
    else:
        if len(desc) > MAX_DESCRIPTION:
            errors.append(f"description is {len(desc)} chars (max {MAX_DESCRIPTION})")
        if "<" in desc or ">" in desc:
            errors.append("description must not contain '<' or '>'")
    if "compatibility" in meta and (
        not isinstance(meta["compatibility"], str) or not 1 <= len(meta["compatibility"]) <= MAX_COMPATIBILITY
    ):
        errors.append(f"compatibility must be a string of 1-{MAX_COMPATIBILITY} chars")
    if "metadata" in meta and not (
        isinstance(meta["metadata"], dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta["metadata"].items())
    ):
        errors.append("metadata must map strings to strings")
    for key in ("license", "allowed-tools"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f"{key} must be a string")
    if not body.strip():
        errors.append("the body is empty")
    if len(body.splitlines()) >= MAX_BODY_LINES:
        errors.append(
            f"body has {len(body.splitlines())} lines (keep it under {MAX_BODY_LINES}; move detail to references/)"
        )
    return [f"{skill_dir.name}: {e}" for e in errors]


# ---------------------------------------------------------------------------------------------------------------
# Extraction from the Markdown

FENCE_RE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
SPAN_RE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
CALL_START_RE = re.compile(r"^([a-z_][a-z0-9_]*)\(")
PATH_RE = re.compile(r"(?<![\w./-])((?:template/curry_train|configs|benchmarks|mcp_server)/[\w./-]*\w)")
KEY_RE = re.compile(r"(?<![\w./-])(model|train|parallel|hardware)\.([a-z_]+)\b(?!\.\w)")
FILE_EXTENSIONS = {"py", "yaml", "md", "json"}


def skill_dirs() -> list[Path]:
    return sorted(p for p in SKILLS_DIR.iterdir() if p.is_dir()) if SKILLS_DIR.is_dir() else []


def skill_texts(skill_dir: Path) -> dict[str, str]:
    """`<skill>/<relative file>` -> text, for SKILL.md and every Markdown file below the skill."""
    return {
        f"{skill_dir.name}/{p.relative_to(skill_dir).as_posix()}": p.read_text(encoding="utf-8")
        for p in sorted(skill_dir.rglob("*.md"))
    }


def all_texts() -> dict[str, str]:
    out: dict[str, str] = {}
    for d in skill_dirs():
        out.update(skill_texts(d))
    return out


def code_snippets(text: str) -> list[str]:
    """Each line of a fenced block, and each inline code span (line breaks inside a span become spaces)."""
    snippets = [ln.strip() for block in FENCE_RE.findall(text) for ln in block.splitlines() if ln.strip()]
    prose = FENCE_RE.sub("", text)
    snippets += [" ".join(s.split()) for s in SPAN_RE.findall(prose)]
    return snippets


def _jsonish(src: str) -> str:
    """Tool calls are written with JSON literals (true/false/null); make them Python literals."""
    for a, b in (("true", "True"), ("false", "False"), ("null", "None")):
        src = re.sub(rf"(?<![\w\"']){a}(?![\w\"'])", b, src)
    return src


class ToolCall:
    def __init__(self, where: str, src: str):
        self.where, self.src = where, src
        self.name = CALL_START_RE.match(src).group(1)
        self.kwargs: dict = {}
        self.error: str | None = None
        try:
            node = ast.parse(_jsonish(src), mode="eval").body
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                raise TypeError("not a single call expression")
            if node.args:
                raise ValueError("pass every argument by keyword (argument names are the contract)")
            for kw in node.keywords:
                if kw.arg is None:
                    raise ValueError("no **kwargs")
                self.kwargs[kw.arg] = ast.literal_eval(kw.value)
        except (SyntaxError, TypeError, ValueError) as e:
            self.error = str(e)

    def __repr__(self) -> str:
        return f"{self.where}: {self.src}"


def tool_calls(where: str, text: str) -> list[ToolCall]:
    return [ToolCall(where, s) for s in code_snippets(text) if CALL_START_RE.match(s)]


def tools_line_names(text: str) -> list[str]:
    """Names on `**Tools:**` lines (a line and its continuation up to the next blank line)."""
    names = []
    for m in re.finditer(r"^\*\*Tools:\*\*(.*?)(?:\n\s*\n|\Z)", text, re.DOTALL | re.MULTILINE):
        names += re.findall(r"`([a-z_][a-z0-9_]*)`", m.group(1))
    return names


def repo_paths(text: str) -> set[str]:
    return {p.rstrip(".") for p in PATH_RE.findall(text)}


def dotted_keys(text: str) -> set[str]:
    return {f"{s}.{f}" for s, f in KEY_RE.findall(text) if f not in FILE_EXTENSIONS}


def cli_examples(where: str, text: str) -> list[tuple[str, str]]:
    return [(where, s) for s in code_snippets(text) if s.startswith("curry-train ")]


def all_calls() -> list[ToolCall]:
    return [c for where, text in all_texts().items() for c in tool_calls(where, text)]


# ---------------------------------------------------------------------------------------------------------------
# Config resolution for examples


def config_file(name: str) -> Path:
    return ROOT / "configs" / f"{name}.yaml"


def defined_configs(skill_dir: Path) -> dict[str, tuple[str | None, dict]]:
    """Configs a skill creates with update_config: name -> (base, changes)."""
    out = {}
    for where, text in skill_texts(skill_dir).items():
        for c in tool_calls(where, text):
            if c.name == "update_config" and not c.error and isinstance(c.kwargs.get("name"), str):
                out[c.kwargs["name"]] = (c.kwargs.get("base"), c.kwargs.get("changes") or {})
    return out


def raw_config(name: str, defined: dict[str, tuple[str | None, dict]], depth: int = 0) -> dict:
    """The raw dict of a preset, or of a config the same skill writes with update_config (base + changes)."""
    if name in defined and depth < 5:
        base, changes = defined[name]
        return C.apply_overrides(raw_config(base or "tiny", defined, depth + 1), changes)
    path = config_file(name)
    if not path.is_file():
        raise FileNotFoundError(f"configs/{name}.yaml does not exist")
    return C.load_yaml(path)


def known_config(name: object, defined: dict) -> bool:
    return isinstance(name, str) and (name in CONFIG_NAMES or name in defined)
