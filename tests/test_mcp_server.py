"""The MCP server through the in-memory client, in both protocol eras: tools, errors, resources, prompt, skills.

    .venv/bin/pytest tests/test_mcp_server.py -q

Every test runs against a throwaway project (CURRY_TRAIN_ROOT -> a copy of configs/), so nothing here writes into
the checkout. Only the cancellation test launches ranks.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any, Literal

import anyio
import pytest
from curry_train.breakdown import CATEGORIES
from curry_train.config import load_config
from curry_train.store.runs import Ledger
from curry_train_mcp.jobs import alive, descendants
from curry_train_mcp.server import SKILLS_DIR, WhiteboxVerdict, mcp
from mcp import Client
from mcp.types import PaginatedRequestParams, Request
from pydantic import BaseModel, ConfigDict

NINE = {"probe_hardware", "bench", "whitebox_compare", "update_config", "runs_diff", "estimate_memory",
        "recommend_next", "plan", "capacity_sweep"}
STAGE4 = "skill://stage4-parallel-primitive-intro/SKILL.md"


@pytest.fixture(autouse=True)
def _project_root(project, monkeypatch):
    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))
    return project


@pytest.fixture(params=["auto", "legacy"])
async def client(request):
    async with Client(mcp, mode=request.param, raise_exceptions=True) as c:
        yield c


def _text(result) -> str:
    return "\n".join(b.text for b in result.content if b.type == "text")


# ------------------------------------------------------------------------------------------ tools/list


@pytest.mark.anyio
async def test_lists_the_nine_contract_tools_each_with_an_output_schema_and_annotations(client):
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert NINE <= set(tools), f"missing: {sorted(NINE - set(tools))}"
    for name in NINE:
        t = tools[name]
        assert t.output_schema and t.output_schema.get("type") == "object", name
        assert t.annotations is not None and t.annotations.read_only_hint is not None, name
        assert t.description and len(t.description) > 40, name
        for arg, schema in t.input_schema.get("properties", {}).items():
            assert schema.get("description"), f"{name}.{arg} has no description"


@pytest.mark.anyio
async def test_contract_argument_names_and_defaults(client):
    tools = {t.name: t.input_schema for t in (await client.list_tools()).tools}
    props = {n: s["properties"] for n, s in tools.items()}
    assert props["probe_hardware"]["measure"]["default"] is False
    assert {k: props["bench"][k]["default"] for k in ("steps", "warmup", "overrides")} == \
        {"steps": 5, "warmup": 1, "overrides": {}}
    assert props["whitebox_compare"]["steps"]["default"] is None  # validation/horizon.py default_steps
    assert props["whitebox_compare"]["inject"]["default"] is None
    assert props["whitebox_compare"]["resume_from_layout"]["default"] is None  # validation/resume.py
    assert tools["update_config"]["required"] == ["name", "changes"]
    assert set(tools["runs_diff"]["required"]) == {"run_a", "run_b"}
    assert tools["bench"]["required"] == ["config"]
    assert tools["update_config"]["properties"]["base"]["default"] is None


# ------------------------------------------------------------------------------------------ update_config


@pytest.mark.anyio
async def test_update_config_writes_validated_yaml_and_returns_the_diff(client, project):
    r = await client.call_tool("update_config", {"name": "tiny-dp2", "changes": {"parallel.dp": 2}, "base": "tiny"})
    assert not r.is_error, _text(r)
    out = r.structured_content
    assert out["created"] and out["diff"] == [{"key": "parallel.dp", "old": 1, "new": 2}]
    assert out["config"]["parallel"]["dp"] == 2
    assert load_config(project / "configs" / "local" / "tiny-dp2.yaml").parallel.dp == 2
    assert json.loads(_text(r)) == out  # the text block carries the same JSON for clients without structured output


@pytest.mark.anyio
async def test_invalid_update_names_each_field_and_writes_nothing(client, project):
    before = (project / "configs" / "tiny.yaml").read_bytes()
    r = await client.call_tool("update_config", {"name": "tiny", "changes": {"parallel.tp": 3}})
    assert r.is_error
    text = _text(r)
    assert "model.n_heads" in text and "parallel.tp" in text and "Fix" in text
    assert (project / "configs" / "tiny.yaml").read_bytes() == before
    assert not (project / "configs" / "local" / ".history" / "tiny").exists()


@pytest.mark.anyio
async def test_creating_a_config_without_base_says_to_pass_one(client):
    r = await client.call_tool("update_config", {"name": "brand-new", "changes": {"parallel.dp": 2}})
    assert r.is_error and "base" in _text(r) and "tiny" in _text(r)


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["../etc/passwd", "/etc/passwd", "a/b", "con"])
async def test_config_names_that_are_paths_are_refused(client, bad):
    r = await client.call_tool("update_config", {"name": bad, "changes": {}, "base": "tiny"})
    assert r.is_error and ("not allowed" in _text(r) or "reserved" in _text(r))
    r = await client.call_tool("bench", {"config": bad})
    assert r.is_error


@pytest.mark.anyio
async def test_unknown_config_lists_the_available_ones(client):
    for tool in ("bench", "whitebox_compare"):
        r = await client.call_tool(tool, {"config": "nope"})
        assert r.is_error and "tiny" in _text(r) and "tiny-moe" in _text(r), _text(r)


@pytest.mark.anyio
async def test_whitebox_injection_that_cannot_apply_fails_before_any_process_starts(client, project):
    r = await client.call_tool("whitebox_compare", {"config": "tiny", "inject": "nope"})
    assert r.is_error and "data-same-rows" in _text(r) and "replica-lr" in _text(r), _text(r)
    r = await client.call_tool("whitebox_compare", {"config": "tiny", "inject": "ep-expert-unreduced",
                                                    "overrides": {"parallel.dp": 2}})
    assert r.is_error and "dense" in _text(r), _text(r)
    r = await client.call_tool("whitebox_compare", {"config": "tiny", "inject": "resume-drops-moments",
                                                    "overrides": {"parallel.tp": 2}})
    assert r.is_error and "--resume-from-layout" in _text(r), _text(r)  # a load bug needs a resume white-box
    assert not (project / "runs" / "ledger.sqlite3").exists()  # nothing recorded, nothing launched


@pytest.mark.anyio
async def test_invalid_overrides_fail_before_any_process_starts(client, project):
    r = await client.call_tool("bench", {"config": "tiny", "overrides": {"parallel.tp": 3}})
    assert r.is_error and "parallel.tp" in _text(r)
    r = await client.call_tool("bench", {"config": "tiny", "overrides": {"parallel.nope": 1}})
    assert r.is_error and "unknown field" in _text(r)
    assert not (project / "runs" / "ledger.sqlite3").exists()  # nothing recorded, nothing launched


# ------------------------------------------------------------------------------------------ runs_diff


@pytest.mark.anyio
async def test_runs_diff_reports_config_and_metric_changes(client, project):
    ledger = Ledger(project)
    a = ledger.start("bench", load_config(project / "configs/tiny.yaml"), "tiny")
    b = ledger.start("bench", load_config(project / "configs/tiny.yaml", {"parallel.dp": 2}), "tiny")
    ledger.finish(a.run_id, status="ok", metrics={"step_time_s": 0.2, "peak_memory_bytes": 100})
    ledger.finish(b.run_id, status="ok", metrics={"step_time_s": 0.1, "peak_memory_bytes": 50})
    r = await client.call_tool("runs_diff", {"run_a": a.run_id, "run_b": b.run_id})
    out = r.structured_content
    assert {"key": "parallel.dp", "a": 1, "b": 2} in out["config_changes"]
    assert {m["metric"]: m["ratio"] for m in out["metric_changes"]}["step_time_s"] == pytest.approx(0.5)
    assert "step time x0.50" in out["verdict"]
    run = json.loads((await client.read_resource(f"run://{a.run_id}")).contents[0].text)
    assert run["metrics"]["step_time_s"] == 0.2
    index = json.loads((await client.read_resource("run://index")).contents[0].text)
    assert {r["run_id"] for r in index} == {a.run_id, b.run_id}


@pytest.mark.anyio
async def test_runs_diff_of_an_unknown_run_says_where_to_find_runs(client):
    r = await client.call_tool("runs_diff", {"run_a": "bench-nope", "run_b": "bench-nope2"})
    assert r.is_error and "run://" in _text(r)
    r = await client.call_tool("runs_diff", {"run_a": "../../etc", "run_b": "x"})
    assert r.is_error and "not allowed" in _text(r)


# ------------------------------------------------------------------------------------------ resources, prompt


@pytest.mark.anyio
async def test_every_skill_is_a_listed_resource_including_the_stage4_skill(client):
    uris = {r.uri for r in (await client.list_resources()).resources}
    skills = {f"skill://{p.parent.name}/SKILL.md" for p in SKILLS_DIR.glob("*/SKILL.md")}
    assert STAGE4 in uris and skills <= uris
    text = (await client.read_resource(STAGE4)).contents[0].text
    assert text.startswith("---") and "name: stage4-parallel-primitive-intro" in text
    index = json.loads((await client.read_resource("skill://index")).contents[0].text)
    assert STAGE4 in {s["uri"] for s in index}


@pytest.mark.anyio
async def test_configs_are_resources_and_unknown_ones_are_named(client, project):
    uris = {r.uri for r in (await client.list_resources()).resources}
    assert {"config://index", "run://index"} <= uris
    text = (await client.read_resource("config://tiny")).contents[0].text
    assert "parallel:" in text
    names = {c["name"] for c in json.loads((await client.read_resource("config://index")).contents[0].text)}
    assert {"tiny", "tiny-moe"} <= names
    await client.call_tool("update_config", {"name": "fresh", "changes": {}, "base": "tiny"})
    assert "parallel:" in (await client.read_resource("config://fresh")).contents[0].text  # template covers new ones
    with pytest.raises(Exception, match="available"):
        await client.read_resource("config://nope")


@pytest.mark.anyio
async def test_diagnose_scaling_prompt_walks_the_procedure(client):
    prompts = {p.name for p in (await client.list_prompts()).prompts}
    assert "diagnose_scaling" in prompts
    msg = (await client.get_prompt("diagnose_scaling", {"config": "tiny", "symptom": "oom"})).messages[0]
    text = msg.content.text
    order = ["probe_hardware", "bench", "recommend_next", "update_config", "whitebox_compare", "runs_diff"]
    positions = [text.index(t) for t in order]
    assert positions == sorted(positions) and STAGE4 in text and 'symptom="oom"' in text


class _ListSkills(Request[PaginatedRequestParams | None, Literal["skills/list"]]):
    method: Literal["skills/list"] = "skills/list"
    params: PaginatedRequestParams | None = None


class _AnyResult(BaseModel):
    model_config = ConfigDict(extra="allow")


@pytest.mark.anyio
async def test_skills_extension_lists_every_skill_with_verifiable_digests():
    async with Client(mcp, raise_exceptions=True) as c:  # the extension is advertised in the 2026 era
        assert "io.modelcontextprotocol/skills" in (c.server_capabilities.extensions or {})
        res = await c.session.send_request(_ListSkills(params=PaginatedRequestParams()), _AnyResult)
        skills = {s["uri"]: s for s in res.model_extra["skills"]}
        assert STAGE4 in skills
        s = skills[STAGE4]
        assert s["frontmatter"]["name"] == "stage4-parallel-primitive-intro"
        for entry in s["resources"]:
            body = (await c.read_resource(entry["uri"])).contents[0].text.encode("utf-8")
            assert entry["digest"] == "sha256:" + hashlib.sha256(body).hexdigest(), entry["uri"]


def test_whitebox_tool_returns_the_foundation_verdict_model():
    from curry_train.validation.whitebox import Verdict

    assert Verdict is WhiteboxVerdict  # one model, defined torch-free in validation/verdict.py


def test_importing_the_server_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, curry_train_mcp.server; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------ cancellation


@pytest.mark.torchrun  # the worker kills torchrun's process group
@pytest.mark.multirank
@pytest.mark.anyio
async def test_cancelling_a_bench_kills_every_process_it_started(project):
    """Start a 2-rank bench, cancel it once the ranks run, then count: nothing the server started survives."""
    before = set(descendants(os.getpid()))
    seen: dict[int, int] = {}
    started = anyio.Event()
    messages: list[Any] = []

    async def progress(p: float, total: float | None, message: str | None) -> None:
        messages.append(message)

    async def watch() -> None:
        while True:  # the ranks exist once torchrun's children show up
            now = {p: s for p, s in descendants(os.getpid()).items() if p not in before}
            seen.update(now)
            if len(now) >= 4:  # worker, torchrun, 2 ranks
                started.set()
            await anyio.sleep(0.1)

    async with Client(mcp, raise_exceptions=True) as c, anyio.create_task_group() as tg:
        tg.start_soon(watch)

        async def call() -> None:
            await c.call_tool("bench", {"config": "tiny", "steps": 1000, "overrides": {"parallel.dp": 2}},
                              progress_callback=progress)

        with anyio.move_on_after(120) as scope:
            async with anyio.create_task_group() as inner:
                inner.start_soon(call)
                await started.wait()
                inner.cancel_scope.cancel()
        assert not scope.cancelled_caught, "the ranks never started"
        tg.cancel_scope.cancel()
    assert len(seen) >= 4
    with anyio.fail_after(30):
        while alive(seen):
            await anyio.sleep(0.1)
    assert not alive(seen)
    statuses = [r.status for r in Ledger(project).list()]
    assert statuses == ["cancelled"]


# ------------------------------------------------------------------------------------------ the brain


@pytest.mark.anyio
async def test_estimate_memory_predicts_per_rank_bytes_and_can_draw_them(client):
    r = await client.call_tool("estimate_memory", {"config": "tiny", "overrides": {"parallel.dp": 2}, "plot": True})
    assert not r.is_error, _text(r)
    mem = r.structured_content["memory"]
    assert mem["total"] == sum(mem[k] for k in CATEGORIES)  # the categories bench measures (breakdown.py)
    assert mem["params"] == 723_200 and r.structured_content["param_count"] == 180_800
    image = [b for b in r.content if b.type == "image"]
    assert len(image) == 1 and image[0].mime_type == "image/png"
    assert base64.b64decode(image[0].data)[:8] == b"\x89PNG\r\n\x1a\n"
    r = await client.call_tool("estimate_memory", {"config": "tiny", "hardware": "B300"})
    assert r.is_error and "H100" in _text(r)


@pytest.mark.anyio
async def test_recommend_next_follows_the_ladder_from_a_single_device_oom(client):
    r = await client.call_tool("recommend_next", {"config": "tiny", "symptom": "oom",
                                                  "overrides": {"hardware.gpu_memory_gib": 0.004}})
    assert not r.is_error, _text(r)
    out = r.structured_content
    assert out["primitive"] == "recompute" and out["config_patch"]["parallel.recompute"] in ("full", "selective")
    assert out["validation"]["tool"] == "whitebox_compare" and out["reason"]
    r = await client.call_tool("recommend_next", {"config": "tiny", "symptom": "bogus"})
    assert r.is_error and "oom" in _text(r)
    r = await client.call_tool("recommend_next", {"config": "tiny", "overrides": {"parallel.tp": 3}})
    assert r.is_error and "parallel.tp" in _text(r)


@pytest.mark.anyio
async def test_recommend_next_cautions_a_fit_inside_the_error_band_and_names_the_oom_rung(client):
    # the MCP answer carries what the CLI prints: `none`, the caution with the band, and the rung if it runs out
    r = await client.call_tool("recommend_next", {"config": "llama3-8b", "overrides": {"train.seq_len": 133120,
                                                                                      "train.global_batch": 8}})
    assert not r.is_error, _text(r)
    out = r.structured_content
    assert out["action"] == "none" and "error band" in out["caution"] and out["caution"] in out["reason"]
    assert out["if_confirmed"].get("parallel.cp") == 2 and "run bench" in out["caution"]


@pytest.mark.anyio
async def test_plan_climbs_on_paper_and_draws_the_pipeline_bubble(client):
    args = {"model": "llama3-70b", "gpus_per_node": 8, "nodes": 4, "gpu_memory_gib": 80, "seq_len": 4096,
            "global_batch": 256}
    r = await client.call_tool("plan", args)
    assert not r.is_error, _text(r)
    out = r.structured_content
    assert out["fits"] and out["rungs"][0]["primitive"] == "baseline" and out["final"]["cp"] == 1
    assert set(out["final"]) >= {"dp", "zero", "tp", "pp", "cp", "recompute"}
    r = await client.call_tool("plan", {**args, "model": "llama3-405b", "nodes": 32, "plot": True})
    assert not r.is_error, _text(r)
    png = base64.b64decode(next(b for b in r.content if b.type == "image").data)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    r = await client.call_tool("plan", {**args, "model": "nope"})
    assert r.is_error and "llama3-8b" in _text(r)


@pytest.mark.anyio
async def test_capacity_sweep_estimates_the_capacity_under_every_rung(client):
    r = await client.call_tool("capacity_sweep", {"config": "tiny"})
    assert not r.is_error, _text(r)
    rows = {row["rung"]: row for row in r.structured_content["rungs"]}
    assert {"single", "single+recompute", "zero3"} <= set(rows) and r.structured_content["mode"] == "estimate"
    assert rows["single+recompute"]["max_micro_batch"] > rows["single"]["max_micro_batch"]  # recompute buys batch
    r = await client.call_tool("capacity_sweep", {"config": "tiny", "rungs": ["bogus"]})
    assert r.is_error and "zero3" in _text(r)


def test_plans_memory_picture_draws_the_usable_line_the_planner_fitted(monkeypatch):
    """Without a pipeline the plan's picture is its memory breakdown; its usable line is the plan's own (budget
    minus the final layout's reserve), not a reserve recomputed for some other layout."""
    import curry_train.plots as plots
    from curry_train.advice.planner import plan
    from curry_train_mcp import brain_tools

    seen = {}
    monkeypatch.setattr(plots, "memory_breakdown_png", lambda comp, **kw: seen.update(kw) or b"png")
    p = plan("llama3-8b", 8, 1, 80.0, 8192, 512)
    assert p.final["pp"] == 1 and brain_tools._plan_png(p) == b"png"
    assert seen["usable_bytes"] == p.usable_gib * 2**30 and seen["budget_bytes"] == 80.0 * 2**30
