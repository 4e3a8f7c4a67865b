"""probe_hardware: correct on this (GPU-less) machine, the NVML path against a fake 4-GPU NVLink box, measure=True."""

from __future__ import annotations

import sys
import types

import pytest
from curry_train.measure import hardware
from curry_train.measure.hardware import probe_hardware


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return n > 0
    except Exception:  # noqa: BLE001 - no library, no driver: a CPU machine
        return False


@pytest.mark.skipif(_has_gpu(), reason="this machine has GPUs")
def test_a_cpu_machine_reports_zero_gpus_and_its_software_stack():
    h = probe_hardware()
    assert h.gpu_count == 0 and h.gpus == [] and h.topology is None and h.source == "none"
    assert h.cpu_count >= 1 and h.memory_bytes and h.memory_bytes > 2**28
    assert h.torch_version and "gloo" in h.backends and h.measured is None


def test_launcher_and_cluster_variables_are_reported(monkeypatch):
    for k, v in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "SLURM_JOB_ID": "42", "SLURM_NNODES": "2",
                 "SLURM_JOB_NODELIST": "gpu[01-02]", "CUDA_VISIBLE_DEVICES": "", "UNRELATED": "x"}.items():
        monkeypatch.setenv(k, v)
    h = probe_hardware()
    assert h.launcher == {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8"}
    assert h.cluster["SLURM_JOB_ID"] == "42" and h.cluster["SLURM_JOB_NODELIST"] == "gpu[01-02]"
    assert "UNRELATED" not in h.cluster


class _NVMLError(Exception):
    pass


def _fake_pynvml(n: int = 4, nvlinks_per_pair: int = 2) -> types.ModuleType:
    """A DGX-like box: every GPU pair joined by `nvlinks_per_pair` links; GPUs 0-1 / 2-3 share a PCIe switch."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_NVLINK_MAX_LINKS = 18
    bus = [f"00000000:{0x10 + i:02X}:00.0" for i in range(n)]
    links = {i: [j for j in range(n) if j != i for _ in range(nvlinks_per_pair)] for i in range(n)}
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "560.35.03"
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 * 2**30)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=bus[h].encode())
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16

    def state(h, link):
        if link >= len(links[h]):
            raise _NVMLError("no such link")
        return 1

    m.nvmlDeviceGetNvLinkState = state
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(busId=bus[links[h][link]].lower())
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 10 if a // 2 == b // 2 else 50
    return m


def test_nvml_path_reports_gpus_nvlinks_and_the_topology_matrix(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(4, 2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h = probe_hardware()
    assert h.gpu_count == 4 and h.source == "nvml" and h.driver_version == "560.35.03"
    g = h.gpus[0]
    assert (g.name, g.memory_bytes, g.compute_capability, g.nvlinks) == ("NVIDIA H100 80GB HBM3", 80 * 2**30, "9.0", 6)
    assert g.pcie.generation == 5 and g.pcie.width == 16
    assert h.topology == [["X", "NV2", "NV2", "NV2"], ["NV2", "X", "NV2", "NV2"],
                          ["NV2", "NV2", "X", "NV2"], ["NV2", "NV2", "NV2", "X"]]


def test_nvml_without_nvlink_falls_back_to_pcie_levels_and_honours_visible_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(4, 0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    h = probe_hardware()
    assert h.gpu_count == 2 and h.topology == [["X", "SYS"], ["SYS", "X"]]
    assert [g.pci_bus_id for g in h.gpus] == ["00000000:11:00.0", "00000000:12:00.0"]


def test_no_driver_means_no_gpus(monkeypatch):
    fake = _fake_pynvml()

    def no_driver():
        raise _NVMLError("Driver Not Loaded")

    fake.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    h = probe_hardware()
    if h.cuda_version is None:  # CPU torch build: nothing else to ask
        assert h.gpu_count == 0 and h.source == "none"


@pytest.mark.multirank
def test_measure_times_a_matmul_and_an_all_reduce_across_two_local_ranks():
    h = probe_hardware(measure=True, timeout=240)
    m = h.measured
    assert m is not None and m.allreduce_ranks == (h.gpu_count or 2)
    assert len(m.matmul_tflops) == m.allreduce_ranks and all(t > 0 for t in m.matmul_tflops)
    assert m.allreduce_busbw_gbps and m.allreduce_busbw_gbps > 0
    assert m.backend == ("nccl" if h.gpu_count else "gloo")


def test_the_module_cli_prints_one_json_object(capsys):
    assert hardware.main(["--json"]) == 0
    import json

    assert "gpu_count" in json.loads(capsys.readouterr().out)
