"""DeepSeek's multi-head latent attention (model/mla.py) against the single-device reference, its rules and its
estimator terms.

    .venv/bin/pytest tests/parallel/test_mla.py -q -n 0

Every parallel path (DDP, ZeRO-3/FSDP2, TP2 with and without SP, PP2, selective and full recompute, and with
DeepSeekMoE blocks EP2 under ZeRO-1 and under TP2 + ZeRO-3) through the white-box harness in one forkserver launch
of 4 CPU ranks, at validation/whitebox.py's fixed fp32 tolerances.
"""

from __future__ import annotations

import pytest
import torch
from curry_train.config import ConfigError, load_config
from curry_train.estimator import estimate
from curry_train.model.gpt import build_model, count_params
from curry_train.model.mla import MLAttention

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

pytestmark = pytest.mark.timeout(900)
MLA = PRESETS / "tiny-mla.yaml"
TINY = PRESETS / "tiny.yaml"

MOE = {"model.num_experts": 4, "model.n_shared_experts": 1, "model.first_k_dense": 1, "model.dense_d_ff": 96}
WORLD4 = [
    {"parallel.dp": 4, "parallel.zero": 3},  # FSDP2: latents and up-projections sharded in the block's unit
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3},  # TP2 (heads) x FSDP
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.zero": 1},  # TP2 + SP, distributed optim.
    {"parallel.dp": 4},  # DDP
    {"parallel.pp": 2, "parallel.dp": 2, "train.global_batch": 16},  # PP2 x DDP
    {"parallel.dp": 4, "parallel.zero": 2, "parallel.recompute": "selective"},  # SAC over MLA's matmuls
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3, "parallel.recompute": "full",
     "model.q_lora_rank": 0},  # queries without a latent (wq), TP + full recompute
    # DeepSeek-V3's blocks: MLA + DeepSeekMoE (a shared expert overlapping the combine, a dense first block) under
    # EP2, with its published ZeRO-1 (and SAC over MLA's, the experts' and the shared expert's matmuls) ...
    {**MOE, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 1, "parallel.recompute": "selective"},
    {**MOE, "parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.ep": 2, "parallel.zero": 3},  # TP+EP
]


@pytest.mark.multirank
def test_whitebox_mla_four_ranks(tmp_path):
    cfgs = [load_config(MLA, o) for o in WORLD4]
    for o, v in zip(WORLD4, whitebox_batch(cfgs, steps=2, out_dir=tmp_path), strict=True):
        assert v.passed, f"{o}: {v.failures[:5]} worst={v.worst_parameter}"


def test_mla_module_shapes_and_parameter_count():
    cfg = load_config(MLA)
    model = build_model(cfg)
    att = model.layers["0"].attention
    assert isinstance(att, MLAttention)
    assert att.wq_a.weight.shape == (32, 64) and att.wq_b.weight.shape == (8 * 12, 32)
    assert att.wkv_a.weight.shape == (24 + 4, 64) and att.wkv_b.weight.shape == (8 * (8 + 6), 24)
    assert att.wo.weight.shape == (64, 8 * 6) and model.rope_cos.shape == (64, 2)  # RoPE over qk_rope_head_dim
    for c in (cfg, load_config(MLA, {"model.q_lora_rank": 0})):
        assert estimate(c).param_count == count_params(build_model(c))


def test_mla_matches_a_direct_computation():
    """The module computes DeepSeek-V2 §2.1's equations: scale 1/sqrt(Dn + Dr), the rotary key shared by heads."""
    import torch.nn.functional as F
    from curry_train.model.gpt import apply_rope

    cfg = load_config(MLA)
    att = build_model(cfg).layers["0"].attention
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    m = build_model(cfg)
    cos, sin = m.rope_cos[:16], m.rope_sin[:16]
    with torch.no_grad():
        q = att.wq_b(att.q_norm(att.wq_a(x))).view(2, 16, 8, 12).transpose(1, 2)
        kv = att.wkv_a(x)
        kr = apply_rope(kv[..., 24:].unsqueeze(1), cos, sin).expand(2, 8, 16, 4)
        up = att.wkv_b(att.kv_norm(kv[..., :24])).view(2, 16, 8, 14).transpose(1, 2)
        q = torch.cat([q[..., :8], apply_rope(q[..., 8:], cos, sin)], -1)
        k = torch.cat([up[..., :8], kr], -1)
        s = (q @ k.transpose(-1, -2)) / 12 ** 0.5 + torch.full((16, 16), float("-inf")).triu(1)
        y = (F.softmax(s, -1) @ up[..., 8:]).transpose(1, 2).reshape(2, 16, 48)
        torch.testing.assert_close(att(x, cos, sin), att.wo(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, field", [
    ({"model.kv_lora_rank": 8}, "model.kv_lora_rank"),  # an MLA field on the GQA path
    ({"model.attention": "mha"}, "model.n_kv_heads"),  # tiny's 8 query heads over 4 kv heads are GQA
    ({"model.attention": "mla"}, "model.kv_lora_rank"),  # mla without its ranks
])
def test_attention_fields_refused_on_tiny(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert field in str(e.value)


@pytest.mark.parametrize("overrides, field", [
    ({"parallel.cp": 2, "parallel.dp": 1}, "parallel.cp"),  # the ring stacks K and V of one head dim
    ({"model.qk_rope_head_dim": 3}, "model.qk_rope_head_dim"),  # RoPE rotates pairs
    ({"model.v_head_dim": 16}, "model.v_head_dim"),  # above the qk dims v is padded to
    ({"model.n_kv_heads": 4}, "model.n_kv_heads"),  # MLA has a K and a V per query head
    ({"parallel.tp": 3, "hardware.gpus_per_node": 3}, "model.n_heads"),  # heads split by tp
])
def test_mla_layouts_refused_before_launch(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(MLA, overrides)
    assert field in str(e.value)


def test_existing_attention_configs_unchanged():
    """gqa is the default and mha the G = H case of the same path: existing configs load as before."""
    cfg = load_config(TINY)
    assert cfg.model.attention == "gqa" and not cfg.model.kv_lora_rank
    assert load_config(TINY, {"model.attention": "mha", "model.n_kv_heads": 8}).model.n_kv_heads == 8
    assert not isinstance(build_model(cfg).layers["0"].attention, MLAttention)


@pytest.mark.parametrize("overrides", [{}, {"model.q_lora_rank": 0}, {"parallel.tp": 2}],
                         ids=["q-latent", "no-q-latent", "tp2-local"])
def test_saved_activations_are_the_estimators(overrides):
    """What one MLA attention's autograd keeps (unique storages, less the weights, its input and the RoPE rows) is
    estimator/mla.py's mla_saved exactly: the fused kernel runs (v padded to the qk dims), so no [B, H, T, T]
    softmax is saved. tp2: the rank-local module (H/2 heads, replicated latents) built directly."""
    from curry_train.estimator.layout import layout_of
    from curry_train.estimator.mla import mla_saved
    from curry_train.model.gpt import RMSNorm, apply_rope, causal_attention

    cfg = load_config(MLA, {k: v for k, v in overrides.items() if k != "parallel.tp"})
    m = cfg.model.model_copy(update={"n_heads": cfg.model.n_heads // overrides.get("parallel.tp", 1)})
    att = MLAttention(m, RMSNorm, apply_rope, causal_attention)
    model = build_model(cfg)
    x = torch.randn(2, 64, 64, requires_grad=True)
    cos, sin = model.rope_cos, model.rope_sin
    skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *att.parameters())}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        att(x, cos, sin)
    layout = layout_of(load_config(MLA, overrides))
    assert sum(kept.values()) == mla_saved(layout, 2 * 64, 4)


def test_tp_prices_the_replicated_down_projections_on_every_rank(monkeypatch):
    """Under TP each rank runs wq_a and wkv_a whole (tensor_parallel.mla_plan): the blocks' linear time at tp2 holds
    (1 - 1/tp) of the down-projections' FLOPs more than an even split by tp would."""
    import curry_train.estimator.comm as comm
    from curry_train.estimator.compute import block_rates
    from curry_train.estimator.layout import layout_of
    from curry_train.estimator.mla import mla_replicated_flops_per_token
    from curry_train.estimator.profiles import from_device_name

    hw = from_device_name("H100")
    two = layout_of(load_config(MLA, {"model.d_model": 2048, "model.q_lora_rank": 1024, "model.kv_lora_rank": 512,
                                      "train.seq_len": 512, "parallel.tp": 2}))
    rep = mla_replicated_flops_per_token(two)
    assert rep == 6.0 * 4 * (1024 + 512 + 4) * 2048
    with_rep = comm._stage_costs(two, hw)[0]
    monkeypatch.setattr(comm, "mla_replicated_flops_per_token", lambda x: 0.0)
    tokens = two.global_batch * two.seq_len / two.dp
    lin_eff = block_rates(two, hw)[0]
    extra = tokens * rep * 0.5 / (hw.peak_flops(two.dtype) * lin_eff)
    assert with_rep - comm._stage_costs(two, hw)[0] == pytest.approx(extra, rel=1e-9)
