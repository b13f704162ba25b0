"""The residency registry (deployments/residency.py) on its own: reports replace each
other per replica, a withdrawn or silent replica leaves the view, and demand counts the
requests of the window. The served view is tested with two replicas in
test_request_router.py."""

from __future__ import annotations

import pytest

from loraplex.deployments import residency
from loraplex.deployments.residency import (
    DEMAND_WINDOW_S,
    STALE_AFTER_S,
    ReplicaResidency,
    ResidencyRegistry,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(residency.time, "monotonic", clock)
    return clock


def report(replica: str, requests: dict[str, int], model: str = "m") -> ReplicaResidency:
    return ReplicaResidency(model, replica, "node", ["a"], ["a", "b"], requests)


def test_the_latest_report_of_each_replica_is_the_view(clock):
    registry = ResidencyRegistry()
    registry.publish(report("r1", {"a": 1}))
    registry.publish(report("r2", {}))
    registry.publish(report("r1", {"a": 3}, model="other"))
    clock.now += 1
    registry.publish(report("r1", {"a": 2}))
    view = registry.view("m")
    assert [(v["replica"], v["requests"]) for v in view] == [("r1", {"a": 2}), ("r2", {})]
    assert view[0]["device"] == ["a"] and view[0]["host"] == ["a", "b"]
    assert view[0]["age_s"] == 0.0 and view[1]["age_s"] == 1.0
    assert len(registry.view()) == 3


def test_withdrawn_and_silent_replicas_leave(clock):
    registry = ResidencyRegistry()
    registry.publish(report("r1", {}))
    registry.publish(report("r2", {}))
    registry.withdraw("m", "r1")
    registry.withdraw("m", "nobody")
    assert [v["replica"] for v in registry.view()] == ["r2"]
    clock.now += STALE_AFTER_S + 0.1
    assert registry.view() == []


def test_demand_is_the_requests_of_the_window(clock):
    registry = ResidencyRegistry()
    registry.publish(report("r1", {"a": 10, "b": 4}))
    clock.now += 1
    registry.publish(report("r1", {"a": 12, "b": 4}))
    assert registry.view()[0]["demand"] == {"a": 2}
    for _ in range(int(DEMAND_WINDOW_S) + 5):
        clock.now += 1
        registry.publish(report("r1", {"a": 12, "b": 4}))
    assert registry.view()[0]["demand"] == {}, "older requests left the window"
    clock.now += 1
    registry.publish(report("r1", {"a": 12, "b": 9, "c": 1}))
    assert registry.view()[0]["demand"] == {"b": 5, "c": 1}


def history_ids(registry: ResidencyRegistry, replica: str = "r1") -> tuple[int, set[str]]:
    """(snapshots, model ids over all of them) the registry keeps for a replica's demand."""
    history = registry._entries[("m", replica)].history
    return len(history), {model_id for _, requests in history for model_id in requests}


def test_demand_history_holds_only_the_window_and_the_ids_still_reported(clock):
    """10,000 adapters loaded and evicted one after another (each a new model id), the
    view never read: the history keeps the window's reports, of the ids reported now."""
    registry = ResidencyRegistry()
    for i in range(10_000):
        clock.now += 1
        registry.publish(report("r1", {"": i, f"t/a@{i}": 1, f"t/a@{i + 1}": 1}))
    snapshots, ids = history_ids(registry)
    assert snapshots <= DEMAND_WINDOW_S + 2
    assert ids == {"", "t/a@9999", "t/a@10000"}
    demand = registry.view()[0]["demand"]
    assert demand == {"": int(DEMAND_WINDOW_S), "t/a@9999": 1, "t/a@10000": 1}


def test_a_count_that_restarted_counts_from_zero(clock):
    """A replica forgets an evicted adapter's count; loaded again, it counts anew."""
    registry = ResidencyRegistry()
    registry.publish(report("r1", {"a": 50}))
    clock.now += 1
    registry.publish(report("r1", {"a": 3}))
    assert registry.view()[0]["demand"] == {"a": 3}


def test_a_restarted_count_leaves_the_older_reports(clock):
    registry = ResidencyRegistry()
    registry.publish(report("r1", {"a": 50}))
    clock.now += 1
    registry.publish(report("r1", {"a": 3}))
    clock.now += 1
    registry.publish(report("r1", {"a": 60}))
    assert registry.view()[0]["demand"] == {"a": 60}
