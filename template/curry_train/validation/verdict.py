"""The white-box verdict (torch-free, so the MCP server can use it as an output schema without importing torch)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ParamDiff(BaseModel):
    name: str
    max_abs_diff: float
    allowed: float = Field(description="The tolerance this parameter was held to (same units).")
    ref_max_abs: float


class Verdict(BaseModel):
    passed: bool = Field(description="True when loss, every gradient and every updated parameter match the "
                                     "single-device reference within tolerance.")
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    world_size: int
    steps: int
    losses_ref: list[float]
    losses_parallel: list[float]
    loss_max_diff: float
    grad_norm_ref: list[float]
    grad_norm_parallel: list[float]
    worst_parameter: ParamDiff | None = Field(description="Largest diff/allowed ratio over grads and params.")
    first_diverging_layer: str | None = Field(description="Earliest module (forward order) with a failing tensor.")
    failures: list[str] = Field(default_factory=list, description="What failed, most important first.")
    tolerance: dict[str, float]
    n_params_compared: int
    run_id: str | None = None
    wall_s: float = 0.0
