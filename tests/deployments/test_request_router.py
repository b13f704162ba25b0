"""The residency router's ranking (pure: tiers, the queue guard, two at random per rank)
and, on a real Serve app with two replicas of one model, the residency each replica
publishes and the placements it leads to: an adapter's requests stay where it is loaded,
and each replica's published residency equals its own state after loads and slot
evictions."""

from __future__ import annotations

import random
import time

import pytest

from loraplex.deployments.request_router import (
    COLD,
    DEVICE,
    HOST,
    ROUTING_STATS_PERIOD_S,
    ReplicaView,
    adapter_tier,
    rank_replicas,
)

STATS_SETTLE_S = 2.5 * ROUTING_STATS_PERIOD_S
"""Serve's controller polls each replica's residency once a period and pushes it to the
routers; this much later the router routes on what the test reads."""


def test_tiers_come_from_the_routing_stats_and_serves_multiplexed_ids():
    stats = {DEVICE: ["a"], HOST: ["a", "b"]}
    assert adapter_tier(stats, set(), "a") == DEVICE
    assert adapter_tier(stats, set(), "b") == HOST
    assert adapter_tier({}, {"c"}, "c") == HOST, "Serve's own view counts as host memory"
    assert adapter_tier(stats, {"c"}, "d") == COLD
    assert adapter_tier(stats, {"a"}, "") == COLD, "the base model is one tier everywhere"


def test_ranks_follow_the_tiers_then_the_overloaded():
    views = [
        ReplicaView("cold", COLD, 0),
        ReplicaView("host", HOST, 1),
        ReplicaView("device", DEVICE, 2),
        ReplicaView("busy-device", DEVICE, 9),
    ]
    assert rank_replicas(views, queue_slack=4) == [["device"], ["host"], ["cold"], ["busy-device"]]
    assert rank_replicas(views, queue_slack=9) == [
        ["device", "busy-device"],
        ["host"],
        ["cold"],
    ]


def test_unknown_queue_lengths_keep_their_tier():
    views = [ReplicaView("new", DEVICE, None), ReplicaView("old", COLD, 30)]
    assert rank_replicas(views, queue_slack=4) == [["new"], ["old"]]


def test_a_large_rank_offers_two_at_random_first():
    views = [ReplicaView(i, HOST, 0) for i in range(6)] + [ReplicaView("c", COLD, 0)]
    ranks = rank_replicas(views, rng=random.Random(3))
    assert len(ranks[0]) == 2 and set(ranks[0]) < set(range(6))
    assert sorted(ranks[0] + ranks[1]) == list(range(6))
    assert ranks[2] == ["c"]
    firsts = {tuple(sorted(rank_replicas(views, rng=random.Random(s))[0])) for s in range(20)}
    assert len(firsts) > 3, "the pair is drawn at random"


def test_every_model_deployment_routes_with_it(tiny_model_factory, tmp_path):
    """Wiring: the deployment's Serve config names the router and its stats period
    (read from the bound deployment, as Serve's controller reads it)."""
    from loraplex.deployments.app import bind_model_server
    from loraplex.deployments.config import ModelDeploymentConfig
    from loraplex.deployments.request_router import ROUTING_STATS_PERIOD_S

    config = ModelDeploymentConfig(name="m", model=str(tiny_model_factory("llama")))
    deployment = bind_model_server(config, str(tmp_path))._bound_deployment
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == "loraplex.deployments.request_router.ResidencyRouter"
    assert router.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S


# ---- served ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_app(serve_setup):
    """A second app in the session's Ray: two replicas of the tiny model, one LoRA slot
    each, three shared adapters."""
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "adapter_root": str(serve_setup.adapter_root),
        "models": [
            {
                "name": "pair",
                "model": str(serve_setup.base),
                "engine": {
                    "dtype": "float32",
                    "max_model_len": 64,
                    "max_loras": 1,
                    "max_cpu_loras": 4,
                    "max_lora_rank": 8,
                },
                "adapters": {n: str(serve_setup.shared[n]) for n in list(serve_setup.shared)[:3]},
                "server": {"num_cpus": 0.05, "num_replicas": 2},
            }
        ],
    }
    serve.run(build_app(config), name="pair", route_prefix="/pair")
    yield f"{serve_setup.url}/pair", list(serve_setup.shared)[:3]
    serve.delete("pair")


def replica_actors():
    import ray

    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if "#model-pair#" in entry["name"] and entry["name"].startswith("SERVE_REPLICA")
    ]
    assert len(names) == 2, names
    return [ray.get_actor(name, namespace="serve") for name in sorted(names)]


def residency(actors) -> list[dict]:
    import ray

    return ray.get([actor.record_routing_stats.remote() for actor in actors])


def complete(url: str, model: str) -> None:
    import requests

    response = requests.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_requests_follow_their_adapter_and_residency_is_published(pair_app):
    url, adapters = pair_app
    actors = replica_actors()
    rng = random.Random(7)
    for step in range(10):
        adapter = adapters[rng.randrange(len(adapters))] if step else adapters[0]
        time.sleep(STATS_SETTLE_S)  # the router's view catches up with the replicas'
        before = residency(actors)
        complete(url, f"pair:{adapter}")
        after = residency(actors)
        served = [
            i
            for i in range(2)
            if sum(after[i]["requests"].values()) > sum(before[i]["requests"].values())
        ]
        assert len(served) == 1, (before, after)
        model_id = next(m for m in after[served[0]]["requests"] if _name(m) == adapter)
        for tier in (DEVICE, HOST):
            holders = [i for i in range(2) if model_id in before[i][tier]]
            if holders:
                assert served[0] in holders, (step, adapter, tier, before)
                break
        # Each replica's published residency is its own state: the slot holds the
        # adapter it just ran, which its host tier also holds.
        assert model_id in after[served[0]][DEVICE]
        for state in after:
            assert set(state[DEVICE]) <= set(state[HOST])
            assert len(state[DEVICE]) <= 1, "one LoRA slot per replica"


def _name(model_id: str) -> str:
    """An adapter's name in its multiplexed model id (`owner/name@version`)."""
    return model_id.split("/", 1)[-1].rsplit("@", 1)[0]
