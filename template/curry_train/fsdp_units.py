"""Which FSDP2 units a model gets and whether each reshards after forward: the one home of this rule.

The template (parallel/fsdp.py apply_fsdp), the estimator (estimator/layout.py and the moments built on it) and
the rules (rules/validity.py) ask these functions. Pure arithmetic, no torch, importable by the estimator.

The units, as torchtitan splits them (torchtitan/distributed/fsdp.py, apply_fsdp_to_decoder; Wang et al. 2024,
"TorchTitan", arXiv:2410.06511, §3.1), in the order they are wrapped:
  experts   a MoE block's expert shards (their own unit first: they are summed over edp_cp, expert_parallel.py)
  embed     tok_embeddings alone: gathered for its forward, then freed while the blocks run
  block     each transformer block: the all-gather of block i+1 overlaps the compute of block i
  head      [norm, output] as one unit, never resharded after forward unless the policy is "always": the
            backward needs it right after the forward ends (FSDP2 would prefetch it again at once)
  root      the model itself, last (it holds no parameter of its own once the others are wrapped)
A pipeline stage wraps the units it holds (tok_embeddings / norm / output may be None there).

parallel.fsdp_reshard (torchtitan's `reshard_after_forward_policy`) decides the embedding's, the blocks' and the
experts' reshard_after_forward on ZeRO-3:
  default   reshard after forward (ZeRO-3), except under a pipeline: there every micro-batch's forward would
            gather the stage again, so the units stay gathered from the first forward to the step's last backward
            (torch's schedule does not reshard after a pipeline backward either: pipelining/stage.py)
  always    reshard after forward even under a pipeline (one all-gather per micro-batch forward and backward)
  never     keep them gathered from forward to backward (only under a pipeline, where it is the default: without
            one it is exactly parallel.zero=2, which rules/validity.py asks for instead)
ZeRO-2 never reshards after forward (the SHARD_GRAD_OP equivalent); ZeRO-1 on FSDP2 (with TP) keeps every unit
gathered for the whole step (parallel/fsdp.py holds_step). Both take the default policy only.
"""

from __future__ import annotations

from typing import Literal

ReshardPolicy = Literal["default", "always", "never"]
RESHARD_POLICIES: tuple[str, ...] = ("default", "always", "never")
Unit = Literal["experts", "embed", "block", "head", "root"]


def reshard_after_forward(zero: int, pp: int, policy: str, unit: str) -> bool:
    """Whether FSDP unit `unit` frees its gathered parameters after its forward (fully_shard's
    reshard_after_forward) for a layout's ZeRO stage, pipeline degree and parallel.fsdp_reshard."""
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"parallel.fsdp_reshard must be one of {', '.join(RESHARD_POLICIES)}, got {policy!r}")
    if unit == "head":  # torchtitan: reshard_after_forward=(policy == "always") for [norm, output]
        return zero >= 3 and policy == "always"
    if zero < 3 or policy == "never":
        return False
    return policy == "always" or pp == 1


def blocks_reshard(zero: int, pp: int, policy: str) -> bool:
    """The blocks (and embedding, experts) reshard after forward: ZeRO-3's re-gather in backward happens."""
    return reshard_after_forward(zero, pp, policy, "block")
