"""What this machine has: accelerators and their links, CPUs, memory, software stack, launcher/cluster environment.

    curry-train probe [--measure] [--json]
    python -m curry_train.measure.hardware --json

`probe_hardware()` reads NVML (nvidia-ml-py) for GPU names, memory, compute capability and the NVLink/PCIe
topology, so it never creates a CUDA context; torch is asked only for versions and backends. `measure=True` adds
a timed matmul per device (TFLOP/s) and an all-reduce bus bandwidth across the local ranks (nccl-tests'
definition: busbw = algbw * 2(n-1)/n), launched through torchrun with the same kill-the-group deadline as every
other job. On a machine without GPUs it reports gpu_count 0 and measures the CPU with gloo ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

# Environment variables worth reporting: what torchrun sets in each rank, and what SLURM sets in a job step.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK")
CLUSTER_PREFIXES = ("SLURM_JOB_", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NODELIST", "SLURM_JOB_NODELIST",
                    "SLURM_GPUS", "SLURM_CPUS_ON_NODE", "SLURM_PROCID", "SLURM_LOCALID")
CLUSTER_VARS = ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE")

# NVML topology levels (nvmlGpuTopologyLevel_t) -> the labels `nvidia-smi topo -m` prints.
_TOPO = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class PCIeLink(BaseModel):
    generation: int | None = Field(None, description="Current PCIe link generation.")
    width: int | None = Field(None, description="Current PCIe link width (lanes).")


class GPUInfo(BaseModel):
    index: int
    name: str
    memory_bytes: int = Field(description="Total device memory.")
    compute_capability: str | None = Field(None, description="e.g. '9.0' for H100/H200.")
    pci_bus_id: str | None = None
    nvlinks: int = Field(0, description="Active NVLink links on this GPU.")
    pcie: PCIeLink | None = None


class MeasuredPerf(BaseModel):
    device: str = Field(description="cuda or cpu")
    matmul_dtype: str
    matmul_size: int = Field(description="n of the n x n x n matmul timed")
    matmul_tflops: list[float] = Field(description="Measured dense matmul TFLOP/s per local rank.")
    allreduce_ranks: int
    allreduce_bytes: int = Field(description="Message size of the timed all-reduce.")
    allreduce_busbw_gbps: float | None = Field(
        None, description="All-reduce bus bandwidth in GB/s (algbw * 2(n-1)/n, as nccl-tests); None with 1 rank.")
    backend: str


class HardwareReport(BaseModel):
    gpu_count: int = Field(description="Accelerators visible to this process (0 on a CPU-only machine).")
    gpus: list[GPUInfo] = Field(default_factory=list)
    topology: list[list[str]] | None = Field(
        None,
        description="GPU x GPU link matrix as `nvidia-smi topo -m` prints it: X, NV<n>, PIX, PXB, PHB, NODE, SYS.")
    cpu_count: int
    memory_bytes: int | None = Field(None, description="Host RAM.")
    torch_version: str | None = None
    cuda_version: str | None = Field(None, description="CUDA version torch was built with (None on a CPU build).")
    nccl_version: str | None = None
    driver_version: str | None = None
    backends: list[str] = Field(default_factory=list, description="torch.distributed backends available.")
    launcher: dict[str, str] = Field(default_factory=dict, description="torchrun variables set in this process.")
    cluster: dict[str, str] = Field(default_factory=dict, description="SLURM / MPI / device-visibility variables.")
    source: str = Field(description="Where GPU facts came from: nvml, torch, or none.")
    about: str = Field("This machine: the one the tools run on. For a cluster you plan for, ask plan / "
                       "estimate_memory instead; bench, whitebox_compare and a measured capacity_sweep check a "
                       "config against this report before launching.",
                       description="What this report describes.")
    measured: MeasuredPerf | None = None
    notes: list[str] = Field(default_factory=list)


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _env() -> tuple[dict[str, str], dict[str, str]]:
    launcher = {k: os.environ[k] for k in LAUNCHER_VARS if k in os.environ}
    cluster = {k: v for k, v in os.environ.items() if k.startswith(CLUSTER_PREFIXES) or k in CLUSTER_VARS}
    return launcher, dict(sorted(cluster.items()))


def _nvml_gpus(notes: list[str]) -> tuple[list[GPUInfo], list[list[str]] | None, str | None] | None:
    """GPUs via NVML (no CUDA context). None when NVML is absent or finds no driver."""
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia-ml-py not installed: GPU topology unavailable")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: a CPU machine
        return None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() != "":
            keep = [int(x) for x in visible.split(",") if x.strip().isdigit()]
            handles = [handles[i] for i in keep if i < len(handles)]
        gpus, bus_ids = [], []
        for i, h in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            except pynvml.NVMLError:
                cc = None
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()
            bus_ids.append(bus)
            try:
                pcie = PCIeLink(generation=pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                                width=pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            except pynvml.NVMLError:
                pcie = None
            gpus.append(GPUInfo(index=i, name=name, memory_bytes=int(mem), compute_capability=cc, pci_bus_id=bus,
                                pcie=pcie))
        # NVLink: count active links from each GPU to each peer (by the remote end's PCI bus id).
        nv = [[0] * len(handles) for _ in handles]
        for i, h in enumerate(handles):
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                except pynvml.NVMLError:
                    continue
                gpus[i].nvlinks += 1
                remote = (remote.decode() if isinstance(remote, bytes) else remote).lower()
                for j, b in enumerate(bus_ids):
                    if j != i and b[-12:] == remote[-12:]:  # NVML pads the domain differently per call
                        nv[i][j] += 1
        topo: list[list[str]] | None = None
        if len(handles) > 1:
            topo = []
            for i, hi in enumerate(handles):
                row = []
                for j, hj in enumerate(handles):
                    if i == j:
                        row.append("X")
                    elif nv[i][j]:
                        row.append(f"NV{nv[i][j]}")
                    else:
                        try:
                            row.append(_TOPO.get(pynvml.nvmlDeviceGetTopologyCommonAncestor(hi, hj), "?"))
                        except pynvml.NVMLError:
                            row.append("?")
                topo.append(row)
        return gpus, topo, driver
    finally:
        pynvml.nvmlShutdown()


def _torch_facts(notes: list[str]) -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        notes.append("torch is not importable")
        return {}
    out: dict[str, Any] = {"torch_version": torch.__version__, "cuda_version": torch.version.cuda}
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    out["backends"] = backends
    if torch.version.cuda and dist.is_nccl_available():
        try:
            v = torch.cuda.nccl.version()
            out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError):
            pass
    return out


def _torch_facts_without_import(notes: list[str]) -> dict[str, Any]:
    """torch's version, CUDA build and backends from its installed files, without importing it (which takes
    seconds): torch/version.py holds __version__ and cuda; gloo ships in every Linux build, NCCL in CUDA builds."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        notes.append("torch is not installed")
        return {}
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return _torch_facts(notes)
    get = {k: (m.group(1) if (m := re.search(rf"^{k}\s*(?::\s*\w[^=]*)?=\s*'([^']*)'", text, re.M)) else None)
           for k in ("__version__", "cuda")}
    notes.append("nccl_version is read only by probe_hardware(measure=true) (it needs torch imported)")
    return {"torch_version": get["__version__"], "cuda_version": get["cuda"],
            "backends": ["gloo", "nccl"] if get["cuda"] else ["gloo"]}


_QUICK: dict[str, HardwareReport] = {}


def local_hardware() -> HardwareReport:
    """This machine, cheaply (NVML and torch's files; no torch import, no CUDA context), cached for the life of the
    process: what the preflight checks and probe_hardware(measure=false) answer with."""
    if "report" not in _QUICK:
        notes: list[str] = []
        launcher, cluster = _env()
        nvml = _nvml_gpus(notes)
        gpus, topo, driver = nvml if nvml is not None else ([], None, None)
        _QUICK["report"] = HardwareReport(
            gpu_count=len(gpus), gpus=gpus, topology=topo, cpu_count=os.cpu_count() or 1,
            memory_bytes=_host_memory(), driver_version=driver, launcher=launcher, cluster=cluster,
            source="nvml" if nvml is not None else "none", notes=notes, **_torch_facts_without_import(notes))
    return _QUICK["report"].model_copy(deep=True)


def probe_hardware(measure: bool = False, *, timeout: float = 300.0, cancel=None) -> HardwareReport:
    """Probe this machine (cheap: NVML + versions); `measure=True` also times a matmul and an all-reduce."""
    notes: list[str] = []
    launcher, cluster = _env()
    nvml = _nvml_gpus(notes)
    facts = _torch_facts(notes)
    source, gpus, topo, driver = "none", [], None, None
    if nvml is not None:
        gpus, topo, driver = nvml
        source = "nvml"
    elif facts.get("cuda_version"):
        import torch

        if torch.cuda.is_available():  # no NVML but CUDA works: ask torch (this creates a CUDA context)
            source = "torch"
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(GPUInfo(index=i, name=p.name, memory_bytes=int(p.total_memory),
                                    compute_capability=f"{p.major}.{p.minor}"))
    report = HardwareReport(gpu_count=len(gpus), gpus=gpus, topology=topo, cpu_count=os.cpu_count() or 1,
                            memory_bytes=_host_memory(), driver_version=driver, launcher=launcher, cluster=cluster,
                            source=source, notes=notes, **facts)
    if measure:
        report.measured = measure_performance(report, timeout=timeout, cancel=cancel)
    return report


# ------------------------------------------------------------------------------------------ measurement


def measure_performance(report: HardwareReport, *, timeout: float = 300.0, cancel=None,
                        run_dir: Path | None = None) -> MeasuredPerf:
    """Launch one rank per GPU (2 gloo ranks on CPU) that time a matmul and an all-reduce."""
    import subprocess
    import tempfile

    from curry_train.train.launch import Job, local_torchrun

    nproc = report.gpu_count or min(2, report.cpu_count)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="curry_probe_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "ranks.log"
    cmd = [*local_torchrun(nproc), "-m", "curry_train.measure.hardware", "--rank-measure", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    job = Job(proc=proc, run_dir=run_dir, log_path=log_path, nproc=nproc)
    try:
        values = job.wait(timeout, cancel)
    finally:
        if job.poll() is None:
            job.kill()
    v0 = values[0]
    return MeasuredPerf(device=v0["device"], matmul_dtype=v0["dtype"], matmul_size=v0["n"],
                        matmul_tflops=[round(v["tflops"], 3) for v in values], allreduce_ranks=nproc,
                        allreduce_bytes=v0["ar_bytes"], allreduce_busbw_gbps=v0["busbw_gbps"], backend=v0["backend"])


def _rank_measure(out_dir: str) -> int:
    """One rank of `measure_performance` (under torchrun): writes rank<R>.json as rank_main does."""
    import traceback

    rank = int(os.environ.get("RANK", "0"))
    try:
        result = {"ok": True, "value": _measure_in_rank()}
    except Exception as e:  # noqa: BLE001 - top level of a rank: report to the launcher
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    tmp = Path(out_dir) / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, Path(out_dir) / f"rank{rank}.json")
    return 0 if result["ok"] else 1


def _measure_in_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev, backend, dtype, n, ar_numel = torch.device("cuda", local), "nccl", torch.bfloat16, 8192, 64 * 2**20
    else:
        torch.set_num_threads(1)
        dev, backend, dtype, n, ar_numel = torch.device("cpu"), "gloo", torch.float32, 384, 4 * 2**20

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(2):
        a @ b
    sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    tflops = 2 * n**3 / statistics.median(times) / 1e12
    del a, b
    world = int(os.environ.get("WORLD_SIZE", "1"))
    busbw = None
    ar_bytes = ar_numel * 4
    if world > 1:
        dist.init_process_group(backend)
        x = torch.ones(ar_numel, device=dev, dtype=torch.float32)
        dist.all_reduce(x)
        sync()
        ts = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            sync()
            ts.append(time.perf_counter() - t0)
        algbw = ar_bytes / statistics.median(ts)
        busbw = algbw * 2 * (world - 1) / world / 1e9
        dist.destroy_process_group()
    return {"device": dev.type, "dtype": str(dtype).replace("torch.", ""), "n": n, "tflops": tflops,
            "ar_bytes": ar_bytes, "busbw_gbps": busbw, "backend": backend}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Probe this machine's accelerators, links and software stack.")
    ap.add_argument("--measure", action="store_true", help="also time a matmul and an all-reduce (launches ranks)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank-measure", metavar="OUT_DIR", help=argparse.SUPPRESS)  # internal: one torchrun rank
    a = ap.parse_args(argv)
    if a.rank_measure:
        return _rank_measure(a.rank_measure)
    rep = probe_hardware(measure=a.measure)
    print(rep.model_dump_json(indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
