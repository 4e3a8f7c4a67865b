"""The server's resources and prompt: skills as skill://<name>/SKILL.md, configs as config://<name>, runs as
run://<id> (+ a bench's memory.png), and the diagnose_scaling prompt that walks the stage-4 procedure.

Imported by server.py once its tools exist; registers on the same MCPServer.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from curry_train.paths import UnsafeName, check_name, configs_dir
from mcp.server.mcpserver.exceptions import ResourceNotFoundError
from mcp.server.mcpserver.prompts.base import UserMessage
from mcp.server.mcpserver.resources import FunctionResource
from pydantic import Field

from .server import SKILLS_DIR, _available, mcp, root

# ------------------------------------------------------------------------------------------------ resources


@mcp.resource("skill://index", mime_type="application/json", title="curryTrain skills")
def skill_index() -> str:
    """Every skill: name, description and the URI of its SKILL.md."""
    from .skills_ext import frontmatter

    out = []
    for md in sorted(SKILLS_DIR.glob("*/SKILL.md")):
        fm = frontmatter(md.read_text(encoding="utf-8"))
        out.append({"name": md.parent.name, "uri": f"skill://{md.parent.name}/SKILL.md",
                    "description": fm.get("description", "")})
    return json.dumps(out, indent=1)


@mcp.resource("config://index", mime_type="application/json", title="Configs")
def config_index() -> str:
    """The config names tools accept, with each one's parallel section."""
    import yaml

    out = []
    for p in sorted(configs_dir(root()).glob("*.yaml")):
        if configs_dir(root()).resolve() not in p.resolve().parents:
            continue  # symlinked out of configs/: the tools refuse it, so it is not a config name
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError, OSError):
            raw = {}
        raw = raw if isinstance(raw, dict) else {}  # a hand-edited file holding a list or a scalar
        model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        out.append({"name": p.stem, "uri": f"config://{p.stem}", "parallel": raw.get("parallel"),
                    "model": {k: model.get(k) for k in ("d_model", "n_layers", "num_experts")}})
    return json.dumps(out, indent=1)


def _config_text(name: str) -> str:
    from curry_train.paths import config_path

    try:
        # config_path, not configs_dir() / name: it also refuses a configs/<name>.yaml symlinked out of configs/,
        # which this resource used to read although every tool refused it (tests/reliability/test_paths.py)
        path = config_path(check_name(name, "config name"), root())
    except UnsafeName as e:
        raise ResourceNotFoundError(str(e)) from None
    if not path.is_file():
        raise ResourceNotFoundError(f"no config {name!r}; available: {_available()}")
    return path.read_text(encoding="utf-8")


@mcp.resource("config://{name}", mime_type="application/yaml", title="A config (YAML)")
def config_resource(name: str) -> str:
    """configs/<name>.yaml as stored."""
    return _config_text(name)


def register_configs() -> None:
    """Concrete entries for resources/list (configs written later are still readable through the template)."""
    for p in sorted(configs_dir(root()).glob("*.yaml")):
        mcp.add_resource(FunctionResource(uri=f"config://{p.stem}", name=f"config {p.stem}", title=f"Config {p.stem}",
                                          mime_type="application/yaml",
                                          fn=(lambda n=p.stem: _config_text(n))))


@mcp.resource("run://index", mime_type="application/json", title="Recent runs")
def run_index() -> str:
    """The 50 most recent runs: id, kind, config, status and headline metrics."""
    from curry_train.store.runs import Ledger

    keys = ("step_time_s", "peak_memory_bytes", "passed", "last_loss", "oom")
    out = [{"run_id": r.run_id, "uri": f"run://{r.run_id}", "kind": r.kind, "config": r.config_name,
            "status": r.status, "created": r.created, **{k: r.metrics[k] for k in keys if k in r.metrics}}
           for r in Ledger(root()).list(50)]
    return json.dumps(out, indent=1)


@mcp.resource("run://{run_id}", mime_type="application/json", title="A recorded run")
def run_resource(run_id: str) -> str:
    """One run: the resolved config, its metrics (bench result or white-box verdict), status and error."""
    from curry_train.store.runs import Ledger

    try:
        return Ledger(root()).get(run_id).model_dump_json(indent=1)
    except (UnsafeName, KeyError) as e:
        raise ResourceNotFoundError(str(e.args[0]) if isinstance(e, KeyError) else str(e)) from None


@mcp.resource("run://{run_id}/memory.png", mime_type="image/png", title="A bench's memory breakdown")
def run_memory_png(run_id: str) -> bytes:
    """The per-rank memory breakdown (estimate vs measured) a bench drew."""
    from curry_train.paths import run_dir

    try:
        path = run_dir(run_id, root()) / "memory.png"
    except UnsafeName as e:
        raise ResourceNotFoundError(str(e)) from None
    if not path.is_file():
        raise ResourceNotFoundError(f"run {run_id!r} has no memory.png (only bench runs draw one)")
    return path.read_bytes()


# ------------------------------------------------------------------------------------------------ prompts


@mcp.prompt(title="Diagnose scaling: which parallelism primitive next?")
def diagnose_scaling(
    config: Annotated[str, Field(description="Config name in configs/ to start from")] = "tiny",
    symptom: Annotated[Literal["oom", "slow", "unknown"], Field(description="What goes wrong now")] = "unknown",
    goal: Annotated[str, Field(description="What the user wants, e.g. 'fit llama3-8b on 8 H100s'")] = "",
) -> list[UserMessage]:
    """Walk the stage-4 procedure on a config: measure, recommend one primitive, apply, re-measure, prove parity."""
    sym = "" if symptom == "unknown" else f' (symptom: "{symptom}")'
    text = f"""Help me scale training of config `{config}`{sym}.{' Goal: ' + goal if goal else ''}

Follow the curryTrain stage-4 procedure (skill://stage4-parallel-primitive-intro/SKILL.md), one rung at a time:
1. Read skill://stage4-parallel-primitive-intro/SKILL.md, then call probe_hardware to see the devices and links.
2. Call estimate_memory(config="{config}") and bench(config="{config}") to get the baseline: does it fit, is it
   memory- or throughput-bound? Quote the per-rank numbers (params, grads, optimizer, activations).
3. Call recommend_next(config="{config}"{', symptom="' + symptom + '"' if symptom != "unknown" else ""}) and explain
   its reason with the numbers. Follow the ladder: recompute for a single-device OOM, then the lowest ZeRO stage
   that fits, TP only within a node after full sharding + recompute, PP only across nodes when communication
   dominates, EP only for MoE, CP only for long sequences.
4. Apply exactly one primitive with update_config(name="{config}-next", changes=<config_patch>, base="{config}").
5. bench the new config, then whitebox_compare it: the parallel run must match one device before its numbers count.
6. runs_diff the two bench runs and state what the primitive bought (memory, step time) and what it cost.
7. Repeat from step 3 until it fits the budget and is not communication-bound; stop and say so when the only
   answer is more GPUs."""
    return [UserMessage(text)]
