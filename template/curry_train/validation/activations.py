"""Per-layer forward activations of one optimizer step, in a form every layout can sum: the white-box's localiser.

A backward bug shows in the gradients of every layer below it, so the first layer with a failing *gradient* is
almost always `tok_embeddings` whatever the origin; the forward shows the origin directly (the layers before a
forward bug compute the same outputs). Each probed module (the embedding, every transformer block, the final
norm: the residual stream between blocks) records, over all tokens of the step, the float64 sums

    S1[d] = sum_t h_t[d]        S2[d] = sum_t h_t[d]^2        N = tokens seen            h_t: [d_model]

and the parallel ranks all-reduce them over the whole world: tokens are split over dp (rows), cp (positions) and,
under sequence parallel, tp (positions); pipeline stages each hold other layers (a rank without the layer adds
zeros). A copy of the same tokens (TP without SP: every tp rank holds them all) is counted once per holder, so
the sums are divided by N / (global_batch * seq_len), the number of copies. The reference records the same sums
from its own forward over the global batch. No layout knowledge enters, so a rank that reads other tokens or
skips some shows as a wrong count.

Bounds (validation/compare.py applies them; both relative to the layer's own scale, fp32):
  ||dS1||_2 <= act_rtol * sqrt(N * sum(S2))     a relative error r per token moves S1 by <= r * sum_t ||h_t||
                                                 <= r * sqrt(N * sum_t ||h_t||^2) (Cauchy-Schwarz)
  ||dS2||_2 <= 2 * act_rtol * ||S2||_2           and S2 by ~2r of itself
Clean noise is fp32 reordering only (~1e-7 relative per token, summed in float64), far below act_rtol = 1e-4;
one rank's layer output 1% off moves S2 by ~0.5% on 2 dp ranks: 25x its bound.

Recompute (parallel/recompute.py) replaces the block's forward on the instance and recomputes it inside
backward without going through the module's __call__, so the hooks below fire once per forward, not again in
recomputation; the counts would show a second firing (2x the tokens).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

PROBE = re.compile(r"^(tok_embeddings|layers\.\d+|norm)$")  # module names (reference names) that are probed


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor output as this rank's tokens: partial sums reduced first (a collective of the module's mesh)."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import Replicate

        if any(p.is_partial() for p in t.placements):
            t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
        t = t.to_local()
    return t


class ActivationProbe:
    """Forward hooks on the probed modules of `parts`; `canonical` maps a (wrapped) module name to its reference
    name (parallelize.canonical_name on the ranks, the identity on the reference)."""

    def __init__(self, parts: list[nn.Module], d_model: int, canonical=lambda n: n):
        self.d = d_model
        self.sums: dict[str, torch.Tensor] = {}  # name -> float64 [3, d]: S1, S2, and N in [2, 0]
        self.handles = []
        self.paused = False
        for part in parts:
            for name, module in part.named_modules():
                ref = canonical(name)
                if PROBE.match(ref):
                    self.handles.append(module.register_forward_hook(self._hook(ref)))

    def _hook(self, name: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if self.paused or not torch.is_grad_enabled() or out.is_meta:  # not a forward of the step
                return
            h = _local(out).detach().reshape(-1, self.d).double().cpu()  # [tokens, d]
            acc = self.sums.setdefault(name, torch.zeros(3, self.d, dtype=torch.float64))
            acc[0] += h.sum(0)
            acc[1] += (h * h).sum(0)
            acc[2, 0] += h.shape[0]
        return hook

    def take(self, names: list[str], tokens: int) -> dict[str, torch.Tensor]:
        """This step's sums, all-reduced over the world, per copy; then reset. Every rank must call it with the
        same `names` (the reference's probed names, in order). `tokens`: global_batch * seq_len. A layer whose
        count is not a whole number of copies keeps its raw sums and the count (compare fails it)."""
        import torch.distributed as dist

        stacked = torch.stack([self.sums.get(n, torch.zeros(3, self.d, dtype=torch.float64)) for n in names])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            buf = stacked.to(dev)
            dist.all_reduce(buf)
            stacked = buf.cpu()
        self.sums = {}
        out = {}
        for n, s in zip(names, stacked):
            copies = float(s[2, 0]) / tokens
            if copies >= 1 and copies == round(copies):
                s = s.clone()
                s[:2] /= copies
                s[2, 0] = tokens
            out[n] = s
        return out

    @contextlib.contextmanager
    def skipping_pipeline_inference(self) -> Iterator[None]:
        """torch.distributed.pipelining runs each stage's forward once more in its first step, to infer the
        shapes it sends (PipelineStage._forward_metadata_inference: real inputs on stage 0, uninitialised ones
        on the others); those outputs are not the step's and are not recorded."""
        from torch.distributed.pipelining import stage

        owner = next((c for c in stage.PipelineStage.__mro__ if "_forward_metadata_inference" in vars(c)), None)
        if owner is None:
            raise RuntimeError(f"torch {torch.__version__}: PipelineStage has no _forward_metadata_inference; "
                               "validation/activations.py must learn how this version infers stage shapes")
        exact = owner._forward_metadata_inference

        def inference(stage_self, *args, **kwargs):
            self.paused = True
            try:
                return exact(stage_self, *args, **kwargs)
            finally:
                self.paused = False

        owner._forward_metadata_inference = inference
        try:
            yield
        finally:
            owner._forward_metadata_inference = exact

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def probed_names(model: nn.Module) -> list[str]:
    """The probed modules of the full (reference) model, in forward order."""
    return [n for n, _ in model.named_modules() if PROBE.match(n)]


def act_check(ref: torch.Tensor, got: torch.Tensor | None, rtol: float) -> tuple[float, float, float, str]:
    """(ratio, measured, allowed, metric) of the worse of the S1 and S2 bounds (module docstring); a wrong token
    count fails with the count as measured."""
    if got is None:
        return float("inf"), float("nan"), 0.0, "missing from the parallel run"
    if float(got[2, 0]) != float(ref[2, 0]):
        return float("inf"), float(got[2, 0]), float(ref[2, 0]), "tokens seen (all ranks, per copy)"
    n, s2 = float(ref[2, 0]), ref[1]
    d1, d2 = float((got[0] - ref[0]).norm()), float((got[1] - ref[1]).norm())
    a1 = rtol * float((n * s2.sum()).sqrt()) + 1e-30
    a2 = 2 * rtol * float(s2.norm()) + 1e-30
    if d1 / a1 >= d2 / a2:
        return d1 / a1, d1, a1, "L2 |diff| of the per-feature sum over tokens"
    return d2 / a2, d2, a2, "L2 |diff| of the per-feature sum of squares over tokens"

