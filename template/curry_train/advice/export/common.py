"""What every export target's renderer shares: the rendered result and the estimator's per-rank counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from curry_train.config import Config
from curry_train.estimator import model_states

GIB = 2**30


@dataclass
class Rendered:
    """What one target's module returns."""

    format: str
    filename: str
    text: str
    bytes_per_param: float  # the target's model-state bytes per local parameter for this layout
    source: str  # where that figure is documented
    not_expressed: list[str] = field(default_factory=list)
    memory: list[str] = field(default_factory=list)


def local_params(cfg: Config) -> int:
    """Parameters one rank holds before any data-parallel sharding (after TP, PP and EP), on the largest rank:
    the estimator's own count, from its model states without ZeRO."""
    p = cfg.parallel.model_dump()
    p.update(zero=0, dp_replicate=1)
    flat = cfg.model_copy(update={"parallel": type(cfg.parallel).model_validate(p)})
    return max(model_states(flat, r)["params"] for r in range(cfg.parallel.pp)) // 4


def model_shape(cfg: Config) -> dict[str, Any]:
    m = cfg.model
    return {"layers": m.n_layers, "hidden": m.d_model, "ffn": m.d_ff, "heads": m.n_heads, "kv_heads": m.n_kv_heads,
            "vocab": m.vocab_size, "rope_theta": m.rope_theta, "norm_eps": m.norm_eps, "experts": m.num_experts,
            "top_k": m.top_k}


def dp_shard_group(cfg: Config) -> int:
    """Ranks a ZeRO/FSDP state shard is split over: dp*cp, divided by the HSDP replicas (wrapping.py)."""
    p = cfg.parallel
    return p.dp * p.cp // p.dp_replicate if p.zero >= 2 else p.dp * p.cp


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def toml_text(sections: dict[str, dict[str, Any]], header: str) -> str:
    """A TOML document of flat sections (what torchtitan's job files are); `header` becomes comment lines."""
    lines = [f"# {h}" for h in header.splitlines()]
    for name, items in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in items.items())]
    return "\n".join(lines) + "\n"
