"""FSDP units as torchtitan splits them (curry_train/fsdp_units.py): embedding, blocks, [norm, output], root,
each with its reshard_after_forward, read back from the FSDP2 state of a model apply_fsdp wrapped."""

from __future__ import annotations

import pytest
import torch
from curry_train.config import ConfigError, load_config
from curry_train.fsdp_units import reshard_after_forward

from tests.conftest import PRESETS

TINY = PRESETS / "tiny.yaml"


def _units(cfg, tmp_path, stage=None) -> dict[str, tuple[tuple[str, ...], bool]]:
    """apply_fsdp on a 1-rank gloo mesh: {unit's first module name: (its modules' names, reshard_after_forward)}."""
    import torch.distributed as dist
    from curry_train.mesh import Topology, build_mesh
    from curry_train.model.gpt import build_meta_model
    from curry_train.parallel.fsdp import apply_fsdp
    from torch.distributed.fsdp import FSDPModule

    tmp_path.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_meta_model(cfg)
        if stage is not None:
            stage(model)
        apply_fsdp(model, build_mesh(Topology(), "cpu"), cfg)
        names = {m: n or "root" for n, m in model.named_modules()}
        out = {}
        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            mods = tuple(names[x] for x in state._modules)
            out[mods[0]] = (mods, group.post_forward_mesh_info is not None if group else None)
        return out
    finally:
        dist.destroy_process_group()


def test_zero3_units_are_embedding_blocks_head_and_root_and_the_head_stays_gathered(tmp_path):
    cfg = load_config(TINY, {"parallel.zero": 3})
    units = _units(cfg, tmp_path)
    n = cfg.model.n_layers
    assert units["tok_embeddings"] == (("tok_embeddings",), True)
    for i in range(n):
        assert units[f"layers.{i}"] == ((f"layers.{i}",), True)
    assert units["norm"] == (("norm", "output"), False)  # one unit, not resharded after forward (torchtitan)
    assert units["root"][0] == ("root",) and units["root"][1] is None  # holds no parameter of its own
    assert len(units) == n + 3


def test_zero2_and_zero1_units_never_reshard_after_forward(tmp_path):
    units = _units(load_config(TINY, {"parallel.zero": 2}), tmp_path)
    assert {k: v[1] for k, v in units.items() if v[1] is not None} == dict.fromkeys(
        ["tok_embeddings", "norm", *(f"layers.{i}" for i in range(4))], False)


def test_a_pipeline_stage_keeps_its_units_gathered_by_default_and_reshards_them_under_always(tmp_path):
    def last_stage(model):  # what apply_pp leaves on the last stage: no embedding, the later blocks
        model.tok_embeddings = None
        del model.layers["0"], model.layers["1"]

    base = {"parallel.zero": 3, "parallel.pp": 2, "parallel.dp": 2, "train.micro_batch": 1,
            "hardware.gpus_per_node": 4}
    units = _units(load_config(TINY, base), tmp_path, last_stage)
    assert set(units) == {"layers.2", "layers.3", "norm", "root"}
    assert not any(v[1] for v in units.values())
    units = _units(load_config(TINY, {**base, "parallel.fsdp_reshard": "always"}), tmp_path / "b", last_stage)
    assert units["layers.2"][1] and units["layers.3"][1] and units["norm"] == (("norm", "output"), True)


def test_the_policy_is_torchtitans_with_zero3_and_pp():
    rule = reshard_after_forward
    assert [rule(3, 1, "default", u) for u in ("embed", "block", "head")] == [True, True, False]
    assert [rule(3, 4, "default", u) for u in ("embed", "block", "head")] == [False, False, False]
    assert [rule(3, 4, "always", u) for u in ("embed", "block", "head")] == [True, True, True]
    assert [rule(3, 4, "never", u) for u in ("embed", "block", "head")] == [False, False, False]
    assert not any(rule(z, 1, "default", u) for z in (1, 2) for u in ("embed", "block", "head"))
    with pytest.raises(ValueError, match="fsdp_reshard"):
        rule(3, 1, "sometimes", "block")


@pytest.mark.parametrize("overrides,fix", [
    ({"parallel.zero": 2, "parallel.fsdp_reshard": "always"}, "parallel.zero=3"),
    ({"parallel.dp": 1, "parallel.zero": 3, "parallel.fsdp_reshard": "always"}, "dp*cp > 1"),
    ({"parallel.zero": 3, "parallel.fsdp_reshard": "never"}, "parallel.zero=2"),
])
def test_a_policy_that_does_not_apply_is_refused_naming_the_field_and_the_fix(overrides, fix):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, {"parallel.dp": 2, **overrides})
    assert "parallel.fsdp_reshard" in str(e.value) and fix in str(e.value)


def test_an_unknown_policy_is_refused_by_the_schema():
    with pytest.raises(ConfigError, match="fsdp_reshard"):
        load_config(TINY, {"parallel.dp": 2, "parallel.zero": 3, "parallel.fsdp_reshard": "sometimes"})


def test_torch_still_lets_a_grouped_unit_run_a_module_more_than_once_per_forward():
    # the chunked loss (model/gpt.py chunked_lm_loss) calls `output` once per chunk inside the [norm, output] unit
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_state

    assert "chunked loss" in inspect.getsource(_fsdp_state.FSDPState._force_complete_incomplete_states)
    assert torch.distributed.fsdp.fully_shard is not None


def test_the_estimator_prices_zero3_under_pp_as_zero2_unless_always():
    # fsdp_units.py: under PP the default keeps the units gathered for the step, as zero 2 does (memory and time)
    from curry_train.estimator import estimate, load_any

    base = {"parallel.pp": 2, "parallel.dp": 2, "train.micro_batch": 1, "model.d_model": 256, "model.d_ff": 512}
    z2, z3, always = (estimate(load_any("tiny", {**base, **ov})) for ov in (
        {"parallel.zero": 2}, {"parallel.zero": 3}, {"parallel.zero": 3, "parallel.fsdp_reshard": "always"}))
    assert [b.total for b in z3.per_pp_rank] == [b.total for b in z2.per_pp_rank]
    assert z3.step_time.total_s == z2.step_time.total_s
    assert always.step_time.total_s > z3.step_time.total_s
    assert always.per_pp_rank[0].total != z3.per_pp_rank[0].total


def _head_unit_calls(store: str) -> dict[str, int]:
    """FSDPParamGroup.unshard / post_backward calls of the [norm, output] unit in one ZeRO-3 backward on a 1-rank
    world (run by in_fresh_process)."""
    from collections import Counter

    import torch.distributed as dist
    from curry_train.mesh import Topology, build_mesh
    from curry_train.model.gpt import build_meta_model
    from curry_train.parallel.fsdp import apply_fsdp
    from curry_train.parallel.materialize import global_shapes, materialize
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    cfg = load_config(TINY, {"parallel.zero": 3})
    calls: Counter = Counter()
    mp = pytest.MonkeyPatch()
    for name in ("unshard", "post_backward"):
        def wrap(self, *a, _o=getattr(FSDPParamGroup, name), _n=name, **k):
            if self._module_fqn.startswith("norm") and (_n != "unshard" or not self.is_unsharded):
                calls[_n] += 1
            return _o(self, *a, **k)
        mp.setattr(FSDPParamGroup, name, wrap)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mesh = build_mesh(Topology(), "cpu")
        model = build_meta_model(cfg)
        apply_fsdp(model, mesh, cfg)
        materialize(model, cfg, torch.device("cpu"), mesh, global_shapes(cfg))
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
        loss = model(x, targets=x)
        calls.clear()
        loss.backward()
    finally:
        dist.destroy_process_group()
        mp.undo()
    return dict(calls)


def test_the_chunked_loss_gathers_and_reduces_the_head_unit_twice_and_the_time_model_prices_it(tmp_path):
    # torch 2.13: the second chunk's `output` call enters the [norm, output] unit's forward again, so its
    # backward reduce-scatters twice and gathers once more (estimator/comm.py _fsdp prices both per micro-batch)
    from curry_train.estimator import layout_of, load_any
    from curry_train.estimator.comm import _comm
    from curry_train.estimator.profiles import get_profile

    from tests.isolated import in_fresh_process

    calls = in_fresh_process(_head_unit_calls, str(tmp_path / "store"))
    assert dict(calls) == {"post_backward": 2, "unshard": 1}
    lay = layout_of(load_any("tiny", {"parallel.dp": 2, "parallel.zero": 3}))
    one = layout_of(load_any("tiny", {"parallel.dp": 2, "parallel.zero": 3, "train.loss_chunks": 1}))
    n = [sum(c.calls for c in _comm(x, get_profile("H100"), 1.0) if c.primitive == "fsdp") for x in (lay, one)]
    assert n[0] - n[1] == 2 * lay.n_micro_batches  # one more all-gather and one more reduce-scatter each
