"""memory.measure_memory: exact per-rank bytes by category, and the ZeRO / recompute savings read off the measurement.

Measured on configs/tiny.yaml (N = 180,800 params, micro-batch 2 x 64 tokens, fp32), dp = 4, bytes per rank
(rank 0; ZeRO-1's optimizer share differs by rank: 362,024 / 361,508 / 361,512 / 361,512):

  zero recompute    params  param_copies    grads  grad_buffers  optimizer  activations   other      peak
  0    none        723,200             0  723,200             0  1,446,556    2,882,576  264,208  6,039,736
  1    none        723,200             0  723,200             0    362,024    2,882,576  264,208  4,955,204
  2    none        180,800       723,200  180,800       213,760    361,756    2,882,576  400,528  4,412,536
  3    none        180,800       279,296  180,800       213,760    361,756    2,882,576  548,496  3,886,968
  0    full        723,200             0  723,200             0  1,446,556      867,852  264,208  4,370,872
  1    full        723,200             0  723,200             0    362,024      867,852  264,208  3,286,340
  2    full        180,800       723,200  180,800       213,760    361,756      867,852  400,528  2,402,296
  3    full        180,800       279,296  180,800       213,760    361,756      867,852  548,496  2,258,552

Reading it: optimizer / 4 from zero 0 to 1; grads / 4 from 1 to 2; ZeRO-2 still holds a full working copy of the
parameters through forward and backward (param_copies = 4N bytes, the "params" of the ZeRO paper's stage 2),
which ZeRO-3 replaces by the 1/4 shard plus the units in flight (at most root + one block = 279,296); DDP's buckets
are the grads (zero 0/1: the .grad tensors are views into them), grad_buffers is FSDP's unsharded grads of a unit
before its reduce-scatter (2/3).
"""

from __future__ import annotations

import pytest
import torch
from curry_train.config import load_config
from curry_train.measure.memory import CATEGORIES, measure_memory, memory_spec
from curry_train.model.gpt import build_model
from curry_train.train.jobs import JOBS, job_function, rank_jobs
from curry_train.train.launch import launch_forkserver

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
F32 = 4


@pytest.fixture
def one_thread():
    """measure_memory sets 1 thread (as a rank does); give the test process its thread count back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _param_bytes(cfg, prefix: str = "") -> int:
    return sum(p.numel() for n, p in build_model(cfg).named_parameters() if n.startswith(prefix)) * F32


@pytest.mark.multirank
def test_zero_stages_shrink_optimizer_grads_and_params_fourfold_at_four_ranks():
    grid = [(z, r) for r in ("none", "full") for z in (0, 1, 2, 3)]
    cfgs = [load_config(TINY, {"parallel.dp": 4, "parallel.zero": z, "parallel.recompute": r}) for z, r in grid]
    specs = [memory_spec(c) for c in cfgs]
    per_rank = launch_forkserver(rank_jobs, 4, specs)  # [rank][config] -> MemoryReport dict
    m = {key: [per_rank[r][i] for r in range(4)] for i, key in enumerate(grid)}
    print("\nzero recompute " + " ".join(f"{c:>12}" for c in (*CATEGORIES, "peak")))
    for (z, r), reps in m.items():
        print(f"{z:4} {r:9} " + " ".join(f"{reps[0][c]:12,}" for c in (*CATEGORIES, "peak")))

    n_bytes = _param_bytes(cfgs[0])
    root = n_bytes - _param_bytes(cfgs[0], "layers.")  # embedding, final norm, LM head: FSDP's root unit
    for reps in m.values():
        for rep in reps:
            assert sum(rep["at_peak"].values()) == rep["peak"] <= sum(rep[c] for c in CATEGORIES)
    for r in ("none", "full"):
        z0, z1, z2, z3 = (m[z, r] for z in range(4))
        # ZeRO-1: the state is partitioned whole-parameter-wise, so the ranks' shares add up to DDP's exactly
        # and each is 1/4 up to the largest parameter's state (2 fp32 moments + the step scalar).
        assert sum(rep["optimizer"] for rep in z1) == z0[0]["optimizer"]
        largest = max(p.numel() for p in build_model(cfgs[0]).parameters()) * 2 * F32 + F32
        assert max(rep["optimizer"] for rep in z1) <= z0[0]["optimizer"] / 4 + largest
        assert z0[0]["optimizer"] / max(rep["optimizer"] for rep in z1) > 3.9
        # ZeRO-2: gradients sharded (every dim 0 of tiny divides by 4: no padding).
        assert z1[0]["grads"] == z0[0]["grads"] == n_bytes
        assert 4 * z2[0]["grads"] == z1[0]["grads"]
        assert z0[0]["grad_buffers"] == z1[0]["grad_buffers"] == 0  # the buckets are the grads (breakdown.py)
        assert 0 < z2[0]["grad_buffers"] < n_bytes
        # Parameters: ZeRO-0/1 replicate them; FSDP2's ZeRO-2 keeps a 1/4 master shard *and* a full gathered
        # copy from forward to backward; ZeRO-3 keeps the shard and gathers a block at a time (the embedding unit
        # reshards after its forward, the [norm, output] unit after its backward: curry_train/fsdp_units.py).
        assert z0[0]["params"] == z1[0]["params"] == n_bytes
        assert z2[0]["params"] == z3[0]["params"] == n_bytes / 4
        assert z2[0]["param_copies"] == n_bytes
        assert z2[0]["param_copies"] / z3[0]["params"] == 4
        assert z3[0]["param_copies"] == _param_bytes(cfgs[0], "layers.0.")
        assert z0[0]["peak"] > z1[0]["peak"] > z2[0]["peak"] > z3[0]["peak"]
        # Activations do not depend on the ZeRO stage.
        assert len({reps[0]["activations"] for reps in (z0, z1, z2, z3)}) == 1
        for reps in (z0, z2, z3):  # symmetric layouts: every rank measures the same...
            for c in ("params", "param_copies", "grads", "grad_buffers", "optimizer", "activations"):
                assert {rep[c] for rep in reps} == {reps[0][c]}, c
        for reps in (z2, z3):  # ...but when gloo's thread frees a reduce-scatter input is timing (memory.py)
            assert max(rep["other"] for rep in reps) - min(rep["other"] for rep in reps) <= root
    assert m[0, "full"][0]["activations"] < m[0, "none"][0]["activations"] / 3


def test_single_process_measurement_is_exact_and_repeatable(one_thread):
    cfg = load_config(TINY)
    a, b = measure_memory(cfg), measure_memory(cfg)
    assert a == b
    n_bytes = _param_bytes(cfg)
    n_tensors = sum(1 for _ in build_model(cfg).parameters())
    assert a.params == a.grads == n_bytes
    assert a.optimizer == 2 * n_bytes + n_tensors * F32  # AdamW exp_avg + exp_avg_sq + a scalar step each
    assert a.param_copies == a.grad_buffers == 0
    rope_tables = 2 * cfg.train.seq_len * (cfg.model.d_model // cfg.model.n_heads // 2) * F32  # cos, sin buffers
    assert a.other >= rope_tables
    assert sum(a.at_peak.values()) == a.peak and a.cuda_max_allocated is None


@pytest.mark.multirank
def test_bf16_one_rank_holds_fsdp_bf16_units_not_autocast_casts():
    """bf16 on one rank is FSDP2 at degree 1 (wrapping.py): fp32 masters, and the gathered bf16 copy of every
    parameter (ZeRO-0 keeps its units gathered for the step) filed as param_copies, where autocast cast only the
    matmul weights, once per forward. The estimate has the same copies (forkserver: a world of one rank)."""
    from curry_train.estimator import estimate

    cfg = load_config(TINY, {"train.dtype": "bfloat16"})
    (rep,) = launch_forkserver(rank_jobs, 1, [memory_spec(cfg)])[0]
    assert rep["params"] == _param_bytes(cfg)  # fp32 master weights
    assert rep["param_copies"] == _param_bytes(cfg) // 2  # a bf16 copy of every parameter, not only the matmuls'
    assert estimate(cfg).memory.param_copies == rep["param_copies"]


def test_a_memory_spec_names_its_job_and_the_template_registry_holds_only_template_jobs():
    assert job_function(memory_spec(load_config(TINY))) == "curry_train.measure.memory:memory_job"
    assert sorted(JOBS) == ["selftest", "train"]  # every other job is named by its owner (no upward name)
    with pytest.raises(ValueError, match="unknown job kind"):
        job_function({"kind": "memory"})


@pytest.mark.multirank
def test_zero1_under_tp_holds_unsharded_gradients_and_kept_units_match_the_estimate():
    """Megatron's distributed optimizer (ZeRO-1 under TP on FSDP2) keeps every unsharded fp32 gradient across the
    4 micro-batches; fsdp_keep_gathered keeps the units gathered. The estimator models both (estimator_accuracy.py
    rows megatron-* and zero2-keep-*): its peak matches the tracker only if the template really holds them."""
    from curry_train.estimator import estimate

    base = {"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "train.micro_batch": 1}
    cfgs = [load_config(TINY, {**base, **o}) for o in (
        {"parallel.zero": 1}, {"parallel.zero": 2}, {"parallel.zero": 2, "parallel.fsdp_keep_gathered": True,
                                                     "parallel.recompute": "full"})]
    per_rank = launch_forkserver(rank_jobs, 4, [memory_spec(c) for c in cfgs])
    worst = [max((per_rank[r][i] for r in range(4)), key=lambda rep: rep["peak"]) for i in range(len(cfgs))]
    for cfg, rep in zip(cfgs, worst):
        assert abs(estimate(cfg).memory.total - rep["peak"]) <= 0.02 * rep["peak"], (cfg.parallel, rep["peak"])
    local = _param_bytes(cfgs[0]) // 2  # TP-local fp32 parameters (tiny's tensors all split evenly over tp=2)
    z1, z2 = (rep["at_peak"]["grads"] + rep["at_peak"]["grad_buffers"] for rep in worst[:2])
    assert z1 >= local and z2 <= 0.6 * local  # ZeRO-1: the whole step's unsharded accumulators; ZeRO-2: ~shards
