"""Training essentials: lr schedule, global-norm gradient clipping under every primitive, the token-file data path."""

from __future__ import annotations

import math

import pytest
import torch
from curry_train.config import load_config
from curry_train.train.optim import clip_grads_, global_grad_norm, lr_at

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

TINY = PRESETS / "tiny.yaml"
TINY_MOE = PRESETS / "tiny-moe.yaml"
CLIP = {"train.grad_clip": 0.05, "train.lr_schedule": "cosine", "train.warmup_steps": 1, "train.steps": 3}


def test_lr_schedule_warms_up_then_decays_by_cosine_to_a_tenth():
    cfg = load_config(TINY, {"train.lr": 1.0, "train.lr_schedule": "cosine", "train.warmup_steps": 2,
                             "train.steps": 12})
    lrs = [lr_at(cfg, s) for s in range(13)]
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lrs[7] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[12] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    const = load_config(TINY, {"train.lr": 1.0, "train.warmup_steps": 1})
    assert [lr_at(const, s) for s in range(3)] == pytest.approx([0.5, 1.0, 1.0])


def test_clip_matches_torch_in_one_process():
    from curry_train.model.data import global_batch
    from curry_train.model.gpt import build_model, lm_loss

    cfg = load_config(TINY, {"train.grad_clip": 0.05})
    a, b = build_model(cfg), build_model(cfg)
    x, y = global_batch(cfg, 0)
    for m in (a, b):
        lm_loss(m(x), y).backward()
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    norm = float(clip_grads_([a], cfg, None))  # a device scalar: the step never reads it
    assert norm == pytest.approx(float(ref), rel=1e-6) and norm > 0.05  # the clip triggers
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=n)
    assert float(global_grad_norm([a], cfg, None)) == pytest.approx(0.05, rel=1e-4)


def test_the_norm_is_one_foreach_kernel_per_group_and_adamw_is_fused_only_on_cuda(monkeypatch):
    """The global norm is torch._foreach_norm over each reduction group's gradients (one call for a single
    process: one group), equal to the float64 sum of squares within fp32 rounding; AdamW takes fused=True only
    when every parameter is a floating CUDA tensor of one kind (plain, or DTensors of one mesh), else the loop."""
    from types import SimpleNamespace

    from curry_train.model.data import global_batch
    from curry_train.model.gpt import build_model, lm_loss
    from curry_train.train.optim import adamw_kwargs

    cfg = load_config(TINY)
    model = build_model(cfg)
    x, y = global_batch(cfg, 0)
    lm_loss(model(x), y).backward()
    calls, real = [], torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a: calls.append(len(ts)) or real(ts, *a))
    norm = float(global_grad_norm([model], cfg, None))
    exact = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
    assert calls == [39] and norm == pytest.approx(exact, rel=1e-6)
    cpu = list(model.parameters())
    loop = {"lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay, "fused": False, "foreach": False}
    assert adamw_kwargs(cpu, cfg) == loop
    cuda = [SimpleNamespace(device=torch.device("cuda"), dtype=dt) for dt in (torch.float32, torch.bfloat16)]
    assert adamw_kwargs(cuda, cfg) == {**loop, "fused": True}
    assert adamw_kwargs([*cuda, cpu[0]], cfg) == loop  # one CPU parameter: no fused kernel for the set
    sharded = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32, device_mesh=object())
    assert adamw_kwargs([*cuda, sharded], cfg) == loop  # plain beside DTensor (TP's norms): multi-tensor refuses


LAYOUTS = [
    {"parallel.dp": 4, "parallel.zero": 1},
    {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3},
    {"parallel.dp": 2, "parallel.pp": 2, "parallel.zero": 2},
    {"parallel.tp": 2, "parallel.pp": 2, "parallel.sp": True},
    {"config": TINY_MOE, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 2},
    {"config": TINY_MOE, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 0},
    {"parallel.dp": 2, "parallel.cp": 2, "parallel.zero": 3},
]


def _cfg(o: dict):
    return load_config(o.get("config", TINY), {**CLIP, **{k: v for k, v in o.items() if k != "config"}})


@pytest.mark.multirank
def test_clip_schedule_global_norm_and_zero_grad_match_the_reference_under_every_primitive(tmp_path):
    """Three steps (warm-up, then cosine) with a clip far below the gradient norm, on four ranks: ZeRO-1's
    optimizer, FSDP over TP (strided shards), PP stages (pp all-reduce), TP+SP inside stages, expert shards under
    FSDP and under DDP (ep all-reduce), CP under FSDP.

    Adam is nearly invariant to a constant gradient scale, so a wrong norm (copies counted twice, a stage or an
    expert shard missed) could hide in the parameters: the verdict also holds every rank's own global norm, the
    one it clipped by, to the reference's ("rank_clip_norm", grad-norm bound); and a zero-grad that leaves a
    gradient behind adds it to the next step's: none may be left, on any rank, after any step ("zero_grad")."""
    overrides = LAYOUTS
    cfgs = [_cfg(o) for o in overrides]
    verdicts = whitebox_batch(cfgs, steps=3, out_dir=tmp_path, timeout=900)
    failed = {str(o): (v.failures[:3], v.worst_parameter) for o, v in zip(overrides, verdicts) if not v.passed}
    assert not failed, failed
    assert all(min(v.grad_norm_ref) > 2 * CLIP["train.grad_clip"] for v in verdicts)  # every step clipped
    for o, v in zip(overrides, verdicts):  # both per-rank checks ran on every layout (a missing one is no pass)
        assert v.bound_use.get("zero_grad") == 0.0 and 0.0 <= v.bound_use["rank_clip_norm"] <= 1.0, (o, v.bound_use)


# --------------------------------------------------------------------------- data.path


def _token_file(tmp_path, n=5000, vocab=256, dtype="uint16"):
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, vocab, n).astype(dtype).tofile(path)
    return path


def test_prepare_data_writes_byte_tokens_and_the_cli_reports_them(tmp_path, capsys):
    import json

    import numpy as np
    from curry_train.cli import main

    text = tmp_path / "in.txt"
    text.write_text("héllo, curry\n" * 40, encoding="utf-8")
    assert main(["prepare-data", "--text", str(text), "--out", str(tmp_path / "d" / "in.bin"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = np.fromfile(tmp_path / "d" / "in.bin", dtype=np.uint16)
    assert out["tokens"] == len(ids) == len(text.read_bytes()) and ids.max() < 256
    assert bytes(ids.astype(np.uint8)) == text.read_bytes()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["prepare-data", "--text", str(empty), "--out", str(tmp_path / "e.bin")]) == 2
    assert "empty" in capsys.readouterr().err and not (tmp_path / "e.bin").exists()


def test_token_file_rows_are_deterministic_and_each_rank_reads_only_its_part(tmp_path):
    from curry_train.model.data import cp_positions, global_batch, rank_micro_batches, token_file

    path = _token_file(tmp_path)
    cfg = load_config(TINY, {"data.path": str(path), "parallel.dp": 2, "parallel.cp": 2, "train.micro_batch": 1})
    x, y = global_batch(cfg, 3)
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    tokens = torch.from_numpy(token_file(cfg).astype("int64"))
    assert torch.equal(x[0], tokens[3 * 8 * 64:3 * 8 * 64 + 64])  # row i of step s starts at (s*B + i)*T
    for dp in range(2):
        for cp in range(2):
            pos = cp_positions(64, 2, cp)
            got = list(rank_micro_batches(cfg, 3, dp, cp))
            assert len(got) == 4 and all(xb.shape == (1, 32) for xb, _, _ in got)
            for m, (xb, yb, _) in enumerate(got):
                row = dp * 4 + m
                assert torch.equal(xb[0], x[row, pos]) and torch.equal(yb[0], y[row, pos])


@pytest.mark.parametrize("case", ["missing", "empty", "too_big_id", "odd_size"])
def test_bad_token_files_are_config_errors_naming_data_path(tmp_path, case, project, capsys):
    import numpy as np
    from curry_train.cli import main

    path = tmp_path / "t.bin"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "too_big_id":
        np.full(1000, 300, dtype=np.uint16).tofile(path)
    elif case == "odd_size":
        path.write_bytes(b"\x01" * 1001)
    code = main(["train", "--config", "tiny", "--root", str(project), "--set", f"data.path={path}"])
    err = capsys.readouterr().err
    assert code == 2 and "data.path" in err and "Fix:" in err, err
    assert {"missing": "does not exist", "empty": "is empty", "too_big_id": "300 >= model.vocab_size=256",
            "odd_size": "not a whole number"}[case] in err
    assert not list((project / "runs").glob("*/spec.json"))  # nothing was launched


@pytest.mark.multirank
def test_token_file_training_matches_the_reference_under_dp_and_cp(tmp_path):
    path = _token_file(tmp_path)
    cfgs = [load_config(TINY, {"data.path": str(path), **o})
            for o in ({"parallel.dp": 2, "parallel.zero": 3}, {"parallel.cp": 2}, {"parallel.pp": 2})]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path, timeout=600)
    assert all(v.passed for v in verdicts), [v.failures[:3] for v in verdicts]
