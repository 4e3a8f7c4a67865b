"""Multi-node on one machine: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) run the cluster
entry (`curry_train.cli.node_train`, what `curry-train launch-script` prints) at dp2 tp2 zero3 with
hardware.nodes=2, gpus_per_node=2: TP inside each "node", the losses of the single-device reference, one ledger
row written by the agent that holds rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from curry_train.config import load_config
from curry_train.mesh import Topology, node_layout
from curry_train.store.runs import Ledger
from curry_train.train.launch import free_port
from curry_train.validation.whitebox import reference

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
SETS = {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3, "hardware.nodes": 2, "hardware.gpus_per_node": 2,
        "train.steps": 3}


def test_node_layout_keeps_tp_inside_a_node():
    cfg = load_config(TINY, SETS)
    assert node_layout(Topology.from_config(cfg), cfg, 2) == []
    odd = load_config(TINY, {**SETS, "parallel.tp": 4, "parallel.dp": 1, "hardware.gpus_per_node": 4})
    assert node_layout(Topology.from_config(odd), odd, 3)[0].startswith("error: parallel.tp=4 does not divide")
    assert node_layout(Topology.from_config(cfg), cfg, 4) == []  # one node holds every rank: nothing to check
    priced = load_config(TINY, {**SETS, "hardware.gpus_per_node": 4, "hardware.nodes": 1})
    assert node_layout(Topology.from_config(priced), priced, 2) == [
        "warning: hardware.gpus_per_node=4 but the launcher started 2 ranks per node: the estimate priced "
        "intra/inter-node links for another layout"]


def test_launch_script_prints_sbatch_and_torchrun_and_refuses_unknown_schedulers(capsys):
    from curry_train.cli import main

    sets = [x for k, v in SETS.items() if k.startswith("parallel") for x in ("--set", f"{k}={v}")]
    assert main(["launch-script", "--config", "tiny", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node",
                 "2", *sets]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in script and "--ntasks-per-node=1" in script
    assert "srun" in script and "--rdzv-backend c10d" in script and "NCCL_SOCKET_IFNAME" in script
    assert main(["launch-script", "--config", "tiny", "--scheduler", "torchrun", "--nodes", "2",
                 "--gpus-per-node", "2", *sets]) == 0
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torchrun")]
    assert len(cmds) == 2 and "--nnodes 2 --nproc-per-node 2" in cmds[0]
    assert main(["launch-script", "--config", "tiny", "--scheduler", "pbs"]) == 2
    assert "use one of slurm, torchrun" in capsys.readouterr().err
    assert main(["launch-script", "--config", "tiny", "--scheduler", "slurm", "--nodes", "3", "--gpus-per-node",
                 "2", *sets]) == 2  # 4 ranks cannot fill 3 x 2 GPUs
    assert "nodes*gpus_per_node" in capsys.readouterr().err


@pytest.mark.multirank
@pytest.mark.slow
def test_two_torchrun_agents_match_the_single_device_reference(project, tmp_path):
    port = free_port()
    sets = [x for k, v in SETS.items() for x in ("--set", f"{k}={v}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = []
    t0 = time.perf_counter()
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-agents",
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--max-restarts", "0",
               "-m", "curry_train.cli.node_train", "--config", "tiny", "--root", str(project), *sets]
        log = open(tmp_path / f"agent{node}.log", "wb")
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=tmp_path))
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=600)[0].decode())
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    wall = time.perf_counter() - t0
    logs = [(tmp_path / f"agent{n}.log").read_text(errors="replace")[-3000:] for n in range(2)]
    assert [a.returncode for a in agents] == [0, 0], logs
    lines = [ln for o in outs for ln in o.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, outs  # only rank 0 reports
    got = json.loads(lines[0])
    ref = reference(load_config(TINY, SETS), SETS["train.steps"])["losses"]
    assert got["losses"] == pytest.approx(ref, rel=1e-5), (got["losses"], ref)
    runs = Ledger(project).list(10)
    assert [(r.run_id, r.status) for r in runs] == [(got["run_id"], "ok")]
    print(json.dumps({"wall_s": round(wall, 1), "losses": got["losses"], "reference": ref}))
