"""The chunked LM loss (model/gpt.py chunked_lm_loss, train.loss_chunks): the same mean loss and gradients as
lm_loss on the full logits, with only one chunk's fp32 logits alive, under every layout that touches the head."""

from __future__ import annotations

import pytest
import torch
from curry_train.config import from_dict, load_config, loss_chunk_count
from curry_train.model.gpt import build_model, lm_loss

from tests.conftest import PRESETS
from tests.whitebox_pool import whitebox_batch

TINY = PRESETS / "tiny.yaml"


def test_auto_chunk_count_is_vocab_over_d_model_and_never_more_than_tokens():
    assert loss_chunk_count(0, 8192, 128256, 4096) == 32  # llama3-8b: ceil(31.3)
    assert loss_chunk_count(0, 128, 256, 64) == 4  # tiny
    assert loss_chunk_count(1, 128, 256, 64) == 1  # explicit: unchunked
    assert loss_chunk_count(7, 5, 256, 64) == 5  # at most one chunk per token
    assert loss_chunk_count(0, 3, 4096, 64) == 3


@pytest.mark.parametrize("chunks", [0, 3, 5, 128])
def test_chunked_loss_matches_the_full_logits_loss_and_gradients(chunks):
    """128 tokens in 3 or 5 chunks: the runs are unequal (43/43/42, 26/26/26/25/25); 128 = one token each."""
    cfg = from_dict({"model": {"vocab_size": 512}, "train": {"loss_chunks": chunks}})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (2, 64), generator=g), torch.randint(0, 512, (2, 64), generator=g)
    ref = build_model(cfg)
    full = lm_loss(ref(x), y)  # targets=None: the logits, then the loss outside the model
    full.backward()
    model = build_model(cfg)
    loss = model(x, targets=y)
    loss.backward()
    assert loss.shape == () and torch.allclose(loss, full, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


def test_one_chunk_is_lm_loss_bit_for_bit():
    cfg = from_dict({"train": {"loss_chunks": 1}})
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    model = build_model(cfg)
    assert torch.equal(model(x, targets=x), lm_loss(model(x), x))


def test_backward_keeps_one_chunks_logits_not_all():
    """The loss-gradient bytes (nll / log_softmax backward, measure/memory.py's "loss") shrink with the chunk
    count, and the step's peak falls: the tracker on a vocab-heavy config (V = 64 D)."""
    from curry_train.measure.memory import measure_memory

    base = {"model.vocab_size": 4096, "train.global_batch": 2, "train.micro_batch": 2}
    one = measure_memory(load_config(TINY, {**base, "train.loss_chunks": 1}))
    auto = measure_memory(load_config(TINY, {**base, "train.loss_chunks": 0}))  # 64 chunks of 2 tokens
    n, V = 2 * 64, 4096
    assert one.loss >= 2 * 4 * n * V  # the fp32 [n, V] log-softmax gradient and the nll gradient
    assert auto.loss <= one.loss // 16
    assert auto.peak < one.peak - 4 * n * V  # measured: 16.98 MB -> 13.86 MB (an fp32 [n, V] is 2.10 MB)


TWO_RANKS = [
    {"parallel.dp": 2, "parallel.zero": 3},                                        # FSDP: root resharded
    {"parallel.dp": 2, "parallel.zero": 2, "train.loss_chunks": 5},                # uneven chunks
    {"parallel.dp": 2, "parallel.zero": 3, "train.dtype": "bfloat16"},             # mixed precision
    {"parallel.dp": 2},                                                            # DDP
    {"parallel.tp": 2},                                                            # loss_parallel
    {"parallel.tp": 2, "parallel.sp": True, "train.loss_chunks": 5},               # SP: gathered once
    {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},                            # last stage's forward
    {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual": 2},  # ZBV: W pass
    {"parallel.cp": 2, "train.loss_chunks": 3},                                    # local tokens
]


@pytest.mark.multirank
def test_chunked_loss_passes_whitebox_on_two_ranks(tmp_path):
    cfgs = [load_config(TINY, o) for o in TWO_RANKS]
    verdicts = whitebox_batch(cfgs, steps=2, out_dir=tmp_path)
    for o, v in zip(TWO_RANKS, verdicts, strict=True):
        assert v.passed, (o, v.failures)


@pytest.mark.multirank
def test_chunked_loss_passes_whitebox_on_four_ranks(tmp_path):
    four = [{"parallel.dp": 2, "parallel.tp": 2, "parallel.sp": True, "parallel.zero": 3, "train.loss_chunks": 5},
            {"parallel.pp": 2, "parallel.tp": 2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2}]
    verdicts = whitebox_batch([load_config(TINY, o) for o in four], steps=2, out_dir=tmp_path)
    for o, v in zip(four, verdicts, strict=True):
        assert v.passed, (o, v.failures)
