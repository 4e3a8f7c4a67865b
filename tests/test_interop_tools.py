"""import_hf_config and export_layout through a real MCP session (in-memory client) and the CLI.

    .venv/bin/pytest -n 0 -q tests/test_interop_tools.py
"""

from __future__ import annotations

import json

import pytest
import yaml
from curry_train.cli import main
from curry_train_mcp.server import mcp
from mcp import Client
from test_hf_import import LLAMA3_8B, QWEN2_72B


@pytest.fixture(autouse=True)
def _project_root(project, monkeypatch):
    monkeypatch.setenv("CURRY_TRAIN_ROOT", str(project))
    return project


def _text(result) -> str:
    return "\n".join(b.text for b in result.content if b.type == "text")


@pytest.mark.anyio
async def test_import_then_export_over_mcp(project):
    async with Client(mcp, raise_exceptions=True) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        assert tools["import_hf_config"].annotations.read_only_hint is False
        assert tools["export_layout"].annotations.read_only_hint is True
        r = await c.call_tool("import_hf_config", {"path_or_json": json.dumps(LLAMA3_8B), "name": "l3"})
        assert not r.is_error, _text(r)
        assert r.structured_content["param_count"] == 8_030_261_248
        assert yaml.safe_load((project / "configs" / "local" / "l3.yaml").read_text())["model"]["vocab_size"] == 128256
        r = await c.call_tool("import_hf_config", {"path_or_json": json.dumps(QWEN2_72B), "name": "q"})
        assert r.is_error and "config.json:attention_bias" in _text(r) and "accept" in _text(r)
        assert not (project / "configs" / "local" / "q.yaml").exists()
        r = await c.call_tool("import_hf_config", {"path_or_json": "/etc/passwd", "name": "x"})
        assert r.is_error and "path_or_json" in _text(r)
        r = await c.call_tool("export_layout", {"config": "l3", "framework": "deepspeed",
                                                "overrides": {"parallel.dp": 8, "parallel.zero": 2,
                                                              "train.global_batch": 64}})
        assert not r.is_error, _text(r)
        assert json.loads(r.structured_content["text"])["zero_optimization"]["stage"] == 2
        r = await c.call_tool("export_layout", {"config": "l3", "framework": "jax"})
        assert r.is_error and "framework" in _text(r)


def test_cli_import_and_export(project, tmp_path, capsys):
    src = tmp_path / "config.json"
    src.write_text(json.dumps(QWEN2_72B))
    assert main(["import-hf", str(src), "--name", "qwen2", "--root", str(project)]) == 2
    assert "--accept attention_bias" in capsys.readouterr().err
    assert main(["import-hf", str(tmp_path), "--name", "qwen2", "--accept", "attention_bias",
                 "--root", str(project), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["param_count"] + out["param_count_of_accepted"] == 72_706_203_648
    dest = tmp_path / "megatron.args"
    assert main(["export", "--config", "qwen2", "--framework", "megatron", "--set", "parallel.tp=8",
                 "--set", "parallel.dp=1", "--set", "parallel.zero=3", "--out", str(dest),
                 "--root", str(project)]) == 0
    assert "--tensor-model-parallel-size 8" in dest.read_text()
    assert "cannot express" in capsys.readouterr().out
