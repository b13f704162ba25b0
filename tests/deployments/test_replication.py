"""Hot-adapter replication's plan from the residency view (deployments/replication.py),
its cooldown, and the router's ranking of a replication call; the served replication is
in test_request_router.py (the pair app)."""

from __future__ import annotations

from loraplex.deployments.replication import (
    COOLDOWN_S,
    HOT_MIN_REQUESTS,
    PERIOD_S,
    HotAdapterReplicator,
    Replication,
    replication_plan,
)
from loraplex.deployments.request_router import (
    COLD,
    DEVICE,
    HOST,
    ReplicaView,
    rank_for_replication,
)


def replica(name: str, host: list[str], demand: dict[str, int], model: str = "m") -> dict:
    return {"model": model, "replica": name, "host": host, "demand": demand}


def test_an_adapter_above_its_holders_share_of_the_demand_gets_one_more_holder():
    hot = 3 * HOT_MIN_REQUESTS
    view = [
        replica("r1", ["hot", "warm"], {"hot": hot, "warm": HOT_MIN_REQUESTS}),
        replica("r2", ["cold"], {"cold": 1, "": 30}),
        replica("r3", [], {"": 29}),
    ]
    assert replication_plan(view) == [Replication("m", "hot", hot, 1, 2)]
    view[1]["host"].append("hot")
    assert replication_plan(view) == [], "two holders are its share"


def test_no_replication_below_the_minimum_demand_alone_or_for_the_base_model():
    few = HOT_MIN_REQUESTS - 1
    assert replication_plan([replica("r1", ["a"], {"a": few}), replica("r2", [], {})]) == []
    assert replication_plan([replica("r1", ["a"], {"a": 500})]) == [], "one replica"
    assert replication_plan([replica("r1", [], {"": 500}), replica("r2", [], {})]) == []
    other = [replica("r1", ["a"], {"a": 500}), replica("q1", [], {}, model="other")]
    assert replication_plan(other) == [], "replicas of another model do not count"


def test_every_replica_holds_an_adapter_that_is_all_the_demand():
    view = [replica(f"r{i}", ["a"] if i < 3 else [], {"a": 100}) for i in range(4)]
    assert replication_plan(view) == [Replication("m", "a", 400, 3, 4)]


def test_the_replicator_sends_an_adapter_once_per_cooldown():
    now = [0.0]
    view = [replica("r1", ["a"], {"a": 100}), replica("r2", [], {})]
    replicator = HotAdapterReplicator(lambda: view, lambda r: None, clock=lambda: now[0])
    assert [r.model_id for r in replicator.due()] == ["a"]
    now[0] = COOLDOWN_S - 1
    assert replicator.due() == []
    now[0] = COOLDOWN_S
    assert [r.model_id for r in replicator.due()] == ["a"]


def test_a_replication_call_goes_to_a_replica_without_the_adapter_home_first():
    views = [
        ReplicaView("d", DEVICE, 0),
        ReplicaView("h", HOST, 0),
        ReplicaView("c1", COLD, 5),
        ReplicaView("c2", COLD, 0),
    ]
    assert rank_for_replication(views, home="c1") == [["c1"], ["c2"], ["d", "h"]]
    assert rank_for_replication(views, home="d") == [["c1", "c2"], ["d", "h"]]
    assert rank_for_replication(views[:2]) == [["d", "h"]], "all hold it: any of them"


def test_the_cooldowns_kept_are_those_of_the_last_cooldown_only():
    """Every register or unload mints a model id: 10,000 hot ids one after another
    leave only the cooldowns that can still hold an adapter back."""
    now = [0.0]
    view = [replica("r1", [], {}), replica("r2", [], {})]
    replicator = HotAdapterReplicator(lambda: view, lambda r: None, clock=lambda: now[0])
    for i in range(10_000):
        model_id = f"t/a@{i}"
        view[0]["host"], view[0]["demand"] = [model_id], {model_id: 100}
        assert [r.model_id for r in replicator.due()] == [model_id]
        now[0] += PERIOD_S
    assert len(replicator._sent_at) <= COOLDOWN_S / PERIOD_S + 1
