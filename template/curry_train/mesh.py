"""Topology: the parallel sizes as an explicit, validated object, and the named DeviceMesh built from it.

Rank layout (tp fastest, so a TP group sits inside one node, pp slowest, so stages cross nodes):
    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
Size-1 axes are the identity, so the single-device reference and every parallel run share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from curry_train.config import Config, validate_config
from curry_train.rules import ep_spans_tp
from curry_train.wrapping import expert_replicas

AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Topology:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # carved from dp (from dp x tp when tp > 1: ep_over_tp): experts are sharded over ep ranks

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}={getattr(self, axis)} must be >= 1")
        if self.ep_over_tp and (self.dp * self.tp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*tp={self.dp * self.tp} (with tp > 1 EP is carved from "
                             "the dp x tp ranks)")
        if not self.ep_over_tp and self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (EP is carved from the data-parallel ranks)")

    @property
    def ep_over_tp(self) -> bool:
        """EP groups carved from the dp x tp ranks (rules.ep_spans_tp: tp > 1 and ep > 1; ep > 1 means experts)."""
        return ep_spans_tp(1, self.tp, self.ep)

    @classmethod
    def from_config(cls, cfg: Config) -> Topology:
        validate_config(cfg)
        p = cfg.parallel
        return cls(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank, e.g. {"pp": 0, "dp": 1, "cp": 0, "tp": 1}."""
        out = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return {a: out[a] for a in AXES}


def device_type(cfg: Config) -> str:
    """`hardware.device` resolved: auto picks cuda only when torch sees a GPU."""
    if cfg.hardware.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.hardware.device


def node_layout(topo: Topology, cfg: Config, local_world: int) -> list[str]:
    """What is wrong with this rank order on nodes of `local_world` ranks (torchrun's LOCAL_WORLD_SIZE): errors
    (TP, then CP, must sit inside a node; torchrun numbers ranks node by node, and tp is the fastest axis of the
    rank order) and warnings (hardware.gpus_per_node is what the estimator priced the links with). Empty on one
    node."""
    if local_world <= 0 or topo.world_size <= local_world:
        return []
    out = []
    if local_world % topo.tp:
        out.append(f"error: parallel.tp={topo.tp} does not divide the {local_world} ranks per node "
                   "(LOCAL_WORLD_SIZE): TP groups would straddle nodes; use a tp that divides gpus per node")
    elif topo.cp > 1 and local_world % (topo.tp * topo.cp):
        out.append(f"warning: tp*cp={topo.tp * topo.cp} does not divide the {local_world} ranks per node: "
                   "context-parallel rings cross nodes")
    if cfg.hardware.gpus_per_node != local_world:
        out.append(f"warning: hardware.gpus_per_node={cfg.hardware.gpus_per_node} but the launcher started "
                   f"{local_world} ranks per node: the estimate priced intra/inter-node links for another layout")
    return out


def build_mesh(topo: Topology, device: str, *, dp_replicate: int = 1, experts: bool = False):
    """4-D DeviceMesh named ("pp", "dp", "cp", "tp") with every view the layout uses built here, up front.

    Creating a process group is a collective that every rank must enter in the same order, so every sub-mesh is
    created here, in one fixed order, and never later: the pp mesh (pp_mesh), the dp x cp gradient mesh
    (dp_cp_mesh), HSDP's 2-D mesh when dp_replicate > 1 (fsdp_mesh), the expert meshes when the model has experts
    or ep > 1 (ep_meshes). The accessors below only read what was built. Every rank must call it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (topo.pp, topo.dp, topo.cp, topo.tp), mesh_dim_names=AXES)
    flat = mesh["dp", "cp"]._flatten("dp_cp")  # dp-major, cp-minor: index dp_i * cp + cp_i
    # the pp view too: slicing a DeviceMesh builds a new one each time (reading its rank map on the host), which
    # the per-step code (the clip norm's and the loss's reductions over pp) must not do
    views: dict[str, Any] = {"dp_cp": flat, "pp": mesh["pp"]}
    if dp_replicate > 1:
        n = flat.size()
        views["fsdp", dp_replicate] = flat._unflatten("dp_cp", (dp_replicate, n // dp_replicate),
                                                      ("dp_replicate", "dp_shard_cp"))
    if topo.ep_over_tp:  # cp = 1 (sp and cp exclude each other): the dp x tp ranks, tp fastest, into (edp, ep)
        dp_tp = mesh["dp", "tp"]._flatten("dp_tp")
        full = dp_tp._unflatten("dp_tp", (topo.dp * topo.tp // topo.ep, topo.ep), ("edp", "ep"))
        views["ep", topo.ep] = (full["ep"], full["edp"])
    elif experts or topo.ep > 1:
        full = mesh._unflatten("dp", (topo.dp // topo.ep, topo.ep), ("edp", "ep"))  # ("pp", "edp", "ep", "cp", "tp")
        edp_cp = full["edp", "cp"]._flatten("edp_cp")
        views["ep", topo.ep] = (full["ep"], edp_cp)
        reps = expert_replicas(topo.dp, topo.cp, topo.ep, dp_replicate)  # wrapping.py; None is refused by rules
        if reps and reps > 1:  # HSDP: the expert holders as (replicas, shard), as fsdp_mesh is for the rest
            views["ep_fsdp", topo.ep, dp_replicate] = edp_cp._unflatten(
                "edp_cp", (reps, edp_cp.size() // reps), ("edp_replicate", "edp_shard_cp"))
    mesh.__dict__[_VIEWS] = views
    return mesh


_VIEWS = "_curry_views"


def _view(mesh, key: Any, what: str):
    views = mesh.__dict__.get(_VIEWS)
    if views is None or key not in views:
        raise ValueError(f"the mesh has no {what} view: build it with mesh.build_mesh(topo, device, "
                         "dp_replicate=..., experts=...), which creates every view up front")
    return views[key]


def process_groups(mesh) -> list:
    """Every process group build_mesh created, once each: each dimension of the mesh and of every view it built
    (the flattened dp x cp, the pp view, HSDP's replicate and shard groups, EP's ep and edp x cp groups)."""
    meshes = [mesh]
    for v in (mesh.__dict__.get(_VIEWS) or {}).values():
        meshes += list(v) if isinstance(v, tuple) else [v]
    out: list = []
    for m in meshes:
        for i in range(m.ndim):
            g = m.get_group(i)
            if all(g is not x for x in out):
                out.append(g)
    return out


def expert_rank_grid(topo: Topology) -> torch.Tensor:
    """Global ranks [pp, edp, ep, cp, tp]: build_mesh's row-major (pp, dp, cp, tp) order with dp unflattened into
    (edp, ep), ep fastest, as ep_meshes does; for code that needs the layout without creating process groups.
    With ep_over_tp the dp x tp ranks are unflattened instead, so the grid is [pp, edp, ep, 1, 1]."""
    ranks = torch.arange(topo.world_size)
    if topo.ep_over_tp:
        return ranks.view(topo.pp, topo.dp * topo.tp // topo.ep, topo.ep, 1, 1)
    return ranks.view(topo.pp, topo.dp // topo.ep, topo.ep, topo.cp, topo.tp)


def pp_mesh(mesh):
    """The 1-D pipeline mesh (the ranks holding the other stages of the same rows), sliced once by build_mesh."""
    return _view(mesh, "pp", "pp")


def dp_cp_mesh(mesh):
    """The 1-D mesh over which gradients are averaged: data-parallel ranks and context-parallel ranks together
    (CP ranks hold different tokens of the same sequences, so their gradients are summed like DP's)."""
    return _view(mesh, "dp_cp", "dp x cp")


def fsdp_mesh(mesh, dp_replicate: int = 1):
    """The mesh FSDP2 shards over: dp x cp (1-D), or for HSDP the 2-D ("dp_replicate", "dp_shard_cp") mesh.

    HSDP (Zhao et al. 2023, "PyTorch FSDP", §3.2.2 hybrid sharding; torchtitan's dp_replicate x dp_shard):
    The dp x cp ranks are unflattened into (dp_replicate, dp_shard_cp), replicas slowest, so a shard group is
    dp/dp_replicate consecutive dp ranks times the cp ranks: with TP (then CP) innermost in the rank order, it stays
    inside a node when tp * cp * dp_shard <= gpus_per_node. FSDP2 given a 2-D mesh replicates on dim 0 and shards on
    dim 1: all-gather / reduce-scatter inside the shard group, then an all-reduce of the gradient shards across the
    replicas. Built by build_mesh(..., dp_replicate=...).
    """
    if dp_replicate == 1:
        return dp_cp_mesh(mesh)
    return _view(mesh, ("fsdp", dp_replicate), f"HSDP (dp_replicate={dp_replicate})")


def ep_meshes(mesh, ep: int):
    """(ep mesh, edp_cp mesh) for expert parallelism, carved from the dp axis (built by build_mesh).

    dp is unflattened into ("edp", "ep") with ep fastest, so ep *consecutive* dp ranks form an EP group and
    hold all E experts between them. "edp_cp" = the ranks holding the *same* experts (dp/ep of them per cp
    rank, times cp): expert gradients are summed there, while the other parameters use dp_cp_mesh.

    With tp > 1 (Topology.ep_over_tp; Megatron-LM's expert-tensor-parallel size 1, whose expert rank order
    is tp fastest, then ep, then dp) the flattened dp x tp ranks are unflattened instead: an EP group takes
    the tp ranks first (inside a node) and the second mesh is the dp*tp/ep ranks holding the same experts.
    Every one of those ranks routes distinct tokens (its T/tp sequence shard, sequence parallel).
    """
    return _view(mesh, ("ep", ep), f"expert (ep={ep})")


def expert_fsdp_mesh(mesh, ep: int, dp_replicate: int = 1):
    """The mesh FSDP2 shards an expert unit over: edp_cp (ep_meshes), or under HSDP its 2-D (edp_replicate,
    edp_shard_cp) form (wrapping.expert_replicas): the expert holders inside one HSDP replica group shard, the
    replica groups all-reduce, so the expert collectives cross the same links as the dense ones."""
    if ("ep_fsdp", ep, dp_replicate) in mesh.__dict__.get(_VIEWS, {}):  # built when the experts have replicas
        return _view(mesh, ("ep_fsdp", ep, dp_replicate), "expert HSDP")
    return ep_meshes(mesh, ep)[1]
