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
