"""The skills' content: the stage-4 skill keeps every decision of the guide, and each primitive skill has its parts.

    .venv/bin/pytest tests/test_skills*.py -q

Checks read numbers, tool calls, rule names and config keys against the code they quote (rules/, the planner's
climb, the config schema); the decisions with nothing to check them by are key terms per section, not sentences,
so rewording passes and dropping a decision fails.
"""

from __future__ import annotations

import re

import pytest
import yaml
from skills_support import (
    EXPECTED_SKILLS,
    SKILLS_DIR,
    repo_paths,
    split_front_matter,
    tool_calls,
)

STAGE4 = SKILLS_DIR / "stage4-parallel-primitive-intro" / "SKILL.md"

# The rungs of the decision guide (the product spec the stage-4 skill was written from), in climbing order.
LADDER = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "recompute", "TP", "PP", "EP", "CP")

# Decisions of the guide with no number or tool to check them by: each is the terms that must all appear in one
# section of the skill (case-insensitive, any wording around them), so a rewrite keeps the decision or fails here.
DECISION_TERMS = {
    "the stage question": ("The stage question", ("memory", "throughput", "both")),
    "DP + FSDP solves most problems; nothing heavier preemptively": (
        "The ladder", ("FSDP", "most problems", "preemptively")),
    "a single-GPU baseline with a finite loss first": ("Step 1", ("finite loss", "loss_finite")),
    "single-GPU OOM: recompute before any parallelism": ("Step 1", ("out of memory", "recompute", "before")),
    "ZeRO-1/2 for moderate models, ZeRO-3 when states do not fit": (
        "Step 2", ("SHARD_GRAD_OP", "moderate", "FULL_SHARD", "does not fit")),
    "TP when a single matmul is the bottleneck": ("Step 3", ("matmul", "bottleneck")),
    "PP when too deep for a node": ("Step 4", ("too deep", "one node")),
    "PP schedules have bubbles": ("Step 4", ("1F1B", "interleaved", "bubble")),
    "EP is all-to-all and mandatory at scale": ("Step 5", ("MoE", "all-to-all", "mandatory at scale")),
    "CP needs ring attention": ("Step 6", ("ring attention",)),
    "most parallel bugs are silently wrong gradients": ("Procedure", ("silently wrong gradients",)),
    "boundary: what/when here, how in the primitive skills": ("Boundaries", ("*what*", "*when*", "*how*")),
    "boundary: multi-node operations out of V1 scope": ("Boundaries", ("V1 scope", "torchrun")),
}


def _section(text: str, heading: str) -> str:
    """The body under the first markdown heading that starts with `heading`, up to the next heading of its level."""
    m = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.MULTILINE)
    assert m, f"the stage-4 skill has no section {heading!r}"
    level = len(m.group(1))
    rest = text[m.end():]
    nxt = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: nxt.start()] if nxt else rest


@pytest.mark.parametrize("decision", sorted(DECISION_TERMS))
def test_stage4_skill_keeps_every_decision_of_the_guide(decision):
    heading, terms = DECISION_TERMS[decision]
    body = " ".join(_section(STAGE4.read_text(encoding="utf-8"), heading).split()).lower()
    missing = [t for t in terms if t.lower() not in body]
    assert not missing, f"{decision}: section {heading!r} lost {missing}"


def test_the_ladder_is_the_guides_order_with_the_keys_the_planner_climbs():
    from curry_train.advice.planner import _ADDS
    from curry_train.config import Config

    block = re.search(r"```\n(DP .*?)```", _section(STAGE4.read_text(encoding="utf-8"), "The ladder"), re.DOTALL)
    assert block, "the ladder section has no rung diagram"
    lines = block.group(1).strip().splitlines()
    assert len(lines) == len(LADDER) and all(rung in ln for rung, ln in zip(LADDER, lines, strict=True)), lines
    keys = [re.findall(r"parallel\.(\w+)", ln) for ln in lines]
    fields = set(Config.model_fields["parallel"].annotation.model_fields)
    assert all(k in fields for ks in keys for k in ks), keys
    # the planner's climb adds the same primitives in the same order as the diagram's keys
    first_key = list(dict.fromkeys(ks[0] for ks in keys if ks))  # one entry per key, in the diagram's order
    climbed = [ks[0] for _, ks in _ADDS]
    assert [k for k in first_key if k in climbed] == [k for k in climbed if k in first_key], (first_key, climbed)


def test_every_anti_pattern_rule_is_named_in_the_skill_and_its_numbers_are_the_rules():
    from curry_train.rules import ANTI_PATTERN_RULES, LONG_CONTEXT, WITHIN

    text = STAGE4.read_text(encoding="utf-8")
    bullets = set(re.findall(r"^- \*\*(.+?)\.?\*\*", _section(text, "Anti-patterns"), re.MULTILINE))
    titles = {r.title for r in ANTI_PATTERN_RULES}
    assert titles <= bullets, f"rules the skill does not name: {sorted(titles - bullets)}"
    assert bullets - titles <= {"EP without TP"}, f"skill anti-patterns no rule checks: {sorted(bullets - titles)}"
    assert f"{LONG_CONTEXT // 1024}k tokens" in " ".join(text.split()), "CP's threshold is rules.LONG_CONTEXT"
    assert f"within {WITHIN:.0%} of the step time" in " ".join(text.split()), "the 'fits alone' margin is rules.WITHIN"


def test_the_procedure_calls_the_tools_in_the_order_of_its_steps():
    body = _section(STAGE4.read_text(encoding="utf-8"), "Procedure")
    steps = re.split(r"^\d\. ", body, flags=re.MULTILINE)[1:]
    assert len(steps) == 5, "the procedure has five steps"
    wanted = (("capacity_sweep",), ("recommend_next", "estimate_memory"), ("runs_diff",),
              ("whitebox_compare",), ("update_config",))
    for i, (step, tools) in enumerate(zip(steps, wanted, strict=True), 1):
        calls = [c.name for c in tool_calls(f"procedure step {i}", step)]
        assert all(t in calls for t in tools), f"step {i} should call {tools}, calls {calls}"
    # the symptom map: each symptom names the rung the ladder gives it
    pairs = re.findall(r"^\s+- (.+?) → (.+)$", steps[1], re.MULTILINE)
    got = {a.strip(): b for a, b in pairs}
    assert [k for k in got] == ["OOM on a single GPU", "OOM with full FSDP (ZeRO-3)", "Slow across multiple nodes",
                                "MoE-specific routing cost or expert memory", "Long context"], list(got)
    for symptom, rung in zip(got, ("recompute", "TP", "PP", "EP", "CP"), strict=True):
        assert got[symptom].startswith(rung), (symptom, got[symptom])


def test_stage4_description_carries_the_seed_triggers():
    block, _ = split_front_matter(STAGE4.read_text(encoding="utf-8"))
    desc = yaml.safe_load(block)["description"]
    for trigger in (
        "do I need tensor parallelism",
        "OOM at scale",
        "training too slow",
        "should I add pipeline parallel",
        "how to scale beyond N GPUs",
        "stage4-capacity-sweep",
    ):
        assert trigger in desc, trigger


PRIMITIVE_SECTIONS = (
    "## When it helps",
    "## When it does not",
    "## How the template implements it",
    "## Apply it",
    "## Failure modes",
)


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED_SKILLS if n.startswith("primitive-")))
def test_primitive_skill_has_when_how_apply_validate_and_failure_modes(name):
    d = SKILLS_DIR / name
    text = (d / "SKILL.md").read_text(encoding="utf-8")
    if name != "primitive-topk-router":  # the router is tuned, not "added": its sections are named for that
        missing = [s for s in PRIMITIVE_SECTIONS if s not in text]
        assert not missing, f"missing sections {missing}"
    else:
        for s in ("## How the template implements it", "## Apply and validate a change", "## Failure modes"):
            assert s in text, s
    calls = {c.name for c in tool_calls(name, text)}
    for tool in ("bench", "whitebox_compare", "runs_diff", "update_config"):
        assert tool in calls, f"{name} never shows a {tool}(...) call"
    assert any(p.startswith("template/curry_train/") for p in repo_paths(text)), "name the template file"
    assert re.search(r"curry-train \w+ --config configs/", text), "show the CLI equivalent"
    if name == "primitive-topk-router":  # no tracker issue is specific to it: cite the papers it implements
        assert all(p in text for p in ("Switch", "GShard", "ST-MoE")), "cite the router's papers"
    else:
        assert re.search(r"#\d+", text), "failure modes cite what users hit (issue numbers)"
