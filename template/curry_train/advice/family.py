"""The model family a capacity answer scales: the config's model in width (head dim, GQA ratio and FFN ratio kept)
times depth, smallest first; capacity_sweep (advice/sweep.py) and the one-GPU answer (advice/beyond.py) search it.

    python -c "from curry_train.advice.family import family; from curry_train.config import load_config; \
print(len(family(load_config('configs/tiny.yaml'))))"
"""

from __future__ import annotations

from pydantic import BaseModel

from curry_train.config import Config, ConfigError, from_dict
from curry_train.estimator import param_count

WIDTHS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
DEPTHS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


class FamilyMember(BaseModel):
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    params: int


def family(cfg: Config, widths: tuple[float, ...] = WIDTHS, depths: tuple[float, ...] = DEPTHS) -> list[dict]:
    """Model sections scaled in width (head dim fixed) and depth, valid for the config, smallest first."""
    m = cfg.model
    head_dim = m.d_model // m.n_heads
    kv_ratio = m.n_heads // m.n_kv_heads
    ff_ratio = m.d_ff / m.d_model
    out: dict[tuple[int, int], dict] = {}
    for w in widths:
        heads = max(kv_ratio, round(m.n_heads * w / kv_ratio) * kv_ratio)
        d = heads * head_dim
        d_ff = max(8, round(ff_ratio * d / 8) * 8)
        for dep in depths:
            layers = max(1, round(m.n_layers * dep))
            sec = {**m.model_dump(), "d_model": d, "n_heads": heads, "n_kv_heads": heads // kv_ratio,
                   "d_ff": d_ff, "n_layers": layers}
            out[(d, layers)] = sec
    members = []
    for sec in out.values():
        try:
            c = from_dict({**cfg.to_dict(), "model": sec}, validate=False)
        except ConfigError:
            continue
        members.append((param_count(c), sec))
    members.sort(key=lambda ps: ps[0])
    return [sec for _, sec in members]


def member(sec: dict, params: int) -> FamilyMember:
    return FamilyMember(d_model=sec["d_model"], n_layers=sec["n_layers"], n_heads=sec["n_heads"],
                        n_kv_heads=sec["n_kv_heads"], d_ff=sec["d_ff"], params=params)


