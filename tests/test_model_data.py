"""Model and data: layout-independent init, deterministic slicing, and a loss that falls."""

from __future__ import annotations

import pytest
import torch
from curry_train.config import load_config
from curry_train.model.data import cp_positions, global_batch, micro_batches
from curry_train.model.gpt import build_model, count_params

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"


def test_init_depends_only_on_the_seed_and_each_parameter_name():
    a = build_model(load_config(TINY))
    b = build_model(load_config(TINY, {"parallel.dp": 4, "parallel.tp": 2, "parallel.zero": 3}))
    c = build_model(load_config(TINY, {"train.seed": 1}))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # a model with fewer layers still gets the same (unscaled) weights for the ones it has
    d = build_model(load_config(TINY, {"model.n_layers": 2}))
    assert torch.equal(d.state_dict()["layers.1.feed_forward.w1.weight"], sa["layers.1.feed_forward.w1.weight"])


def test_parameter_names_are_the_whitebox_contract():
    names = set(dict(build_model(load_config(TINY)).named_parameters()))
    assert {"tok_embeddings.weight", "layers.3.attention.wk.weight", "layers.0.feed_forward.w3.weight",
            "norm.weight", "output.weight"} <= names


def test_data_is_deterministic_and_split_covers_the_batch_exactly_once():
    cfg = load_config(TINY, {"parallel.dp": 2, "train.micro_batch": 1})
    x, y = global_batch(cfg, 3)
    x2, _ = global_batch(cfg, 3)
    assert torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1])
    rows = [xb for r in range(2) for xb, _, _ in micro_batches(cfg, x, y, r)]
    assert torch.equal(torch.cat(rows), x)


def test_context_parallel_positions_pair_a_head_and_a_tail_chunk():
    pos = [cp_positions(64, 4, r) for r in range(4)]
    assert pos[0].tolist()[:8] == list(range(8)) and pos[0].tolist()[8:] == list(range(56, 64))
    assert sorted(torch.cat(pos).tolist()) == list(range(64))


@pytest.mark.slow  # a 50-step run / a float64 gradcheck: seconds, kept out of the inner loop
def test_tiny_loss_falls_over_50_steps():
    from curry_train.train.loop import setup, train_step

    cfg = load_config(TINY, {"train.steps": 50})
    torch.manual_seed(0)
    par = setup(cfg)
    losses = [train_step(par, s, read=True).loss for s in range(50)]
    assert losses[0] > 5.0  # ~ln(256) at init
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses[::10]
    assert count_params(par.parts[0]) > 0


def test_a_rank_generates_only_its_own_synthetic_rows_and_gets_the_reference_slices(monkeypatch):
    """The data path never generates more than the rank needs (row i of step s has its own seed)."""
    from curry_train.model import data

    cfg = load_config(TINY, {"parallel.dp": 2, "parallel.cp": 2, "train.micro_batch": 1})
    x, y = global_batch(cfg, 5)
    built: list[int] = []
    real = data._synthetic_rows

    def counting(cfg, step, rows):
        rows = list(rows)
        built.extend(rows)
        return real(cfg, step, rows)

    monkeypatch.setattr(data, "_synthetic_rows", counting)
    for dp in range(2):
        for cp in range(2):
            built.clear()
            pos = cp_positions(64, 2, cp)
            got = list(data.rank_micro_batches(cfg, 5, dp, cp))
            assert sorted(built) == list(range(dp * 4, dp * 4 + 4))  # its 4 rows of 8, nothing else
            for m, (xb, yb, _) in enumerate(got):
                assert torch.equal(xb[0], x[dp * 4 + m, pos]) and torch.equal(yb[0], y[dp * 4 + m, pos])


def test_the_feed_serves_the_reference_rows_built_one_step_ahead_off_the_training_thread(monkeypatch):
    """train/feed.py: the rows of a step are the reference's slices whether prefetched (the next step, built on the
    feed's thread) or built on the spot (a jump, as on resume); each device copy is a fresh tensor."""
    import threading

    from curry_train.model.data import micro_batches
    from curry_train.train import feed as feed_mod

    cfg = load_config(TINY, {"parallel.dp": 2, "parallel.cp": 2, "train.micro_batch": 1})
    built: dict[int, str] = {}
    real = feed_mod.rank_micro_batches

    def spy(cfg, step, dp_rank, cp_rank=0):
        built[step] = threading.current_thread().name
        return real(cfg, step, dp_rank, cp_rank)

    monkeypatch.setattr(feed_mod, "rank_micro_batches", spy)
    feed = feed_mod.Feed(cfg, torch.device("cpu"), 1, 1)
    for step in (3, 4, 7):  # in order, then a jump
        batch = feed.host(step)
        want = list(micro_batches(cfg, *global_batch(cfg, step), 1, 1))
        for m, (x, y, pos) in enumerate(want):
            got = feed.micro(batch, m)
            assert all(torch.equal(a, b) for a, b in zip(got, (x, y, pos))), (step, m)
        dev = feed.to_device(batch[0])
        assert dev.data_ptr() != batch[0].data_ptr() and torch.equal(dev, batch[0])
    feed.host(8)  # waits for the step built ahead after 7 (close() cancels a build that has not started yet)
    feed.close()
    main = threading.main_thread().name
    assert built[3] == main and built[7] == main  # nothing was ahead of them
    assert built[4].startswith("curry-feed") and built[8].startswith("curry-feed"), built
