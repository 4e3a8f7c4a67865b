"""The white-box verdict (torch-free, so the MCP server can use it as an output schema without importing torch)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ParamDiff(BaseModel):
    name: str
    max_abs_diff: float
    allowed: float = Field(description="The tolerance this parameter was held to (same units).")
    ref_max_abs: float
    metric: str = Field("max |diff|", description="What `measured` and `allowed` measure.")
    measured: float = Field(0.0, description="The compared quantity (same units as `allowed`).")


class Verdict(BaseModel):
    passed: bool = Field(description="True when loss, every gradient and every rank's updated parameters match "
                                     "the single-device reference within tolerance (never when nothing was "
                                     "compared).")
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
    diverging_rank: int | None = Field(None, description="Lowest rank whose copy of a parameter differs from the "
                                                         "first holder's and from the reference, at the earliest "
                                                         "step where replicas diverged (None: they never did).")
    failures: list[str] = Field(default_factory=list, description="What failed, most important first.")
    tolerance: dict[str, float]
    n_params_compared: int
    n_replica_copies: int = Field(0, description="Parameter copies held by all ranks together (every one checked: "
                                                 "checksummed across replicas, divergent ones compared).")
    bound_use: dict[str, float] = Field(default_factory=dict, description="Largest fraction of each bound used "
                                        "over every tensor and step (validation/compare.py names the checks): "
                                        "> 1 fails; a clean run's figures are its noise margins.")
    horizon: str = Field("", description="What of the lr schedule the compared steps reach (the warm-up "
                                          "boundary, the cosine floor) and the --steps that would cover the rest.")
    injection: str | None = Field(None, description="Planted bug (validation/inject.py) this run carried; the "
                                                    "verdict must then fail.")
    compiled: bool = Field(False, description="The ranks ran torch.compile'd blocks (train.compile resolved on "
                                              "their device); the reference is always eager.")
    resume: dict[str, Any] | None = Field(None, description="The resume white-box (validation/resume.py): the "
                                          "checkpoint, its step, which layout saved it and the checks run "
                                          "(saved and loaded state bitwise, step counters and lr position); None "
                                          "for a white-box from the seed.")
    routing: list[dict[str, dict[str, int]]] | None = Field(None, description="MoE in bf16 under tp/cp/ep "
                                                           "(validation/routing.py), per step and router: tokens "
                                                           "compared, discordant (other top-k set or order), flips "
                                                           "(other set), replayed (near ties), diverged. None: not "
                                                           "recorded (fp32, exact bf16 layouts).")
    run_id: str | None = None
    wall_s: float = 0.0
