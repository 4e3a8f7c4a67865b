"""The server's resources and prompt: skills as skill://<name>/SKILL.md, configs as config://<name>, runs as
run://<id> (+ a bench's memory.png), and the diagnose_scaling prompt that walks the stage-4 procedure.

Registers on app.mcp, the same MCPServer as the tools; server.py imports it after the tools.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from curry_train.paths import UnsafeName, check_name, config_names, config_path
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceNotFoundError
from mcp.server.mcpserver.prompts.base import UserMessage
from mcp.server.mcpserver.resources import FunctionResource
from pydantic import Field

from .app import SKILLS_DIR, _available, mcp, root

logger = logging.getLogger(__name__)

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
    for stem in config_names(root()):
        try:
            p = config_path(stem, root())  # a written config shadows the preset of its name, as in every tool
        except UnsafeName:
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
    """configs/local/<name>.yaml when a tool wrote it, else the preset configs/<name>.yaml, as stored."""
    return _config_text(name)


def _add_config(stem: str) -> None:
    mcp.add_resource(FunctionResource(uri=f"config://{stem}", name=f"config {stem}", title=f"Config {stem}",
                                      mime_type="application/yaml", fn=(lambda n=stem: _config_text(n))))


def register_configs() -> None:
    """Concrete entries for resources/list; update_config adds the configs it creates (announce_config)."""
    for stem in config_names(root()):
        _add_config(stem)


async def announce_config(stem: str, ctx: Context) -> None:
    """A config created mid-session: list it, and tell the client its resource list changed (capability
    resources.listChanged, set in advertise_list_changed), on the session and on subscriptions/listen streams."""
    _add_config(stem)
    try:
        await ctx.session.send_resource_list_changed()
        await ctx.notify_resources_changed()
    except Exception as e:  # noqa: BLE001 - a notification the client cannot take must not fail the write
        logger.info("resources/list_changed not sent: %s", e)


def advertise_list_changed() -> None:
    """Advertise resources.listChanged: the SDK's MCPServer calls create_initialization_options() without
    NotificationOptions (mcp 2.3), so every transport's handshake goes through this default instead."""
    from mcp.server.lowlevel.server import NotificationOptions

    low = mcp._lowlevel_server
    original = low.create_initialization_options

    def with_list_changed(notification_options: NotificationOptions | None = None, *args: Any, **kw: Any) -> Any:
        return original(notification_options or NotificationOptions(resources_changed=True), *args, **kw)

    low.create_initialization_options = with_list_changed


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


# recommend_next's vocabulary; free text is mapped onto it (the symptom a user types is rarely one word)
_OOM_WORDS = ("oom", "out of memory", "memory", "does not fit", "doesn't fit", "not fit", "cuda error: out")
_SLOW_WORDS = ("slow", "throughput", "tokens/s", "mfu", "latency", "step time", "comm", "bandwidth", "scal")


def symptom_kind(text: str) -> str:
    """Free text -> recommend_next's symptom: oom, slow or none ("" and "unknown" -> none)."""
    t = text.lower()
    if any(w in t for w in _OOM_WORDS):
        return "oom"
    if any(w in t for w in _SLOW_WORDS):
        return "slow"
    return "none"


@mcp.prompt(title="Diagnose scaling: which parallelism primitive next?")
def diagnose_scaling(
    config: Annotated[str, Field(description="Config name in configs/ to start from")] = "tiny",
    symptom: Annotated[str, Field(description="What goes wrong, in your words (e.g. 'OOM at seq 4096', "
                                              "'slow at 8 GPUs'); mapped to recommend_next's oom / slow / none")] = "",
    goal: Annotated[str, Field(description="What the user wants, e.g. 'fit llama3-8b on 8 H100s'")] = "",
) -> list[UserMessage]:
    """Walk the stage-4 procedure on a config: measure, recommend one primitive, apply, re-measure, prove parity."""
    kind = symptom_kind(symptom)
    said = f' (symptom: "{symptom.strip()}", read as {kind})' if symptom.strip() else ""
    sym_arg = f', symptom="{kind}"' if kind != "none" else ""
    text = f"""Help me scale training of config `{config}`{said}.{' Goal: ' + goal if goal else ''}

Follow the curryTrain stage-4 procedure (skill://stage4-parallel-primitive-intro/SKILL.md), one rung at a time.
Call the current config C; it starts as `{config}`.
1. Read skill://stage4-parallel-primitive-intro/SKILL.md and call probe_hardware (measure=false) to see what
   this machine has. Then decide which machine the question is about: a cluster (a preset such as llama3-8b,
   "N GPUs") is answered by estimate_memory and plan, without running anything; this machine by measuring
   (bench refuses, at once, configs this machine cannot run and says what to call instead).
2. Call estimate_memory(config=C) and, when C runs on this machine, bench(config=C) for the baseline: does it
   fit, is it memory- or throughput-bound? Quote the per-rank numbers by category (params, grads, optimizer,
   activations, ...).
3. Call recommend_next(config=C{sym_arg}) and explain its reason with the numbers. Follow the ladder: recompute
   for a single-device OOM, then the lowest ZeRO stage that fits, TP only within a node after full sharding +
   recompute, PP only across nodes when communication dominates, EP only for MoE, CP only for long sequences.
4. Apply exactly one primitive: update_config(name="<C>-<primitive>", changes=<config_patch>, base=C).
5. bench the new config, then whitebox_compare it: the parallel run must match one device before its numbers count.
6. runs_diff the two bench runs and state what the primitive bought (memory, step time) and what it cost.
7. Set C to the config you just wrote and repeat from step 3 on it (not on `{config}`) until it fits the budget
   and is not communication-bound; stop and say so when the only answer is more GPUs."""
    return [UserMessage(text)]
