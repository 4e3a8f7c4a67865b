"""The tools as a model and a newcomer meet them: they refuse early what this machine cannot run, say
which budget and which machine they describe, keep one vocabulary, and give short, typed, honest answers.

    .venv/bin/pytest tests/test_tools_honest.py -q

Nothing here launches ranks: a refusal comes before any launch, and the other checks read schemas and results.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from curry_train.config import load_config
from curry_train.measure.hardware import GPUInfo, HardwareReport
from curry_train.measure.preflight import PreflightError, cpu_rank_cap, preflight
from curry_train.store.runs import Ledger
from curry_train_mcp import app
from curry_train_mcp.jobs import WorkerError
from curry_train_mcp.server import mcp
from mcp import Client
from mcp.server.mcpserver.exceptions import ToolError

LAUNCHING = ("bench", "whitebox_compare", "capacity_sweep")


@pytest.fixture(autouse=True)
def _project_root(project, monkeypatch):
    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))
    return project


def _text(result) -> str:
    return "\n".join(b.text for b in result.content if b.type == "text")


async def _tools() -> dict[str, Any]:
    async with Client(mcp, mode="legacy") as c:
        return {t.name: t for t in (await c.list_tools()).tools}


# ------------------------------------------------------------------------------------------ (2) preflight


@pytest.mark.anyio
@pytest.mark.parametrize("tool,args", [("bench", {}), ("whitebox_compare", {}), ("capacity_sweep", {"measured": True})])
async def test_a_cluster_preset_is_refused_before_any_launch_with_what_to_call_instead(project, tool, args):
    # no worker is started: tests/conftest.py makes any launch from an unmarked test fail it
    async with Client(mcp, mode="legacy") as c:
        r = await c.call_tool(tool, {"config": "llama3-8b", "overrides": {"parallel.dp": 2}, **args})
    text = _text(r)
    assert r.is_error, text
    assert "cluster preset" in text and "estimate_memory" in text and "plan" in text and "update_config" in text
    assert "this machine has" in text and "CPU cores" in text  # what this machine has
    assert Ledger(project).list() == []  # nothing recorded, nothing launched


def test_more_local_ranks_than_this_machine_runs_are_refused_pointing_to_a_multi_node_launch(project):
    cfg = load_config(project / "configs" / "tiny.yaml", {"hardware.nodes": 8, "parallel.dp": 64,
                                                          "train.global_batch": 64, "train.micro_batch": 1})
    cpu = HardwareReport(gpu_count=0, cpu_count=2, memory_bytes=24 * 2**30, source="none")
    with pytest.raises(PreflightError, match=r"64 local ranks.*at most 4 CPU ranks.*--nnodes=8"):
        preflight(cfg, "tiny", cpu)
    assert cpu_rank_cap(2) == 4 and cpu_rank_cap(16) == 32
    preflight(load_config(project / "configs" / "tiny.yaml", {"parallel.dp": 4}), "tiny", cpu)  # 4 ranks: fine


def test_the_cli_refuses_the_same_launch_before_anything_starts(project, capsys):
    from curry_train.cli import main

    code = main(["bench", "--config", "tiny", "--set", "hardware.nodes=8", "--set", "parallel.dp=64", "--set",
                 "train.global_batch=64", "--set", "train.micro_batch=1", "--root", str(project)])
    err = capsys.readouterr().err
    assert code != 0 and "local ranks" in err and "--nnodes=8" in err, err
    assert not (project / "runs" / "ledger.sqlite3").exists()


def test_a_gpu_machine_refuses_a_config_whose_ranks_do_not_fit_its_device_memory(project):
    gpu = HardwareReport(gpu_count=1, cpu_count=16, memory_bytes=128 * 2**30, source="nvml", cuda_version="12.8",
                         gpus=[GPUInfo(index=0, name="NVIDIA H200", memory_bytes=141 * 2**30)])
    # without recompute (with it the 8B now fits one H200: 127 GiB, FSDP2 at degree 1 and fused AdamW's step)
    cfg = load_config(project / "configs" / "llama3-8b.yaml", {"parallel.dp": 1, "train.global_batch": 8,
                                                                "parallel.recompute": "none"})
    with pytest.raises(PreflightError, match=r"needs an estimated .* GiB per rank, but the smallest local GPU"):
        preflight(cfg, "llama3-8b", gpu)
    with pytest.raises(PreflightError, match="at most 1 GPU"):
        preflight(load_config(project / "configs" / "llama3-8b.yaml", {"parallel.dp": 2}), "llama3-8b", gpu)
    preflight(load_config(project / "configs" / "tiny.yaml", {"hardware.device": "cuda"}), "tiny", gpu)


# ------------------------------------------------------------------------------------------ (3) (8) (11) (13) (15)


@pytest.mark.anyio
async def test_descriptions_say_which_budget_which_machine_and_are_plain_paragraphs():
    tools = await _tools()
    for name in ("estimate_memory", "recommend_next"):
        hw = tools[name].input_schema["properties"]["hardware"]["description"]
        assert "gpu_memory_gib" in hw and "budget" in hw, (name, hw)
    probe = tools["probe_hardware"].description
    assert "THIS machine" in probe and "plan" in probe and "estimate_memory" in probe
    assert "need it" not in probe  # no tool needs it; the preflight of bench & co. reads it
    for t in tools.values():
        assert "\n    " not in (t.description or ""), t.name  # no docstring indentation


@pytest.mark.anyio
async def test_the_hardware_argument_keeps_the_configs_budget_and_the_result_says_so():
    async with Client(mcp, mode="legacy") as c:
        est = (await c.call_tool("estimate_memory", {"config": "tiny", "hardware": "H100"})).structured_content
        rec = (await c.call_tool("recommend_next", {"config": "tiny", "hardware": "H100"})).structured_content
    assert est["budget_bytes"] == 2**30 and est["hardware"]["name"] == "H100"  # tiny.yaml: gpu_memory_gib 1.0
    assert "budget" in est["hardware_note"] and "gpu_memory_gib" in est["hardware_note"]
    assert rec["gpu_profile"] == "H100" and "budget" in rec["reason"]


@pytest.mark.anyio
async def test_tools_that_launch_are_neither_read_only_nor_idempotent():
    tools = await _tools()
    for name in LAUNCHING:
        a = tools[name].annotations
        assert a.read_only_hint is False and a.idempotent_hint is False, name
    assert tools["estimate_memory"].annotations.read_only_hint is True


def _untyped(node: Any, path: str, defs: dict[str, Any]) -> list[str]:
    """Schema nodes that carry no type at all (what the Inspector's strict portability check warns about)."""
    if not isinstance(node, dict):
        return []
    bad = []
    if not ({"type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const"} & set(node)):
        bad.append(path)
    for k, sub in (node.get("properties") or {}).items():
        bad += _untyped(sub, f"{path}.{k}", defs)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict) and node[key]:
            bad += _untyped(node[key], f"{path}[{key}]", defs)
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(node.get(key) or []):
            bad += _untyped(sub, f"{path}|{i}", defs)
    return bad


@pytest.mark.anyio
async def test_every_output_schema_field_has_a_type():
    for name, t in (await _tools()).items():
        schema = t.output_schema or {}
        defs = schema.get("$defs", {})
        bad = []
        for d, sub in defs.items():
            for k, prop in (sub.get("properties") or {}).items():
                bad += _untyped(prop, f"{d}.{k}", defs)
        for k, prop in (schema.get("properties") or {}).items():
            bad += _untyped(prop, k, defs)
        assert not [b for b in bad if not b.endswith(("detail[additionalProperties]",))], (name, bad)


@pytest.mark.anyio
async def test_probe_without_measuring_is_fast_cached_and_about_this_machine():
    async with Client(mcp, mode="legacy") as c:
        r = await c.call_tool("probe_hardware", {})
        again = await c.call_tool("probe_hardware", {"measure": False})
    out = r.structured_content
    assert not r.is_error and again.structured_content == out  # no measurement: nothing launched (conftest guard)
    assert out["torch_version"] and "gloo" in out["backends"] and out["cpu_count"] >= 1
    assert "plan" in out["about"] and "estimate_memory" in out["about"]


def test_plots_name_every_axis_and_one_budget_wording():
    from curry_train.plots import budget_label, layout_title

    title = layout_title("tiny-moe", {"dp": 2, "zero": 3, "tp": 1, "pp": 1, "cp": 1, "ep": 2, "recompute": "full"})
    assert "ep2" in title and "recompute=full" in title and "zero3" in title
    assert budget_label(80 * 2**30, 74 * 2**30) == "usable 74.00 GiB of the 80.00 GiB budget per rank"
    assert budget_label(2**30, 2**30) == "budget 1.00 GiB per rank"


@pytest.mark.anyio
async def test_plan_ranks_each_distinct_layout_once():
    async with Client(mcp, mode="legacy") as c:
        r = await c.call_tool("plan", {"model": "llama3-70b", "gpus_per_node": 8, "nodes": 4, "gpu_memory_gib": 80,
                                       "seq_len": 4096, "global_batch": 512})
    rows = [(json.dumps(x["parallel"], sort_keys=True), x["total_gib"], x["step_time_s"])
            for x in r.structured_content["ranked"]]
    effective = [(x["total_gib"], x["step_time_s"], x["parallel"]["dp"], x["parallel"]["tp"], x["parallel"]["pp"])
                 for x in r.structured_content["ranked"]]
    assert len(set(rows)) == len(rows) and len(set(effective)) == len(effective), rows


# ------------------------------------------------------------------------------------------ (4) the prompt


@pytest.mark.anyio
@pytest.mark.parametrize("symptom,kind", [("OOM at seq 4096", "oom"), ("CUDA out of memory on rank 3", "oom"),
                                          ("too slow at 8 GPUs", "slow"), ("", "none"), ("not sure", "none")])
async def test_the_prompt_takes_free_text_and_speaks_recommend_next_vocabulary(symptom, kind):
    async with Client(mcp, mode="legacy") as c:
        prompt = next(p for p in (await c.list_prompts()).prompts if p.name == "diagnose_scaling")
        r = await c.get_prompt("diagnose_scaling", {"config": "tiny", "symptom": symptom})
    text = r.messages[0].content.text
    assert ("symptom=" not in text) if kind == "none" else (f'symptom="{kind}"' in text)
    assert "unknown" not in text
    assert "Set C to the config you just wrote" in text and "not on `tiny`" in text  # step 7 loops on the new one
    assert any(a.name == "symptom" and "your words" in (a.description or "") for a in prompt.arguments)


# ------------------------------------------------------------------------------------------ (6) runs_diff


def _record(project, kind: str, overrides: dict, metrics: dict) -> str:
    ledger = Ledger(project)
    rec = ledger.start(kind, load_config(project / "configs" / "tiny.yaml", overrides), "tiny")
    return ledger.finish(rec.run_id, status="ok", metrics={"run_id": rec.run_id, "wall_s": 3.0, **metrics}).run_id


@pytest.mark.anyio
async def test_runs_diff_shows_only_changes_and_names_a_loss_change(project):
    base = {"step_time_s": 0.1, "tokens_per_s": 100.0, "peak_memory_bytes": 1000, "steps": 3, "warmup": 1,
            "memory_breakdown": {"params": 400, "grads": 300, "grad_buffers": 300, "categories": {"params": 400}},
            "plot_path": "/x/memory.png", "step_times_s": [0.1, 0.1, 0.1], "per_rank_peak_bytes": [1000]}
    a = _record(project, "bench", {}, {**base, "losses": [5.0, 4.5, 4.0]})
    b = _record(project, "bench", {"parallel.dp": 2},
                {**base, "peak_memory_bytes": 700, "step_time_s": 0.2, "losses": [5.0, 4.6, 4.2],
                 "memory_breakdown": {**base["memory_breakdown"], "grad_buffers": 0}, "wall_s": 9.0})
    async with Client(mcp, mode="legacy") as c:
        out = (await c.call_tool("runs_diff", {"run_a": a, "run_b": b})).structured_content
    metrics = {m["metric"] for m in out["metric_changes"]}
    assert metrics == {"peak_memory_bytes", "step_time_s", "memory_breakdown.grad_buffers", "losses[-1]"}, metrics
    assert [ch["key"] for ch in out["config_changes"]] == ["parallel.dp"]
    v = out["verdict"]
    assert "losses differ" in v and "4.0000 -> 4.2000" in v and "grad_buffers" in v and "step time x2.00" in v


@pytest.mark.anyio
async def test_runs_diff_of_a_bench_and_a_whitebox_run_says_the_kinds_differ(project):
    a = _record(project, "bench", {}, {"step_time_s": 0.1, "losses": [5.0]})
    b = _record(project, "whitebox", {}, {"passed": True})
    async with Client(mcp, mode="legacy") as c:
        out = (await c.call_tool("runs_diff", {"run_a": a, "run_b": b})).structured_content
    assert out["verdict"].startswith("different kinds: run_a is a bench run, run_b a whitebox run")


# ------------------------------------------------------------------------------------------ (9) timeout tail


@pytest.mark.anyio
async def test_a_timeout_error_is_the_last_step_and_a_short_tail(monkeypatch):
    noise = ("/usr/lib/python3/site-packages/torch/nn/parallel/distributed.py:1234: FutureWarning: "
             "`torch.cuda.amp` is deprecated\n  warnings.warn(\n") * 30
    trace = ("Traceback (most recent call last):\n  File \"torchrun\", line 8, in <module>\n    sys.exit(main())\n"
             "torch.distributed.elastic.multiprocessing.api.SignalException: Process 42 got signal: 15\n")
    message = f"timed out after 5s; every rank was killed. Log tail:\n{noise}rank 0: step 2/5 done\n{trace}"
    assert len(message) > 3000

    async def fake_worker(*_a, **_k):
        raise WorkerError("failed", message, "step 2/5: 120 ms")

    monkeypatch.setattr(app, "run_worker", fake_worker)
    with pytest.raises(ToolError) as e:
        await app._long("bench", {}, None, deadline_s=5, label="bench")
    text = str(e.value)
    assert len(text) < 800 and "step 2/5: 120 ms" in text and "rank 0: step 2/5 done" in text, text
    assert "FutureWarning" not in text and "Traceback" not in text and "SignalException" not in text


# ------------------------------------------------------------------------------------------ (10) list_changed


@pytest.mark.anyio
async def test_a_config_created_mid_session_is_listed_and_announced(project):
    seen: list[str] = []

    async def on_message(msg: Any) -> None:
        seen.append(getattr(getattr(msg, "root", msg), "method", "") or type(msg).__name__)

    async with Client(mcp, mode="legacy", message_handler=on_message) as c:
        assert c.server_capabilities.resources.list_changed is True
        r = await c.call_tool("update_config", {"name": "tiny-dp2", "base": "tiny", "changes": {"parallel.dp": 2}})
        assert not r.is_error, _text(r)
        uris = {str(x.uri) for x in (await c.list_resources()).resources}
    assert "config://tiny-dp2" in uris
    assert any("list_changed" in s or "ResourceListChanged" in s for s in seen), seen


# ------------------------------------------------------------------------------------------ (7) capacity_sweep


@pytest.mark.anyio
async def test_capacity_sweep_says_what_bounds_each_number_and_never_passes_a_bound_off_as_a_limit():
    async with Client(mcp, mode="legacy") as c:
        r = await c.call_tool("capacity_sweep", {"config": "tiny", "max_micro_batch": 4096})
    out = r.structured_content
    largest = max(m["params"] for m in out["family"])
    for row in out["rungs"]:
        assert row["note"], row["rung"]  # never empty
        if row["max_micro_batch"] == 4096:  # the search cap: a bound, said so
            assert row["micro_batch_limited_by"] == "search cap" and "search cap" in row["note"], row
        elif row["max_micro_batch"] is not None:
            assert row["micro_batch_limited_by"] == "memory" and f"{row['max_micro_batch'] + 1} needs" in row["note"]
        if row["max_model"] and row["max_model"]["params"] == largest:  # the family's end: a bound, said so
            assert row["model_limited_by"] == "family" and "above this family" in row["note"], row
    assert any(row["micro_batch_limited_by"] == "memory" for row in out["rungs"])
