"""The eval conversations are well-formed data and every user message routes to its expected skill (no server).

    .venv/bin/pytest tests/test_evals_routing.py -q

`python -m evals` replays the conversations against the real server; this file is the fast half: the YAML schema
of every conversation, coverage of the stage-4 ladder, the BM25 skill-routing matcher, and the assertion engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from evals import checks, conversation, live, paths
from evals.routing import Router, Skill, stem, tokenize

FILES = sorted(conversation.CONVERSATIONS_DIR.glob("*.yaml"))
ROUTER = Router()
SKILLS = {s.name for s in ROUTER.skills}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_conversation_file_follows_the_schema(path: Path) -> None:
    conversation.validate_conversation(_load(path), path.stem, SKILLS)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_user_message_routes_to_the_expected_skill(path: Path) -> None:
    conv = _load(path)
    ranked = ROUTER.rank(conv["user"])
    assert ranked[0][0] == conv["skill"], (
        f"{conv['id']}: {conv['user']!r} selects {ranked[0][0]} over {conv['skill']} "
        f"(top 3: {ranked[:3]}); shared words with {conv['skill']}: {ROUTER.explain(conv['user'], conv['skill'])}")


def test_there_are_at_least_25_conversations_with_unique_ids() -> None:
    ids = [_load(p)["id"] for p in FILES]
    assert len(ids) >= 25
    assert len(set(ids)) == len(ids)


def test_conversations_cover_every_rung_anti_pattern_and_flow() -> None:
    covered = {t for p in FILES for t in _load(p)["covers"]}
    assert set(conversation.COVERAGE) - covered == set()


def test_every_skill_the_ladder_names_is_exercised() -> None:
    used = {_load(p)["skill"] for p in FILES}
    assert SKILLS - used == set(), "every skill should be the expected skill of at least one conversation"


def test_expensive_tools_stay_in_a_handful_of_conversations() -> None:
    heavy = [p.stem for p in FILES if conversation.launches(_load(p))]
    assert 1 <= len(heavy) <= 6, heavy
    for p in FILES:
        conv = _load(p)
        if conversation.launches(conv):
            assert len(conv.get("eras", conversation.ERAS)) == 1, f"{p.stem}: torchrun flows run in one era only"


def test_every_advisor_answer_is_checked_against_the_final_recommendation() -> None:
    for p in FILES:
        conv = _load(p)
        if any(c["tool"] == "recommend_next" and "expect" in c for c in conv["calls"]):
            assert "primitive" in conv["final"], f"{p.stem}: final.primitive missing"


# ----------------------------------------------------------------------------------------------- the matcher


def test_stemmer_merges_the_forms_users_write() -> None:
    assert stem("gpus") == stem("gpu")
    assert stem("benchmarking") == stem("benchmarks") == stem("benchmark")
    assert stem("parallelism") == stem("parallel")
    assert stem("measured") == stem("measure")
    assert stem("sequences") == stem("sequence")
    assert tokenize("ZeRO-3 OOMs on 8 GPUs") == ["zero", "3", "oom", "8", "gpu"]


def test_router_prefers_the_description_that_says_what_the_user_says() -> None:
    skills = [Skill("alpha-tool", "Shard the optimizer state. Use when the user asks which ZeRO stage to pick."),
              Skill("beta-tool", "Checkpoint activations. Use when the user asks about gradient checkpointing.")]
    assert Router(skills).route("which ZeRO stage do I need?") == "alpha-tool"
    assert Router(skills).route("should I turn on gradient checkpointing") == "beta-tool"


def test_router_fails_when_a_description_stops_mentioning_the_users_words() -> None:
    keep = Skill("ckpt", "Activation recompute. Use when the user asks about gradient checkpointing.")
    other = Skill("shard", "Shard gradients and optimizer state across ranks. Use for memory problems.")
    message = "should I use gradient checkpointing to save memory?"
    assert Router([keep, other]).route(message) == "ckpt"
    dropped = Skill("ckpt", "Activation recompute, full or selective.")
    assert Router([dropped, other]).route(message) == "shard"


def test_routing_is_deterministic() -> None:
    msg = "my 8B model runs out of memory with DDP on 8 GPUs"
    assert Router().rank(msg) == Router().rank(msg)


# ----------------------------------------------------------------------------------------------- assertions

RESULT = {
    "primitive": "zero2",
    "config_patch": {"parallel.zero": 2},
    "rungs": [{"primitive": "dp"}, {"primitive": "zero3"}, {"primitive": "recompute"}, {"primitive": "tp"}],
    "memory": {"params": 10, "grads": 20, "total": 100},
    "param_count": 15,
    "ok": True,
    "reason": "ZeRO-2 fits: 41 GiB of 74 GiB usable",
}


@pytest.mark.parametrize(("assertion", "holds"), [
    ({"path": "primitive", "equals": "zero2"}, True),
    ({"path": "primitive", "in": ["zero1", "zero2", "zero3"]}, True),
    ({"path": "primitive", "not_in": ["tp", "pp"]}, True),
    ({"path": "config_patch[parallel.zero]", "equals": 2}, True),
    ({"path": "config_patch['parallel.zero']", "le": 1}, False),
    ({"path": "rungs[-1].primitive", "equals": "tp"}, True),
    ({"path": "rungs[*].primitive", "contains": "recompute"}, True),
    ({"path": "rungs[*].primitive", "ordered_as": ["dp", "zero3", "recompute", "tp", "pp"]}, True),
    ({"path": "rungs[*].primitive", "ordered_as": ["tp", "zero3"]}, False),
    ({"path": "rungs[*].primitive", "all_in": ["dp", "zero3", "recompute", "tp"]}, True),
    ({"path": "rungs[*].primitive", "all_in": ["dp", "zero3"]}, False),
    ({"path": "rungs", "contains": {"primitive": "zero3"}}, True),
    ({"path": "reason", "icontains": "zero-2"}, True),
    ({"path": "reason", "matches": r"\d+ GiB"}, True),
    ({"path": "ok", "equals": 1}, False),
    ({"path": "missing", "exists": False}, True),
    ({"path": "missing", "equals": None}, False),
    ({"expr": "({memory.params} + {memory.grads}) / {param_count}", "approx": {"value": 2.0, "rel": 0.01}}, True),
    ({"expr": "{memory.total} / {param_count}", "gt": 10}, False),
])
def test_assertion_operators(assertion: dict, holds: bool) -> None:
    assert (checks.check(assertion, RESULT, {}) is None) is holds


def test_references_to_earlier_results_keep_their_type() -> None:
    saved = {"a": {"run_id": "bench-1", "peak": 5}}
    assert paths.substitute({"run_a": "${a.run_id}", "n": "${a.peak}", "s": "x-${a.peak}"}, saved) == \
        {"run_a": "bench-1", "n": 5, "s": "x-5"}
    assert checks.check({"path": "memory.total", "gt": "${a.peak}"}, RESULT, saved) is None


def test_spread_applies_an_earlier_patch_over_the_starting_layout() -> None:
    saved = {"rec": {"config_patch": {"parallel.zero": 2}}}
    args = {"overrides": {"parallel.dp": 8, "parallel.zero": 0, "...": "${rec.config_patch}"}}
    assert paths.substitute(args, saved) == {"overrides": {"parallel.dp": 8, "parallel.zero": 2}}


def test_a_filter_picks_the_record_by_field() -> None:
    rows = {"rungs": [{"rung": "single", "m": None}, {"rung": "zero3+recompute", "m": 3}]}
    assert checks.check({"path": "rungs[rung=zero3+recompute].m", "ge": 1}, rows, {}) is None
    assert checks.check({"path": "rungs[rung=single].m", "equals": None}, rows, {}) is None
    assert checks.check({"path": "rungs[rung=tp8].m", "exists": False}, rows, {}) is None


def test_expr_refuses_anything_but_arithmetic() -> None:
    reason = checks.check({"expr": "__import__('os').getpid()", "gt": 0}, RESULT, {})
    assert reason is not None and "only arithmetic" in reason


@pytest.mark.parametrize(("bad", "says"), [
    ({"tool": "nope", "expect": [{"path": "x", "equals": 1}]}, "tool 'nope'"),
    ({"tool": "bench", "args": {"cfg": "tiny"}, "expect": [{"path": "x", "equals": 1}]}, "bench takes"),
    ({"tool": "bench", "args": {"config": "tiny"}, "expect": [{"path": "x", "roughly": 1}]}, "exactly one operator"),
    ({"tool": "bench", "args": {"config": "tiny"}}, "exactly one of expect"),
    ({"tool": "runs_diff", "args": {"run_a": "${a.run_id}", "run_b": "x"}, "error": ["no run"]}, "no earlier call"),
    ({"tool": "plan", "args": {"model": "tiny"}, "expect": [{"path": "gpus", "gt": "7.5e9"}]}, "needs a number"),
])
def test_schema_names_what_is_wrong(bad: dict, says: str) -> None:
    conv = {"id": "x", "user": "a message of several words", "skill": "bench", "covers": ["bench"],
            "calls": [bad], "final": {"answer": "a", "mentions": ["a"]}}
    with pytest.raises(conversation.SchemaError) as e:
        conversation.validate_conversation(conv, "x", SKILLS)
    assert says in str(e.value)


def test_live_mode_says_why_it_is_skipped(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert live.run_live([], command=["true"]) is None
    assert "live mode skipped: ANTHROPIC_API_KEY is not set" in capsys.readouterr().out


def test_live_scoring_needs_one_expected_mention() -> None:
    final = {"answer": "x", "mentions": ["ZeRO-2", "zero=2"]}
    assert live.score("Use zero-2: it fits in 41 GiB.", final) == (True, ["ZeRO-2"])
    assert live.score("Add tensor parallelism.", final) == (False, [])
