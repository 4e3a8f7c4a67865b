"""Export a config's layout to the framework a user trains with: torchtitan, Megatron-LM, DeepSpeed, Accelerate.

    curry-train export --config llama3-70b --framework megatron --json

`export_layout(config, framework)` renders the config's parallel section (plus the batch, dtype and model shape
the target needs) as that framework's own file or command line, with two lists beside it: what the target
cannot express of this layout (`not_expressed`, each with what the file does instead), and how the target's
memory differs from this template's, in the estimator's own figures (`memory`: model states per rank here
against the target's documented bytes per parameter). One module per target renders it (torchtitan.py,
megatron.py, deepspeed.py, accelerate.py); none of them imports the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field

from curry_train.advice.export import accelerate, deepspeed, megatron, torchtitan
from curry_train.advice.export.common import GIB, Rendered, local_params
from curry_train.config import Config, load_config
from curry_train.estimator import Estimate, estimate
from curry_train.paths import resolve_config_arg

Framework = Literal["torchtitan", "megatron", "deepspeed", "accelerate"]
FRAMEWORKS: tuple[str, ...] = get_args(Framework)


class LayoutExport(BaseModel):
    framework: str
    config: str = Field(description="The config exported.")
    format: str = Field(description="toml, argv, json or yaml: what `text` is.")
    filename: str = Field(description="A file name for `text` (argv: the arguments to append to the launch).")
    text: str = Field(description="The target's own config file (or arguments), ready to use.")
    not_expressed: list[str] = Field(description="What of this layout the target cannot express, and what "
                                                 "`text` does instead.")
    memory: list[str] = Field(description="How the target's per-rank memory differs from this template's, "
                                          "in the estimator's figures.")
    template_model_states_gib: float = Field(description="This template's params + grads + optimizer state "
                                                         "on the largest rank (the estimate).")
    target_model_states_gib: float = Field(description="The same parameters under the target's documented "
                                                       "bytes per parameter for this layout.")
    template_peak_gib: float = Field(description="This template's estimated per-rank peak for the layout.")


def _render(framework: str, cfg: Config, est: Estimate) -> Rendered:
    return {"torchtitan": torchtitan.render, "megatron": megatron.render, "deepspeed": deepspeed.render,
            "accelerate": accelerate.render}[framework](cfg, est)


def export_layout(config: str | Path | Config, framework: str, overrides: dict[str, Any] | None = None, *,
                  root: str | Path | None = None) -> LayoutExport:
    """The config's layout as `framework`'s own config, with what it cannot express and how its memory differs."""
    from curry_train.config import ConfigError, Problem

    if framework not in FRAMEWORKS:
        raise ConfigError([Problem(fields=["framework"], message=f"{framework!r} is not an export target",
                                   fix=f"use one of {', '.join(FRAMEWORKS)}")])
    if isinstance(config, Config):
        cfg, name = config, "<given>"
    else:
        path = resolve_config_arg(str(config), root)
        if not path.is_file():
            raise FileNotFoundError(f"no config {config!r} in {path.parent}")
        cfg, name = load_config(path, overrides), path.stem
    est = estimate(cfg)
    r = _render(framework, cfg, est)
    n = local_params(cfg)
    target = r.bytes_per_param * n
    mine = est.model_state_bytes
    memory = [f"model states per rank: this template {mine / GIB:.3g} GiB ({mine / max(n, 1):.1f} B per local "
              f"parameter: fp32 params, fp32 grads, fp32 AdamW m and v, sharded as the layout says), "
              f"{framework} {target / GIB:.3g} GiB ({r.bytes_per_param:.2f} B/param; {r.source}), for the "
              f"{n:,} parameters a rank holds before data-parallel sharding", *r.memory,
              f"activations: this template's estimate is {est.memory.activations / GIB:.3g} GiB per rank at its "
              f"peak (its own attention and chunked loss, docs/ESTIMATION.md); {framework}'s kernels differ, so "
              "bench the exported job before trusting its headroom"]
    return LayoutExport(framework=framework, config=name, format=r.format, filename=r.filename, text=r.text,
                        not_expressed=r.not_expressed, memory=memory, template_model_states_gib=mine / GIB,
                        target_model_states_gib=target / GIB, template_peak_gib=est.memory.total / GIB)
