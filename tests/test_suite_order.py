"""The suite's run order (tests/conftest.py, _in_lanes): under xdist each lane of launching tests (the pooled
white-boxes, the cold starts, the other forkserver launches; the last two share a lane on two workers) fills one
worker's first batch (len(items) // workers // 4 consecutive tests), padded with quick tests; without xdist, or when
a lane outgrows a batch, the launching tests simply come first. Fake items: only their marks matter."""

from __future__ import annotations

import pytest

from tests.conftest import COLD, FORKED, POOL, _in_lanes


class Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.name, self.marks = name, set(marks)

    def get_closest_marker(self, mark: str) -> object | None:
        return mark if mark in self.marks else None


def _suite(n_pool: int, n_cold: int, n_forked: int, n_slow: int, n_quick: int) -> tuple[list[Item], dict[int, int]]:
    quick = [Item(f"q{i}") for i in range(n_quick)]
    slow = [Item(f"s{i}", "slow") for i in range(n_slow)]
    pool = [Item(f"p{i}", "multirank") for i in range(n_pool)]
    cold = [Item(f"c{i}", "multirank", "slow") for i in range(n_cold)]
    forked = [Item(f"f{i}", "multirank") for i in range(n_forked)]
    lane_of = {**{id(it): POOL for it in pool}, **{id(it): COLD for it in cold}, **{id(it): FORKED for it in forked}}
    return [*quick, *cold, *slow, *forked, *pool], lane_of


def test_each_lane_fills_one_workers_first_batch(monkeypatch):
    items, lane_of = _suite(4, 3, 2, 5, 58)  # 72 tests, 3 workers: batches of 6
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    order = [it.name for it in _in_lanes(items, lane_of)]
    assert sorted(order) == sorted(it.name for it in items)
    assert order[:6] == ["p0", "p1", "p2", "p3", "q56", "q57"]  # worker 1: the pooled white-boxes, quick pads
    assert order[6:12] == ["c0", "c1", "c2", "q53", "q54", "q55"]  # worker 2: the cold lane
    assert order[12:18] == ["f0", "f1", "q49", "q50", "q51", "q52"]  # worker 3: the other forkserver launches
    assert order[18:23] == [f"s{i}" for i in range(5)]  # then slow first, to whichever worker runs short


def test_on_two_workers_the_forkserver_launches_join_the_cold_lane(monkeypatch):
    items, lane_of = _suite(4, 3, 2, 5, 58)  # 72 tests, 2 workers: batches of 9
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    order = [it.name for it in _in_lanes(items, lane_of)]
    assert order[:9] == ["p0", "p1", "p2", "p3", "q53", "q54", "q55", "q56", "q57"]
    assert order[9:18] == ["c0", "c1", "c2", "f0", "f1", "q49", "q50", "q51", "q52"]


def test_without_xdist_or_with_a_lane_too_long_launching_tests_come_first(monkeypatch):
    items, lane_of = _suite(4, 3, 2, 5, 58)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    first = [it.name for it in _in_lanes(items, lane_of)][:14]
    assert first == ["c0", "c1", "c2", "f0", "f1", "p0", "p1", "p2", "p3", "s0", "s1", "s2", "s3", "s4"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    items, lane_of = _suite(9, 3, 2, 5, 58)  # 77 tests: batches of 6, and 9 pooled tests do not fit in one
    assert [it.name for it in _in_lanes(items, lane_of)][:3] == ["c0", "c1", "c2"]


# --------------------------------------------------------------------------- ranks forked unless torchrun


@pytest.mark.multirank
def test_a_multirank_test_forks_its_ranks_by_default():
    import curry_train.train.launch as launch
    import curry_train_mcp.jobs as jobs

    from tests.forkrun import ForkJob

    assert launch.start_torchrun is ForkJob and jobs.WORKER == "tests.forkworker"


@pytest.mark.multirank
@pytest.mark.torchrun
def test_a_test_marked_torchrun_gets_the_real_launcher_and_worker():
    import curry_train.train.launch as launch
    import curry_train_mcp.jobs as jobs

    assert launch.start_torchrun.__module__ == "curry_train.train.launch" and jobs.WORKER == "curry_train_mcp.worker"
