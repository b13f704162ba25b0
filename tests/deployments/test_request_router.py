"""The residency router's ranking (pure: tiers, the queue guard, two at random per rank)
and, on a real Serve app with two replicas of one model, the residency each replica
publishes and the placements it leads to: an adapter's requests stay where it is loaded,
and each replica's published residency equals its own state after loads and slot
evictions; a registered adapter is prefetched on one replica; the operator's residency
view (`GET /v1/admin/residency`, deployments/residency.py) equals the replicas' own
state, follows registration and deletion, and loses a killed replica's entry."""

from __future__ import annotations

import random
import shutil
import time

import pytest
import requests

from loraplex.deployments.replication import HOT_MIN_REQUESTS, PERIOD_S
from loraplex.deployments.request_router import (
    COLD,
    DEVICE,
    HOST,
    PREFIX_CHUNK_CHARS,
    PREFIX_CHUNK_TOKENS,
    ROUTING_STATS_PERIOD_S,
    PrefixOwners,
    RecentPlacements,
    ReplicaView,
    adapter_tier,
    home_replica,
    prompt_prefix_hashes,
    rank_replicas,
)
from loraplex.deployments.residency import STALE_AFTER_S
from loraplex.deployments.tenants import hash_key

STATS_SETTLE_S = 2.5 * ROUTING_STATS_PERIOD_S
"""Serve's controller polls each replica's residency once a period and pushes it to the
routers; this much later the router routes on what the test reads."""


def test_tiers_come_from_the_routing_stats():
    stats = {DEVICE: ["a"], HOST: ["a", "b"]}
    assert adapter_tier(stats, "a") == DEVICE
    assert adapter_tier(stats, "b") == HOST
    assert adapter_tier(stats, "d") == COLD
    assert adapter_tier(stats, "") == COLD, "the base model is one tier everywhere"


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


def test_the_prefix_replica_leads_its_tier_unless_overloaded():
    views = [
        ReplicaView("a", DEVICE, 0),
        ReplicaView("b", COLD, 1),
        ReplicaView("c", COLD, 0),
        ReplicaView("d", COLD, 9),
    ]
    assert rank_replicas(views, affine="b") == [["a"], ["b"], ["c"], ["d"]]
    assert rank_replicas(views, affine="a") == [["a"], ["b", "c"], ["d"]]
    assert rank_replicas(views, affine="d") == [["a"], ["b", "c"], ["d"]], "d is overloaded"
    assert rank_replicas(views, affine="gone") == [["a"], ["b", "c"], ["d"]]


def test_the_home_replica_leads_the_cold_tier_after_the_prefix_replica():
    views = [ReplicaView("a", HOST, 0), ReplicaView("b", COLD, 0), ReplicaView("c", COLD, 0)]
    assert rank_replicas(views, home="c") == [["a"], ["c"], ["b"]]
    assert rank_replicas(views, home="a") == [["a"], ["b", "c"]], "home only orders the cold"
    assert rank_replicas(views, affine="b", home="c") == [["a"], ["b"], ["c"]]
    busy = [ReplicaView("b", COLD, 0), ReplicaView("c", COLD, 9)]
    assert rank_replicas(busy, home="c") == [["b"], ["c"]], "an overloaded home waits"


def test_home_replicas_are_stable_spread_and_move_little_when_a_replica_leaves():
    replicas = [f"r{i}" for i in range(4)]
    adapters = [f"acme/lora-{i}@1" for i in range(400)]
    homes = {a: home_replica(a, replicas) for a in adapters}
    assert homes == {a: home_replica(a, list(reversed(replicas))) for a in adapters}
    counts = [list(homes.values()).count(r) for r in replicas]
    assert min(counts) > 60, f"spread over the replicas: {counts}"
    after = {a: home_replica(a, replicas[:3]) for a in adapters}
    moved = [a for a in adapters if after[a] != homes[a]]
    assert {homes[a] for a in moved} == {"r3"}, "only the gone replica's adapters move"
    assert home_replica("x", []) is None


def test_recent_placements_count_until_they_expire_and_stay_bounded():
    placements = RecentPlacements(ttl_s=10, capacity=3)
    placements.record("a", "r1", now=0)
    assert placements.holds("a", "r1", now=9.9) and not placements.holds("a", "r2", now=1)
    assert not placements.holds("a", "r1", now=10)
    placements.record("a", "r1", now=5)
    assert placements.holds("a", "r1", now=14), "a later request renews it"
    for i, replica in enumerate(["r2", "r3", "r4"]):
        placements.record("b", replica, now=6 + i)
    assert len(placements) == 3 and not placements.holds("a", "r1", now=9)
    placements.record("c", "r1", now=30)
    assert len(placements) == 1, "expired entries go"


class Call:
    def __init__(self, prompt=None, messages=None, cache_salt=None):
        self.prompt, self.messages, self.cache_salt = prompt, messages, cache_salt


def test_prefix_hashes_chain_full_chunks_per_adapter_and_salt():
    tokens = list(range(40))
    hashes = prompt_prefix_hashes(Call(tokens), "")
    assert len(hashes) == 40 // PREFIX_CHUNK_TOKENS
    longer = prompt_prefix_hashes(Call(tokens + [7] * 30), "")
    assert longer[: len(hashes)] == hashes and len(longer) == 70 // PREFIX_CHUNK_TOKENS
    assert prompt_prefix_hashes(Call([9] + tokens[1:]), "")[0] != hashes[0]
    assert prompt_prefix_hashes(Call(tokens), "acme/a@1") != hashes, "adapters apart"
    assert prompt_prefix_hashes(Call(tokens, cache_salt="acme"), "") != hashes, "tenants apart"
    text = "x" * (2 * PREFIX_CHUNK_CHARS + 5)
    assert len(prompt_prefix_hashes(Call(text), "")) == 2
    chat = [{"role": "user", "content": text}]
    assert len(prompt_prefix_hashes(Call(messages=chat), "")) >= 2
    assert prompt_prefix_hashes(Call(tokens[:5]), "") == [], "no full chunk"
    assert prompt_prefix_hashes("tokenize args", "") == []


def test_prefix_owners_answer_the_longest_live_prefix_and_forget_the_oldest():
    owners = PrefixOwners(capacity=5)
    short = prompt_prefix_hashes(Call(list(range(32))), "")
    long = prompt_prefix_hashes(Call(list(range(48))), "")
    owners.record(short, "a")
    owners.record(long, "b")
    assert owners.owner(long, {"a", "b"}) == ("b", 3)
    assert owners.owner(short, {"a", "b"}) == ("b", 2), "b served that prefix last"
    assert owners.owner(long, {"a"}) == (None, 0), "b is gone, a's entries were replaced"
    owners.record(prompt_prefix_hashes(Call([5] * 48), ""), "c")
    assert len(owners) == 5 and owners.owner(long[:1], {"b"}) == (None, 0), "oldest forgotten"
    assert owners.owner(long, {"b"}) == ("b", 3)


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
    max_num_seqs = config.engine_config().scheduler.max_num_seqs
    assert router.request_router_kwargs == {"prefix_affinity": True, "queue_slack": max_num_seqs}
    baseline = ModelDeploymentConfig(
        name="m", model=config.model, server={"request_router": "power_of_two"}
    )
    deployment = bind_model_server(baseline, str(tmp_path))._bound_deployment
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("PowerOfTwoChoicesRequestRouter")


# ---- served ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_app(serve_setup, operator_key):
    """A second app in the session's Ray: two replicas of the tiny model, one LoRA slot
    each, three shared adapters."""
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "auth": "none",
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
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "adapters": {n: str(serve_setup.shared[n]) for n in list(serve_setup.shared)[:3]},
                "server": {"num_cpus": 0.05, "num_replicas": 2},
            }
        ],
        "operator": {"api_key_sha256": [hash_key(operator_key)]},
    }
    serve.run(build_app(config), name="pair", route_prefix="/pair")
    yield f"{serve_setup.url}/pair", list(serve_setup.shared)[:3]
    serve.delete("pair")


def replica_names() -> list[str]:
    """The actor names of the pair's two model replicas (`...#model-pair#<unique id>`)."""
    import ray

    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if "#model-pair#" in entry["name"] and entry["name"].startswith("SERVE_REPLICA")
    ]
    assert len(names) == 2, names
    return sorted(names)


def residency(names: list[str]) -> list[dict]:
    """Each replica's adapters by tier and the requests it served per model id, asked
    of that replica itself (`replica_info`, pinned by its unique id)."""
    from ray import serve

    handle = serve.get_deployment_handle("model-pair", "pair")
    states = []
    for name in names:
        replica = name.rsplit("#", 1)[-1]
        state = handle.replica_info.remote(replica=replica).result(timeout_s=30)
        assert state is not None and state["replica"] == replica, (replica, state)
        states.append(state)
    return states


def complete(url: str, model: str) -> None:
    response = requests.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_requests_follow_their_adapter_and_residency_is_published(pair_app):
    url, adapters = pair_app
    names = replica_names()
    rng = random.Random(7)
    for step in range(10):
        adapter = adapters[rng.randrange(len(adapters))] if step else adapters[0]
        time.sleep(STATS_SETTLE_S)  # the router's view catches up with the replicas'
        before = residency(names)
        complete(url, f"pair:{adapter}")
        after = residency(names)
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


def test_a_registered_adapter_is_prefetched_on_one_replica(pair_app, serve_setup):
    """Registering an adapter warms it in one replica's host memory before any request
    (the ingress's prefetch); its first request then goes to that replica."""
    url, adapters = pair_app
    owner_root = serve_setup.adapter_root / "anonymous"
    owner_root.mkdir(exist_ok=True)
    shutil.copytree(serve_setup.shared[adapters[0]], owner_root / "warm", dirs_exist_ok=True)
    names = replica_names()
    response = requests.post(
        f"{url}/v1/adapters", json={"model": "pair", "name": "warm", "path": "warm"}, timeout=60
    )
    assert response.status_code == 201, response.text
    deadline = time.monotonic() + 30
    holders: list[int] = []
    while not holders and time.monotonic() < deadline:
        time.sleep(0.2)
        state = residency(names)
        holders = [i for i in range(2) if any(_name(m) == "warm" for m in state[i][HOST])]
    assert len(holders) == 1, f"one replica holds the new adapter: {state}"
    model_id = next(m for m in state[holders[0]][HOST] if _name(m) == "warm")
    assert not any(model_id in s["requests"] for s in state), "no request ran it yet"
    time.sleep(STATS_SETTLE_S)  # the router's view catches up with the replicas'
    complete(url, "pair:warm")
    after = residency(names)
    assert after[holders[0]]["requests"].get(model_id) == 1, after


def base_requests(states) -> list[int]:
    return [s["requests"].get("", 0) for s in states]


def test_serving_leaves_the_routing_stats_unchanged(pair_app):
    """Serve's controller rebroadcasts a replica's routing stats to every router each time
    they change: requests that load nothing must leave them as they were (the counts
    that move with every request go to the residency registry instead)."""
    import ray

    url, adapters = pair_app
    complete(url, f"pair:{adapters[0]}")
    actors = [ray.get_actor(name, namespace="serve") for name in replica_names()]
    before = ray.get([actor.record_routing_stats.remote() for actor in actors])
    served_before = base_requests(residency(replica_names()))
    for _ in range(4):
        complete(url, "pair")
        complete(url, f"pair:{adapters[0]}")
    after = ray.get([actor.record_routing_stats.remote() for actor in actors])
    assert sum(base_requests(residency(replica_names()))) == sum(served_before) + 4
    assert after == before


def test_a_repeated_prefix_lands_on_the_replica_that_served_it(pair_app):
    """Base-model prompts sharing a 48-token prefix (3 chunks) with different endings:
    after the first, four sent at once all go where the first went (their queue stays
    within the guard's slack); by queue length alone they would spread over both."""
    from concurrent.futures import ThreadPoolExecutor

    url, _ = pair_app
    names = replica_names()
    prefix = [(7 * i) % 50 + 5 for i in range(48)]

    def send(ending: int) -> None:
        response = requests.post(
            f"{url}/v1/completions",
            json={
                "model": "pair",
                "prompt": prefix + [ending + 5] * 4,
                "max_tokens": 12,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text

    before = base_requests(residency(names))
    send(0)
    middle = base_requests(residency(names))
    (owner,) = [i for i in range(2) if middle[i] > before[i]]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(send, range(1, 5)))
    after = base_requests(residency(names))
    assert after[owner] - middle[owner] == 4, f"spread: {middle} -> {after}, owner {owner}"


def residency_view(url: str, key: str, model: str | None = "pair") -> dict:
    response = requests.get(
        f"{url}/v1/admin/residency",
        params={} if model is None else {"model": model},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    (entry,) = response.json()["data"]
    return entry


def tiers(states) -> list[tuple[list[str], list[str]]]:
    return sorted((sorted(s[DEVICE]), sorted(s[HOST])) for s in states)


def test_the_operator_residency_view_is_the_replicas_own_state(pair_app, operator_key):
    url, adapters = pair_app
    names = replica_names()
    for adapter in adapters:
        complete(url, f"pair:{adapter}")
    own = residency(names)
    deadline = time.monotonic() + 10
    view = residency_view(url, operator_key)
    while tiers(view["replicas"]) != tiers(own) and time.monotonic() < deadline:
        time.sleep(0.3)
        own, view = residency(names), residency_view(url, operator_key)
    assert tiers(view["replicas"]) == tiers(own), (view, own)
    assert len({r["replica"] for r in view["replicas"]}) == 2
    for replica in view["replicas"]:
        assert replica["model"] == "pair" and replica["node_id"] and replica["age_s"] < 5
        for model_id, count in replica["demand"].items():
            assert 0 < count <= replica["requests"][model_id]
    served = {m for r in view["replicas"] for m in r["demand"]}
    assert {_name(m) for m in served} >= set(adapters), "each adapter's requests count"
    assert {_name(m) for m in view["disk"]} >= set(adapters), "shared adapters are on disk"


def test_the_residency_view_needs_the_operator_key(pair_app):
    url, _ = pair_app
    for headers in ({}, {"Authorization": "Bearer sk-not-the-operator"}):
        response = requests.get(f"{url}/v1/admin/residency", headers=headers, timeout=30)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_residency_view_names_an_unknown_model(pair_app, operator_key):
    url, _ = pair_app
    response = requests.get(
        f"{url}/v1/admin/residency",
        params={"model": "nope"},
        headers={"Authorization": f"Bearer {operator_key}"},
        timeout=30,
    )
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]


def test_a_deleted_adapter_leaves_the_disk_tier(pair_app, serve_setup, operator_key):
    url, adapters = pair_app
    owner_root = serve_setup.adapter_root / "anonymous"
    owner_root.mkdir(exist_ok=True)
    shutil.copytree(serve_setup.shared[adapters[1]], owner_root / "brief", dirs_exist_ok=True)
    response = requests.post(
        f"{url}/v1/adapters", json={"model": "pair", "name": "brief", "path": "brief"}, timeout=60
    )
    assert response.status_code == 201, response.text
    assert "brief" in {_name(m) for m in residency_view(url, operator_key)["disk"]}
    response = requests.delete(f"{url}/v1/adapters/pair/brief", timeout=60)
    assert response.status_code == 200, response.text
    assert "brief" not in {_name(m) for m in residency_view(url, operator_key)["disk"]}


def test_a_hot_adapter_is_loaded_on_the_other_replica_before_its_requests_go_there(pair_app):
    """40 requests in a row for one adapter are most of the app's demand: the registry's
    replicator loads it on the replica that lacks it (deployments/replication.py), which
    serves none of its requests before (one at a time, they stay with the holder)."""
    url, adapters = pair_app
    names = replica_names()
    adapter = adapters[1]
    complete(url, f"pair:{adapter}")
    state = residency(names)
    model_id = next(m for s in state for m in s["requests"] if _name(m) == adapter)
    lacking = [i for i in range(2) if model_id not in state[i][HOST]]
    assert len(lacking) == 1, f"one replica holds it: {state}"
    served_before = state[lacking[0]]["requests"].get(model_id, 0)
    for _ in range(HOT_MIN_REQUESTS * 2):
        complete(url, f"pair:{adapter}")
    deadline = time.monotonic() + PERIOD_S + STALE_AFTER_S + 20
    while model_id not in state[lacking[0]][HOST]:
        assert time.monotonic() < deadline, f"not replicated: {state}"
        time.sleep(0.5)
        state = residency(names)
    assert state[lacking[0]]["requests"].get(model_id, 0) == served_before, "loaded ahead"


def test_a_killed_replica_leaves_the_residency_view(pair_app, operator_key):
    """Last in this module: it kills one of the app's replicas; the view drops it, and
    the replica Serve starts in its place joins."""
    import ray

    url, _ = pair_app

    def live() -> set[str]:
        return {r["replica"] for r in residency_view(url, operator_key)["replicas"]}

    before = live()
    assert len(before) == 2
    ray.kill(ray.get_actor(replica_names()[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + STALE_AFTER_S + 10
    now = live()
    while len(now & before) != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
        now = live()
    assert len(now & before) == 1, f"the killed replica's entry stays: {before} -> {now}"
    deadline = time.monotonic() + 90
    while len(now) != 2 and time.monotonic() < deadline:
        time.sleep(1)
        now = live()
    assert len(now) == 2 and len(now - before) == 1, f"no replacement joined: {before} -> {now}"
