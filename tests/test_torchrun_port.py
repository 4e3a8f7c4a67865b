"""launch.run_torchrun's rendezvous: torchrun's agent binds a port of its own choosing, so a port taken between
being chosen and being bound cannot stop a job (docs/CPU-DISTRIBUTED.md, quirk 10)."""

from __future__ import annotations

import socket

import pytest
from curry_train.train import launch

pytestmark = pytest.mark.torchrun  # real torchrun: its agent's bind is the subject


def test_a_port_taken_before_the_agent_binds_it_cannot_stop_the_job(tmp_path, monkeypatch):
    """free_port hands out a port another socket already listens on, which is what a job's gloo connection does
    when it takes the port between the choice and the agent's bind: the job runs all the same, because no port is
    chosen ahead (with --master-port=<that port> the agent failed with EADDRINUSE and no rank ran)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(launch, "free_port", lambda: taken)
        values = launch.run_torchrun({"kind": "selftest"}, 2, tmp_path / "run", timeout=120)
    assert [v["rank"] for v in values] == [0, 1]
    assert all(v["sum"] == 2.0 for v in values)  # the ranks' all_reduce ran over the agent's store
