"""Each rank draws only the rows it keeps (parallel/materialize.py, own-rows path): bit-identical to the same rows
of the full `init_tensor` draw, and the estimator's init peak (estimator/init.py) follows the measured one on the
CPU tracker for layouts on both paths."""

from __future__ import annotations

import pytest
import torch
from curry_train.config import load_config
from curry_train.model.gpt import init_rows_into, init_tensor
from curry_train.train.launch import launch_forkserver
from curry_train.wrapping import chunk_rows, rows_drawn_exactly

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"
MOE = PRESETS / "tiny-moe.yaml"
# (name, full shape, parts): FSDP Shard(0) chunks of dense weights, the embedding, an MoE [E, D, F] expert
# weight and a norm (ones), including an uneven split (the last chunk short) and an empty chunk
NAMES = [("layers.0.attention.wq.weight", (64, 64), 4), ("tok_embeddings.weight", (256, 64), 3),
         ("layers.1.feed_forward.w2.weight", (64, 128), 8), ("layers.0.moe.experts.w1", (4, 64, 128), 2),
         ("layers.2.ffn_norm.weight", (64,), 4), ("output.weight", (256, 64), 1),
         ("layers.3.attention.wk.weight", (32, 64), 48)]


@pytest.mark.parametrize("seed", [0, 7])
def test_own_rows_are_bit_identical_to_the_full_draw(seed):
    m = load_config(TINY).model
    for name, shape, parts in NAMES:
        full = init_tensor(name, shape, m, seed)  # today's reference value: the full tensor, then sliced
        for index in range(parts):
            lo, hi = chunk_rows(shape[0], parts, index)
            row = torch.Size(shape[1:]).numel()
            assert rows_drawn_exactly(shape[0], row, lo, hi)
            out = torch.empty((hi - lo, *shape[1:]))
            init_rows_into(out, name, shape, m, seed, lo)
            assert torch.equal(out, full[lo:hi]), (name, parts, index)


def test_rows_the_rng_cannot_draw_alone_are_refused():
    assert not rows_drawn_exactly(10, 3, 0, 5)  # 30 elements: randn redraws the last 16
    assert not rows_drawn_exactly(64, 4, 0, 2)  # 8 elements in: inside a 16-draw block
    assert rows_drawn_exactly(64, 4, 4, 8)


LAYOUTS = [  # (config, overrides): own rows (DDP, FSDP, HSDP, EP under DDP and FSDP) and full draw (TP)
    (TINY, {"parallel.dp": 2}),
    (TINY, {"parallel.dp": 2, "parallel.zero": 3}),
    (TINY, {"parallel.dp": 2, "parallel.zero": 3, "parallel.dp_replicate": 2}),
    (TINY, {"parallel.tp": 2}),
    (MOE, {"parallel.dp": 2, "parallel.ep": 2}),
    (MOE, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3}),
]


def _init_peaks(rank: int, world: int, layouts: list) -> list[int]:
    from curry_train.measure.init_memory import measure_init

    return [measure_init(load_config(base, o))[1]["init_peak_bytes"] for base, o in layouts]


@pytest.mark.multirank
def test_the_estimated_init_peak_is_the_measured_one_on_both_paths():
    from curry_train.estimator import estimate

    # A buffer handed to a collective (DDP's broadcast of the initial weights) is freed by gloo's thread when it
    # completes (measure/tracker.py): on a loaded machine a rank can peak with it alive (rank 0 at +856 to +1,112
    # bytes, and off again in a second launch in two of ten runs of this test on the 2-core machine, 2026-12-07).
    # That is timing, an excess and never a shortfall, while a wrong estimate is wrong in every launch: each
    # layout's figure is its per-rank minimum over up to three launches, a launch only for the layouts still off.
    est = [estimate(load_config(base, o)).init_peak_bytes for base, o in LAYOUTS]
    low: dict[int, list[int]] = {}
    todo = list(range(len(LAYOUTS)))
    for _ in range(3):
        measured = launch_forkserver(_init_peaks, 2, [LAYOUTS[i] for i in todo], timeout=600)
        for k, i in enumerate(todo):
            low[i] = [min(pair) for pair in zip(low.get(i, [1 << 62] * 2), (r[k] for r in measured))]
        todo = [i for i in todo if abs(est[i] - max(low[i])) > 64]
        if not todo:
            break
    wrong = {i: (LAYOUTS[i][1], est[i], low[i]) for i in todo}
    assert not wrong, wrong  # index -> (overrides, estimated, measured per rank)
