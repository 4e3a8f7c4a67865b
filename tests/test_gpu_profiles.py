"""Every common GPU has a profile, found by any common spelling through the one resolver, with PCIe links where
the card has no NVLink, and V100's missing bf16 said where a bf16 config targets it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from curry_train.estimator import estimate_memory
from curry_train.estimator.datasheets import DATASHEETS
from curry_train.estimator.profiles import PROFILES, UnknownGpu, from_device_name, get_profile

# (spellings a user types, the profile they mean)
SPELLINGS = [
    (("RTX4090", "rtx4090", "RTX 4090", "4090", "GeForce RTX 4090"), "RTX4090"),
    (("rtx3090", "RTX 3090", "3090"), "RTX3090"),
    (("RTX A6000", "a6000", "rtx-a6000"), "A6000"),
    (("L4", "nvidia l4"), "L4"), (("A10", "a10"), "A10"), (("A10G", "a10g"), "A10G"),
    (("V100-16", "v100 16gb", "V100-SXM2-16GB"), "V100-16"), (("V100-32", "V100 32GB"), "V100-32"),
    (("A100-40", "a100-40gb", "A100-SXM4-40GB"), "A100-40"), (("A100-80", "a100", "a100-80gb"), "A100-80"),
    (("A100-40-PCIe", "A100 PCIe 40GB"), "A100-40-PCIe"), (("A100-80-PCIe", "a100 80gb pcie"), "A100-80-PCIe"),
    (("H100", "h100-sxm", "NVIDIA H100 SXM5", "h100-80gb"), "H100"), (("H100-PCIe", "h100 pcie"), "H100-PCIe"),
    (("H100-NVL", "h100 nvl"), "H100-NVL"), (("H800", "h800"), "H800"), (("H200", "h200"), "H200"),
    (("B200", "b200"), "B200"), (("GB200", "gb200"), "GB200"), (("MI250X", "mi250x", "AMD Instinct MI250X"), "MI250X"),
    (("MI300X", "mi300"), "MI300X"), (("L40S",), "L40S"), (("M2-Ultra", "Apple M2 Ultra"), "M2-Ultra"),
    (("CPU", "cpu"), "CPU"),
]
PCIE_ONLY = {"RTX4090", "RTX3090", "A6000", "L4", "A10", "A10G", "A100-40-PCIe", "A100-80-PCIe", "H100-PCIe",
             "H100-NVL", "L40S"}


@pytest.mark.parametrize("spellings,name", SPELLINGS, ids=[n for _, n in SPELLINGS])
def test_every_spelling_resolves_to_its_profile(spellings, name):
    assert {get_profile(s).name for s in spellings} == {name}


def test_every_profile_has_its_numbers_and_its_datasheet():
    assert {n for _, n in SPELLINGS} == set(PROFILES) == set(DATASHEETS)
    for name, p in PROFILES.items():
        assert p.memory_gib > 0 and p.peak_tflops_bf16 > 0 and p.peak_tflops_fp32 > 0 and p.mem_bw_gbps > 0, name
        assert p.reference == DATASHEETS[name] and len(p.reference) > 60, name


def test_pcie_only_cards_get_pcie_links_and_the_server_they_come_in():
    for name in PCIE_ONLY:
        p = PROFILES[name]
        assert p.gpus_per_node in (4, 8), name
    # docs/ESTIMATION.md: busbw ~20 GB/s on PCIe Gen4, ~40 on Gen5, 12 without peer-to-peer (GeForce)
    assert {n: PROFILES[n].intra_node_gbps for n in PCIE_ONLY if PROFILES[n].intra_node_gbps != 20} == {
        "RTX4090": 12, "H100-PCIe": 40, "H100-NVL": 40}
    nvlink = [n for n in PROFILES if n not in PCIE_ONLY | {"CPU", "M2-Ultra", "MI250X"}]
    assert all(PROFILES[n].intra_node_gbps >= 130 for n in nvlink), nvlink
    assert PROFILES["GB200"].gpus_per_node == 72 and PROFILES["M2-Ultra"].gpus_per_node == 1


def test_ambiguous_and_unknown_names_are_refused_with_the_choices():
    with pytest.raises(UnknownGpu) as err:
        get_profile("V100")
    assert "ambiguous" in str(err.value) and "V100-16" in str(err.value) and "V100-32" in str(err.value)
    with pytest.raises(UnknownGpu, match="unknown GPU 'TPUv5'"):
        get_profile("TPUv5")


@pytest.mark.parametrize("device,name", [
    ("NVIDIA GeForce RTX 4090", "RTX4090"), ("NVIDIA RTX A6000", "A6000"), ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"), ("NVIDIA L4", "L4"), ("Tesla V100-SXM2-32GB", "V100-32"),
    ("NVIDIA A100-PCIE-40GB", "A100-40-PCIe"), ("NVIDIA A100-SXM4-80GB", "A100-80"),
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA H800", "H800"), ("AMD Instinct MI250X/MI250", "MI250X"), ("NVIDIA GB200", "GB200")])
def test_driver_names_find_their_profile(device, name):
    assert from_device_name(device).name == name


def test_a_bf16_config_on_v100_is_told_bf16_is_unsupported():
    e = estimate_memory("tiny", {"train.dtype": "bfloat16"}, gpu="v100-32gb")
    assert e.gpu_profile == "V100-32" and any("no bf16" in w for w in e.warnings)
    assert not any("bf16" in w for w in estimate_memory("tiny", {"train.dtype": "float32"}, gpu="V100-32").warnings)
    assert not any("no bf16" in w for w in estimate_memory("tiny", {"train.dtype": "bfloat16"}, gpu="A10").warnings)


def test_the_cli_takes_a_lowercase_consumer_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "curry_train.cli", "estimate", "--config", "tiny", "--gpu", "rtx4090",
                          "--json"], capture_output=True, text=True, check=True, cwd=tmp_path)
    e = json.loads(out.stdout)
    assert e["gpu_profile"] == "RTX4090" and e["budget_bytes"] == int(23.99 * 2**30)
