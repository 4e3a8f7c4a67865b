"""Where each hardware profile's numbers come from (estimator/profiles.py): one source string per profile name.

    python -c "from curry_train.estimator.datasheets import DATASHEETS; print(DATASHEETS['RTX4090'])"

Vendor datasheet peaks are dense (no 2:4 sparsity); a sheet that quotes only the sparse figure is halved and says
so. GeForce cards run bf16/fp16 tensor math with fp32 accumulation at half their fp16-accumulate rate (the Ada and
GA102 whitepapers list both): training accumulates in fp32, so that is the peak used. Link figures that no sheet
gives (PCIe busbw, the network of a workstation or a cloud PCIe server) are labelled as assumptions here and in
profiles.py's comments.
"""

from __future__ import annotations

_PCIE = "no NVLink: collectives over PCIe"
_A100 = ("NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): 312 TFLOP/s bf16 dense, 19.5 fp32, "
         "1,555 / 2,039 GB/s HBM2e (40 / 80 GB SXM4), NVLink3 600 GB/s bidirectional; DGX A100: 8 GPUs, "
         "8 x 200 Gb/s HDR InfiniBand")
_A100_PCIE = ("NVIDIA A100 datasheet (PCIe): 312 TFLOP/s bf16 dense, 19.5 fp32, 1,555 / 1,935 GB/s (40 / 80 GB), "
              f"{_PCIE} Gen4 64 GB/s bidirectional (bridges join pairs only); 8-GPU PCIe servers, 100 Gb/s assumed")
_H100_PCIE = ("NVIDIA H100 Tensor Core GPU datasheet: PCIe 756 TFLOP/s bf16 dense, 51 fp32, 80 GB HBM2e at 2 TB/s; "
              "NVL 835 dense, 60 fp32, 94 GB HBM3 at 3.9 TB/s; PCIe Gen5 128 GB/s bidirectional (NVLink bridges "
              "join pairs only, 600 GB/s); 8-GPU PCIe servers, 200 Gb/s per GPU assumed")
_V100 = ("NVIDIA Tesla V100 datasheet (SXM2): 125 TFLOP/s fp16 tensor (no bf16), 15.7 fp32, 16 / 32 GB HBM2 at "
         "900 GB/s, NVLink2 300 GB/s; DGX-1: 8 GPUs (hybrid cube-mesh), 4 x 100 Gb/s EDR InfiniBand per node")

DATASHEETS: dict[str, str] = {
    "RTX4090": "NVIDIA Ada GPU architecture whitepaper (v2.02), GeForce RTX 4090: 165.2 TFLOP/s bf16/fp16 tensor "
               f"(fp32 accumulate, dense), 82.6 fp32, 24 GB GDDR6X at 1,008 GB/s; {_PCIE} Gen4, no P2P",
    "RTX3090": "NVIDIA Ampere GA102 GPU architecture whitepaper (v2.0), GeForce RTX 3090: 71 TFLOP/s bf16/fp16 "
               "tensor (fp32 accumulate, dense), 35.6 fp32, 24 GB GDDR6X at 936 GB/s; PCIe Gen4 (an NVLink bridge "
               "joins pairs only, 112.5 GB/s)",
    "A6000": "NVIDIA RTX A6000 datasheet: 309.7 TFLOP/s tensor with sparsity (154.8 dense), 38.7 fp32, 48 GB GDDR6 "
             "at 768 GB/s; PCIe Gen4 (NVLink bridge joins pairs only, 112.5 GB/s); 8-GPU workstation servers",
    "L4": "NVIDIA L4 datasheet: 242 TFLOP/s bf16 with sparsity (121 dense), 30.3 fp32, 24 GB GDDR6 at 300 GB/s; "
          f"{_PCIE} Gen4 x16; GCP g2-standard-96: 8 L4, 100 Gb/s",
    "A10": "NVIDIA A10 datasheet: 125 TFLOP/s bf16 dense (250 sparse), 31.2 fp32, 24 GB GDDR6 at 600 GB/s; "
           f"{_PCIE} Gen4; e.g. OCI BM.GPU.A10.4: 4 GPUs",
    "A10G": "AWS EC2 G5 (A10G; NVIDIA publishes no datasheet, figures as compared in Baseten's 'NVIDIA A10 vs A10G'): "
            f"~70 TFLOP/s bf16 tensor dense, 31.2 fp32, 24 GB GDDR6 at 600 GB/s; {_PCIE} Gen4; g5.48xlarge: 8 GPUs, "
            "100 Gb/s",
    "V100-16": _V100,
    "V100-32": _V100,
    "A100-40-PCIe": _A100_PCIE,
    "A100-80-PCIe": _A100_PCIE,
    "H100-PCIe": _H100_PCIE,
    "H100-NVL": _H100_PCIE,
    "H800": "NVIDIA H800 SXM5 (export variant of H100 SXM5): H100 compute (989 TFLOP/s bf16 dense, 67 fp32), 80 GB "
            "HBM3 at 3.35 TB/s, NVLink 400 GB/s bidirectional; DeepSeek-V3 report (arXiv:2412.19437 sec. 3.2): 8 "
            "per node, InfiniBand 50 GB/s per GPU",
    "A100-40": _A100,
    "A100-80": _A100,
    "H100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense, 67 fp32, 3.35 TB/s HBM3, NVLink4 "
            "900 GB/s bidirectional; DGX H100: 8 GPUs, 8 x 400 Gb/s NDR (ConnectX-7)",
    "H200": "NVIDIA H200 datasheet (SXM): H100 compute (989 TFLOP/s bf16 dense, 67 fp32), 141 GB HBM3e at 4.8 TB/s, "
            "NVLink4 900 GB/s; HGX H200: 8 GPUs, 400 Gb/s per GPU",
    "B200": "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s bf16 dense per GPU (4.5 sparse), 75 TFLOP/s fp32, 180 GB HBM3e "
            "at 7.7-8 TB/s, NVLink5 1.8 TB/s bidirectional; DGX B200: 8 GPUs, 8 x 400 Gb/s ConnectX-7",
    "GB200": "NVIDIA GB200 NVL72 datasheet: 360 PFLOP/s fp16/bf16 with sparsity over 72 GPUs (2.5 PFLOP/s dense per "
             "GPU), 5,760 TFLOP/s fp32 (80 per GPU), 13.4 TB HBM3e at 576 TB/s (8 TB/s per GPU), NVLink5 1.8 TB/s "
             "per GPU across the 72-GPU domain; ConnectX-8 800 Gb/s per GPU",
    "MI250X": "AMD Instinct MI250X data sheet: 383 TFLOP/s bf16 dense, 47.9 fp32 vector, 128 GB HBM2e at 3.2 TB/s "
              "over 2 GCDs (halved here: one GCD per device), Infinity Fabric 50-100 GB/s between GCDs; Frontier "
              "node: 4 MI250X = 8 GCDs, 4 x 200 Gb/s Slingshot",
    "MI300X": "AMD Instinct MI300X data sheet: 1,307.4 TFLOP/s bf16 dense, 163.4 fp32 (vector), 192 GB HBM3 at "
              "5.3 TB/s, 7 Infinity Fabric links x 64 GB/s per direction (fully connected 8-GPU OAM platform); "
              "typical clusters 400 Gb/s per GPU (e.g. Azure ND MI300X v5: 8 x 400 Gb/s NDR)",
    "L40S": "NVIDIA L40S datasheet: 362 TFLOP/s bf16 dense (733 sparse), 91.6 fp32, 48 GB GDDR6 at 864 GB/s, no "
            "NVLink (PCIe Gen4 x16: 32 GB/s per direction); OVX/PCIe servers: 4-8 GPUs, ~100 Gb/s per GPU assumed",
    "M2-Ultra": "Apple M2 Ultra (Mac Studio / Mac Pro, 2023): 76-core GPU, 192 GB unified memory at 800 GB/s; one "
                "device per machine (torch 'mps': estimate only, this template trains on cuda or cpu)",
    "CPU": "a gloo-over-loopback development box: exercises the code path only; its numbers are not an "
           "accelerator's",
}
