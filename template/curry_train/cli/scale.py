"""`curry-train prepare-data` and `curry-train launch-script`: the template at real scale, from the command line.

    curry-train prepare-data --text input.txt --out data/input.bin     # byte-level tokens, vocab 256
    curry-train train --config tiny --set data.path=data/input.bin
    curry-train launch-script --config llama3-8b --scheduler slurm --nodes 2 --gpus-per-node 8 > job.sbatch
    curry-train launch-script --config llama3-8b --scheduler torchrun --nodes 2 --gpus-per-node 8

prepare-data writes the nanoGPT `.bin` layout (flat uint16 ids, no header) that `data.path` memory-maps
(model/data.py); any pre-tokenized file in that layout works too (data.dtype=uint32 for vocabularies > 65536).
"""

from __future__ import annotations

import argparse

from curry_train.cli.argtypes import positive_int


def _cmd_prepare_data(a: argparse.Namespace) -> int:
    from curry_train.cli import EXIT_OK, emit
    from curry_train.model.data import prepare_text

    out = prepare_text(a.text, a.out)
    emit(out, a.json, lambda o: f"wrote {o['tokens']} byte-level tokens ({o['dtype']}, vocab {o['vocab_size']}) "
                                f"to {o['out']}; train on it with --set data.path={o['out']}")
    return EXIT_OK


SCHEDULERS = ("slurm", "torchrun")
RDZV_PORT = 29500

# NCCL settings a multi-node job most often needs, each with why (NCCL environment variables, NVIDIA NCCL docs).
NCCL_ENV = """\
# NCCL environment: uncomment what your cluster needs (NVIDIA NCCL docs, "Environment Variables").
# export NCCL_DEBUG=INFO              # log once which transport NCCL chose (IB / RoCE / sockets): check the fabric
# export NCCL_SOCKET_IFNAME=ib0       # the interface for NCCL's bootstrap and socket traffic (not docker0 / lo)
# export NCCL_IB_HCA=mlx5             # which InfiniBand adapters to use (all by default)
# export NCCL_IB_DISABLE=1            # only on clusters without InfiniBand/RoCE: fall back to TCP sockets
# export NCCL_NET_GDR_LEVEL=PHB       # GPUDirect RDMA between NIC and GPU when they share a PCIe host bridge
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective aborts the job instead of hanging it
"""


def _torchrun(cfg_arg: str, sets: list[str], nodes: int, gpn: int, endpoint: str, rdzv_id: str) -> str:
    extra = "".join(f" --set {s}" for s in sets)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {gpn} --rdzv-backend c10d --rdzv-endpoint {endpoint} "
            f"--rdzv-id {rdzv_id} -m curry_train.cli.node_train --config {cfg_arg}{extra}")


def launch_script(config: str, scheduler: str, nodes: int | None = None, gpus_per_node: int | None = None,
                  sets: list[str] | None = None, root: str | None = None) -> str:
    """The sbatch script (slurm) or the per-node torchrun commands (torchrun) for `config` on a cluster."""
    from curry_train.config import ConfigError, Problem, parse_sets
    from curry_train.measure.service import resolve

    if scheduler not in SCHEDULERS:
        raise ConfigError([Problem(fields=["--scheduler"], message=f"unknown scheduler {scheduler!r}",
                                   fix=f"use one of {', '.join(SCHEDULERS)}")])
    sets = list(sets or [])
    over = parse_sets(sets)
    if nodes:
        over["hardware.nodes"] = nodes
    if gpus_per_node:
        over["hardware.gpus_per_node"] = gpus_per_node
    cfg, name = resolve(config, over, root)
    n, g = cfg.hardware.nodes, cfg.hardware.gpus_per_node
    if cfg.world_size != n * g:
        raise ConfigError([Problem(fields=["hardware.nodes", "hardware.gpus_per_node"],
                                   message=f"the layout needs dp*tp*pp*cp = {cfg.world_size} ranks, the job would "
                                   f"start nodes*gpus_per_node = {n}*{g} = {n * g}",
                                   fix="change --nodes / --gpus-per-node or the parallel sizes so they match")])
    sets = sets + [f"hardware.nodes={n}", f"hardware.gpus_per_node={g}"] * bool(nodes or gpus_per_node)
    p = cfg.parallel
    layout = f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} zero={p.zero}" + \
        (f" dp_replicate={p.dp_replicate}" if p.dp_replicate > 1 else "")
    if scheduler == "torchrun":
        cmd = _torchrun(config, sets, n, g, f"HEAD_ADDR:{RDZV_PORT}", f"curry-{name}")
        lines = [f"# {name}: {layout} on {n} node(s) x {g} GPUs. Run the same command on every node (c10d",
                 "# rendezvous assigns node ranks); HEAD_ADDR = an address of one of the nodes, reachable from all.",
                 "# Rank 0's node keeps the run ledger (runs/).", NCCL_ENV.rstrip("\n")]
        lines += [f"# node {i}:\n{cmd}" for i in range(n)]
        return "\n".join(lines) + "\n"
    cmd = _torchrun(config, sets, n, g, f'"$head_node:{RDZV_PORT}"', '"$SLURM_JOB_ID"')
    return f"""#!/bin/bash
# {name}: {layout} on {n} node(s) x {g} GPUs (curry-train launch-script). Submit with: sbatch THIS_FILE
#SBATCH --job-name=curry-{name}
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={g}
#SBATCH --exclusive
# One task per node: its torchrun agent starts the {g} ranks of that node; the c10d rendezvous on the first node
# of the allocation joins the {n} agents (node ranks follow the join order; TP stays inside a node).
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=1
{NCCL_ENV}
# Rank 0's node keeps the run ledger (runs/ under the submit directory).
srun --ntasks-per-node=1 {cmd}
"""


def _cmd_launch_script(a: argparse.Namespace) -> int:
    print(launch_script(a.config, a.scheduler, a.nodes, a.gpus_per_node, a.set, a.root), end="")
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("prepare-data", help="write a text file as byte-level tokens (vocab 256) for data.path")
    p.add_argument("--text", required=True, help="a UTF-8 (or any) text file")
    p.add_argument("--out", required=True, help="the token file to write (e.g. data/input.bin)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(fn=_cmd_prepare_data)

    p = sub.add_parser("launch-script", help="print a Slurm sbatch script or per-node torchrun commands")
    p.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    p.add_argument("--scheduler", required=True, help=f"one of {', '.join(SCHEDULERS)}")
    p.add_argument("--nodes", type=positive_int, default=None, help="nodes (default: hardware.nodes)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (default: hardware.gpus_per_node)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
    p.add_argument("--root", default=None, help="project root holding configs/ and runs/ (default: the checkout)")
    p.set_defaults(fn=_cmd_launch_script)
