"""torch.compile per transformer block (train.compile): step 4b of parallel/parallelize.py, after recompute and
before FSDP/DDP, as torchtitan's apply_compile places it.

    curry-train whitebox --config configs/tiny.yaml --set train.compile=true --json

Why per block and not the whole model: every block has the same structure, so dynamo traces one graph and reuses
it for all L blocks (guards on the parameters' metadata, not on which block they belong to; measured on tiny: one
unique graph for 4 blocks), and the embedding, the chunked loss and the data-parallel wrapper stay eager.
Why after recompute: the compiled region then contains the block's activation checkpoint, which dynamo traces as
one higher-order op, so the recomputation in backward runs the compiled kernels too (torchtitan compiles the
AC-wrapped block). Why before FSDP/DDP: their hooks are registered on the block *module* around its call, while
this step replaces only the block's `forward` on the instance (as recompute does), so the all-gather and
reduce-scatter hooks stay eager, outside the graph, and parameter names do not change (no `_orig_mod.` wrapper).

MoE blocks: only their dense parts are compiled (attention_norm, attention, ffn_norm). The MoE layer reads its
routing counts back to the host (`moe.MoE._run_experts`: the all-to-all's split sizes are Python ints) and keeps
host-side counters: compiled whole, dynamo graph-breaks there (`aten._local_scalar_dense`). Measured on torch
2.13 CPU (tiny-moe, whole block, default dynamo config): 13 graphs and a recompile per value of the host counter
until the recompile limit sent the blocks back to eager. `capture_scalar_outputs = True` would trace through the
read instead, at the price of unbacked symbolic row counts in every later shape (not tried here). The dense parts
alone compile and match the reference (tests/parallel/test_compile.py; tiny-moe 1 rank and dp2 ep2 measured).

Resolution of `train.compile` (`compile_enabled`): auto = on for CUDA, off for CPU. Every layout compiles on torch
2.13 (white-boxed: tests/parallel/test_compile.py), TP included (torchtitan compiles its TP blocks too) once the
first block's input is a plain tensor (`_waited`); until then TP was refused with train.compile=true. On CPU
inductor generates C++ (it needs a C++ compiler at run time) and the first compile of the tiny model takes seconds
(tens of seconds on a loaded 2-core machine); the CPU tracker the estimator is calibrated on runs the eager kernels
(docs/ESTIMATION.md), so the CPU default stays eager and `train.compile=true` opts in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from curry_train.config import Config


def compile_enabled(cfg: Config) -> bool:
    """`train.compile` resolved for the device this config runs on: auto = CUDA."""
    from curry_train.mesh import device_type

    setting = cfg.train.compile
    if setting == "auto":
        return device_type(cfg) == "cuda"
    return bool(setting)


def _compile_forward(module: nn.Module) -> None:
    # An instance attribute shadows the class's forward (the one recompute may already have replaced): module
    # hooks, FSDP's included, keep running eagerly around the compiled call.
    compiled = torch.compile(module.forward)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return compiled(_waited(x), *args, **kwargs)

    module.forward = forward


def _waited(x: torch.Tensor) -> torch.Tensor:
    """A block's input as a plain tensor. Under TP without SP the embedding hands the first block the output of its
    functional all-reduce still wrapped (AsyncCollectiveTensor, DTensor.to_local of RowwiseParallel's Replicate
    output); given that wrapper as an input, the compiled region's backward returns the input's gradient as a plain
    tensor to DTensor's redistribute backward, which needs a DTensor (torch 2.13: AttributeError '_local_tensor' in
    the first backward). An op on the wrapper waits for the collective and returns a plain tensor with the wrapper
    as its autograd input, so the gradient reaches redistribute through to_local's backward, as in eager: one copy
    of the hidden state [mb, T, D], at the first block only (the others get the compiled blocks' plain outputs)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if type(x) is AsyncCollectiveTensor else x


def apply_compile(model: nn.Module, mesh: Any, cfg: Config) -> bool:
    """Compile every transformer block of `model` (a full model or a pipeline stage) in place; returns whether
    it did (False when `train.compile` resolves to off). `mesh` is unused: the compiled regions hold no
    collective of their own beyond what TP's DTensors dispatch."""
    if not compile_enabled(cfg):
        return False
    from curry_train.model.moe import MoE

    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            for dense in (block.attention_norm, block.attention, block.ffn_norm):
                _compile_forward(dense)
        else:
            _compile_forward(block)
    return True
