"""The eval conversations: loading, the schema check, and what the set as a whole must cover (COVERAGE).

One conversation is one file evals/conversations/<id>.yaml; its schema is documented in evals/README.md and
enforced by `validate_conversation`, which raises SchemaError naming the first thing wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from .checks import OPERATORS, TYPES
from .paths import BRACED, REF, parse_path, refs

CONVERSATIONS_DIR = Path(__file__).resolve().parent / "conversations"

TOOLS = {
    "probe_hardware": {"measure"},
    "bench": {"config", "steps", "warmup", "overrides"},
    "whitebox_compare": {"config", "steps", "overrides", "inject"},
    "update_config": {"name", "changes", "base"},
    "runs_diff": {"run_a", "run_b"},
    "estimate_memory": {"config", "overrides", "gpu"},
    "recommend_next": {"config", "symptom", "overrides", "gpu"},
    "plan": {"model", "gpus_per_node", "nodes", "gpu_memory_gib", "seq_len", "global_batch", "gpu"},
    "capacity_sweep": None,  # config plus sweep options; checked against the live input schema instead
}
EXPENSIVE = {"bench", "whitebox_compare"}  # torchrun launches: a handful of conversations only
PRIMITIVES = ("none", "recompute", "zero", "zero1", "zero2", "zero3", "hsdp", "tp", "pp", "ep", "cp", "dp",
              "micro_batch")
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
    "remove-unneeded-primitive": "a primitive in place that its own estimate shows unnecessary is removed",
    "idle-gpus": "GPUs left idle: use them, or say why they must idle",
    "pp-bubble": "a bubble-bound pipeline: schedule, virtual stages, more micro-batches",
    "hsdp": "FSDP across nodes: HSDP (parallel.dp_replicate) proposed with its patch and estimate",
    "long-context-cp": "long context where CP beats TP+SP by step time",
    "oom-micro-batch": "an OOM where halving the micro-batch is the alternative",
    "more-gpus-how-many": "more GPUs, with how many",
    "one-gpu-beyond": "nothing fits on the user's one GPU: what fits, and LoRA/QLoRA/8-bit/offload with their memory",
}
CONVERSATION_KEYS = {"id", "user", "skill", "covers", "eras", "calls", "final", "notes"}
CALL_KEYS = {"tool", "args", "as", "expect", "error", "timeout_s", "why"}
FINAL_KEYS = {"answer", "primitive", "mentions"}


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
                    for p in [a["path"]] if "path" in a else [m.group(1) for m in BRACED.finditer(a["expr"])]:
                        parse_path(p.strip())
                except (ValueError, TypeError) as e:
                    raise SchemaError(f"{stem}: {where}.expect[{j}]: {e}") from None
                if "type" in a:
                    need(a["type"] in TYPES, f"{where}.expect[{j}]: type one of {sorted(TYPES)}")
                for op in ops & {"gt", "ge", "lt", "le"}:  # YAML reads 7.5e9 as a string: write 7.5e+9
                    v = a[op]
                    need((isinstance(v, (int, float)) and not isinstance(v, bool)) or
                         (isinstance(v, str) and REF.fullmatch(v) is not None),
                         f"{where}.expect[{j}]: {op} needs a number or a ${{ref}}, got {v!r}")
        for ref in refs(args):
            need(ref in names, f"{where}: ${{{ref}...}} refers to no earlier call saved with `as: {ref}`")
        if "as" in call:
            need(isinstance(call["as"], str) and call["as"].isidentifier(), f"{where}: as must be an identifier")
            names.add(call["as"])
        for ref in refs(call.get("expect", [])):  # expectations may also use this call's own result
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
