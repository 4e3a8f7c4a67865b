"""The one per-rank memory model that the estimate and the measurement share, and the JSON value type of diffs.

    from curry_train.breakdown import CATEGORIES, Breakdown

Both sides split one rank's bytes at its peak into the same categories by this one contract, so a difference
between an estimate bar and a measured bar is a real disagreement, never a filing difference
(benchmarks/estimator_accuracy.py holds every category to the totals' band; docs/ESTIMATION.md "One memory model"):

  params        persistent parameters the optimizer updates (full, TP-local, or this rank's FSDP shard)
  param_copies  working copies of parameters: FSDP's all-gathered units (bf16 under its policy), casts of a parameter
  grads         the gradient storage the optimizer reads: the `.grad` tensors (full, TP-local, or the FSDP shard);
                under DDP's gradient_as_bucket_view the flat buckets themselves, from the wrap on, whether or
                not a .grad views them at that moment (after zero_grad, before the first backward)
  grad_buffers  gradient storage the optimizer never reads: FSDP's unsharded gradients (a unit's, from autograd
                until its reduce-scatter) and its unsharded accumulators across micro-batches (under PP);
                DDP's buckets when they are not .grad's storage (gradient_as_bucket_view off)
  optimizer     AdamW state this rank owns (exp_avg, exp_avg_sq, step)
  activations   forward-created tensors alive at the peak (what backward reads), recomputed ones too
  loss          what the loss's backward ops make: log_softmax's and nll's gradients, fp32 [tokens, vocab] (the
                aten ops, or under TP loss_parallel's DTensor handlers; log_softmax's saved output is an
                activation; the cast of the logits gradient back to the compute dtype is `other`)
  pp_buffers    torch.distributed.pipelining's per-micro-batch receive buffers (activations and gradients)
  other         everything else: activation gradients and backward temporaries (a weight gradient before it
                reaches .grad too), communication staging (FSDP's flat all-gather output, the reduce-scatter
                input and output until the output becomes the sharded .grad, gloo's own copy of that input),
                optimizer-step temporaries, module buffers (RoPE tables)

Producers: curry_train.estimator (`Estimate.memory`) and curry_train.measure.memory (`MemoryReport.at_peak`);
consumers: bench's `memory_breakdown`, the plots (curry_train.plots) and runs_diff (curry_train.store.runs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

CATEGORIES = ("params", "param_copies", "grads", "grad_buffers", "optimizer", "activations", "loss", "pp_buffers",
              "other")

DESCRIPTIONS = {
    "params": "Persistent parameters the optimizer updates (full, TP-local or the FSDP shard).",
    "param_copies": "Working copies of parameters: FSDP all-gathered units, casts of a parameter.",
    "grads": "The gradients the optimizer reads: .grad (full, TP-local or the FSDP shard); DDP's bucket views.",
    "grad_buffers": "FSDP's unsharded gradients / accumulators (DDP buckets only without bucket views).",
    "optimizer": "AdamW state this rank owns.",
    "activations": "Forward-created tensors alive at the peak (what backward reads), recomputed ones too.",
    "loss": "The loss gradients, fp32 [tokens, vocab] (log_softmax / nll backward, loss_parallel's too).",
    "pp_buffers": "Pipeline receive buffers (one activation / gradient buffer per micro-batch and stage).",
    "other": "Everything else: activation gradients, backward temporaries, comm staging (FSDP, gloo), module "
             "buffers.",
}

# A JSON value without nesting, typed so strict schema checkers (the MCP Inspector's portability check) see a
# type on every field: config values and metrics compared by update_config and runs_diff are scalars or lists.
Scalar = str | int | float | bool | None
JsonValue = Scalar | list[Scalar]


class Breakdown(BaseModel):
    """Bytes on one rank at the moment of its peak, by category (see the module docstring); they sum to `total`."""

    params: int = Field(0, description=DESCRIPTIONS["params"])
    param_copies: int = Field(0, description=DESCRIPTIONS["param_copies"])
    grads: int = Field(0, description=DESCRIPTIONS["grads"])
    grad_buffers: int = Field(0, description=DESCRIPTIONS["grad_buffers"])
    optimizer: int = Field(0, description=DESCRIPTIONS["optimizer"])
    activations: int = Field(0, description=DESCRIPTIONS["activations"])
    loss: int = Field(0, description=DESCRIPTIONS["loss"])
    pp_buffers: int = Field(0, description=DESCRIPTIONS["pp_buffers"])
    other: int = Field(0, description=DESCRIPTIONS["other"])

    def by_category(self) -> dict[str, int]:
        return {c: int(getattr(self, c)) for c in CATEGORIES}


def split(values: dict[str, Any]) -> dict[str, int]:
    """A mapping holding (some of) the categories -> every category in order, missing ones 0 (other keys such as
    `total` or `peak` are ignored)."""
    return {c: int(values.get(c) or 0) for c in CATEGORIES}
