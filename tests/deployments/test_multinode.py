"""Two Ray nodes on this machine (`ray start --head`, `ray start --address=...`, each
with 1 CPU; tests/deployments/ray_nodes.py) and the app deployed with `serve deploy`, as
docs/operations.md's "Adding a node" does it. Its own cluster: the session's Ray instance is left
alone, so the file runs alone or inside the whole suite.

- `tiny` has two replicas, at most one per node: one lands on each node (Serve's replica
  details name their node ids);
- a tenant registers an adapter once; requests for it are answered on both nodes (each
  node's metrics agent counts them under its own replica): the registration reaches
  every replica through the adapter root the nodes share, here the machine's disk;
- a tensor-parallel replica with STRICT_PACK gets both rank bundles on one node (the
  state API's placement group), and answers;
- one whose bundles fit only across the two nodes fails its deploy, naming why;
- the ingress's `/metrics` reads its own node's metrics agent (the nodes share an IP);
- killing the second node's raylet leaves the app serving, adapter included, from the
  head node (last: it takes the second node away).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from ray_nodes import LocalCluster

from loraplex.deployments.tenants import hash_key

KEY = "sk-multinode-test"
ADAPTER = "mine"
PROMPT = [5, 6, 7, 8, 9, 10]
ENGINE = {
    "dtype": "float32",
    "max_model_len": 128,
    "max_lora_rank": 8,
    "kv_cache_memory_bytes": 1 << 26,
}
"""Each replica's KV cache is bounded: the default (a tenth of host memory) per replica of two
clusters at once can reach Ray's memory monitor, which then kills workers."""
DEPLOY_TIMEOUT_S = 600


def completion(url: str, model: str) -> tuple[int, dict]:
    """(status, JSON body) of one greedy completion; status 0 when no answer came."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({**body, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")}
    except OSError as error:
        return 0, {"error": repr(error)}


def text_of(url: str, model: str) -> str:
    status, body = completion(url, model)
    assert status == 200, body
    return body["choices"][0]["text"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:  # the dashboard did not answer this time
            value = None
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def app_config(name: str, prefix: str, args: dict) -> dict:
    return {
        "name": name,
        "route_prefix": prefix,
        "import_path": "loraplex.deployments.app:build_app",
        "args": args,
    }


def tp_model(base: Path, rank0_cpus: float, worker_cpus: float) -> dict:
    return {
        "name": "tp",
        "model": str(base),
        "engine": {
            **ENGINE,
            "max_loras": 0,
            "tensor_parallel_size": 2,
            "worker_num_cpus": worker_cpus,
            "distributed_timeout_s": 20,
        },
        "server": {"num_cpus": rank0_cpus, "placement_group_strategy": "STRICT_PACK"},
    }


@pytest.fixture(scope="module")
def cluster(pick_port):
    temp_dir = Path(tempfile.mkdtemp(prefix="lpx-nodes-", dir="/tmp"))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_metrics_report_interval_ms": "1000",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    nodes = LocalCluster(temp_dir, pick_port, env)
    try:
        nodes.add_node(num_cpus=1)
        nodes.add_node(num_cpus=1)
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def app(cluster, tiny_model_factory, peft_adapter_factory, tmp_path_factory, pick_port):
    """The three applications, deployed at once; the URL of the proxy on the head."""
    base = tiny_model_factory("llama")
    adapter_root = tmp_path_factory.mktemp("multinode-adapters")
    peft_adapter_factory(base, adapter_root / "acme" / ADAPTER, rank=4, seed=21)
    loraplex = {
        "adapter_root": str(adapter_root),
        "models": [
            {
                "name": "tiny",
                "model": str(base),
                "engine": {**ENGINE, "max_loras": 2},
                # One request at a time per replica: a second concurrent request for the
                # adapter goes to the replica that does not hold it yet.
                "server": {
                    "num_cpus": 0.1,
                    "num_replicas": 2,
                    "max_replicas_per_node": 1,
                    "max_ongoing_requests": 1,
                    "health_check_period_s": 1,
                },
            }
        ],
        "tenants": [{"name": "acme", "api_key_sha256": [hash_key(KEY)]}],
        "metrics_public": True,
    }
    port = pick_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            app_config("loraplex", "/", loraplex),
            app_config("tp", "/tp", {"auth": "none", "models": [tp_model(base, 0.1, 0.4)]}),
            app_config(
                "tp-too-big",
                "/tp-too-big",
                {"auth": "none", "models": [tp_model(base, 0.6, 0.6)]},
            ),
        ],
    }
    path = tmp_path_factory.mktemp("multinode-config") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    cluster.serve_deploy(path)
    settled = {"loraplex": "RUNNING", "tp": "RUNNING", "tp-too-big": "DEPLOY_FAILED"}

    seen: list[dict] = []

    def deployed():
        apps = cluster.serve()
        seen[:] = [
            {
                name: (
                    details["status"],
                    details.get("message", "")[:300],
                    {
                        d: (
                            dd["status"],
                            dd.get("message", "")[:200],
                            [r["state"] for r in dd["replicas"]],
                        )
                        for d, dd in details.get("deployments", {}).items()
                    },
                )
                for name, details in apps.items()
            }
        ]
        statuses = {name: details["status"] for name, details in apps.items()}
        failed = [n for n, s in statuses.items() if s == "DEPLOY_FAILED" and settled[n] != s]
        assert not failed, apps
        return statuses == settled

    try:
        wait_for(deployed, DEPLOY_TIMEOUT_S, f"applications {settled}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from None
    return f"http://127.0.0.1:{port}"


def node_ids(cluster) -> tuple[str, str]:
    """(head node id, second node id)."""
    nodes = sorted(cluster.alive_nodes(), key=lambda node: not node["is_head_node"])
    assert [node["is_head_node"] for node in nodes] == [True, False]
    return nodes[0]["node_id"], nodes[1]["node_id"]


def running_replicas(cluster, app: str, deployment: str) -> list[dict]:
    replicas = cluster.serve()[app]["deployments"][deployment]["replicas"]
    return [replica for replica in replicas if replica["state"] == "RUNNING"]


def label(series: str, name: str) -> str:
    return series.split(f'{name}="', 1)[1].split('"', 1)[0]


def adapter_requests(text: str) -> dict[str, float]:
    """replica -> loraplex_adapter_requests_total of the tenant adapter, from one node's
    Prometheus text."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_loraplex_adapter_requests_total{") and f":{ADAPTER}" in line:
            series, value = line.rsplit(" ", 1)
            replica = label(series, "replica")
            counts[replica] = counts.get(replica, 0.0) + float(value)
    return counts


def test_model_replicas_run_on_both_nodes(cluster, app):
    head, second = node_ids(cluster)
    replicas = running_replicas(cluster, "loraplex", "model-tiny")
    assert sorted(replica["node_id"] for replica in replicas) == sorted([head, second])


def test_the_ingress_metrics_are_those_of_its_own_node(cluster, app):
    """`/metrics` reads the metrics agent of the ingress's node, found by node id: here
    both nodes share one address. The model replicas on /metrics are those the state API
    places on the ingress's node (both read again until they agree: a replica replaced
    under load gets a new id)."""
    seen: list[tuple[set[str], set[str]]] = []

    def local_replicas() -> set[str]:
        (ingress,) = running_replicas(cluster, "loraplex", "OpenAIIngress")
        return {
            replica["replica_id"]
            for replica in running_replicas(cluster, "loraplex", "model-tiny")
            if replica["node_id"] == ingress["node_id"]
        }

    def model_replicas_in_metrics() -> set[str]:
        with urllib.request.urlopen(f"{app}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        return {
            label(line, "replica")
            for line in lines
            if line.startswith("vllm:") and 'model_name="tiny"' in line
        }

    def agree() -> bool:
        seen.append((model_replicas_in_metrics(), local_replicas()))
        return bool(seen[-1][0]) and seen[-1][0] == seen[-1][1]

    try:
        wait_for(agree, 60, "model metrics on /metrics")
    except AssertionError:
        raise AssertionError(f"/metrics vs the ingress node's replicas: {seen[-3:]}") from None


def test_a_registered_adapter_is_served_on_both_nodes(cluster, app):
    request = urllib.request.Request(
        f"{app}/v1/adapters",
        data=json.dumps({"model": "tiny", "name": ADAPTER, "path": ADAPTER}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 201
    base_text = text_of(app, "tiny")
    replica_node = {
        replica["replica_id"]: replica["node_id"]
        for replica in running_replicas(cluster, "loraplex", "model-tiny")
    }
    texts: set[str] = set()

    def served_on_both_nodes():
        with ThreadPoolExecutor(4) as pool:
            texts.update(pool.map(lambda _: text_of(app, f"tiny:{ADAPTER}"), range(4)))
        counted = {}
        for node in cluster.nodes:
            counted.update(adapter_requests(node.metrics_text()))
        return {replica_node[replica] for replica, count in counted.items() if count > 0}

    wait_for(lambda: len(served_on_both_nodes()) == 2, 90, "adapter requests on both nodes")
    assert len(texts) == 1 and base_text not in texts, (base_text, texts)


def test_strict_pack_puts_both_ranks_on_one_node(cluster, app):
    (replica,) = running_replicas(cluster, "tp", "model-tp")
    groups = [
        group
        for group in cluster.state("placement_groups")
        if group["state"] == "CREATED" and "model-tp" in group["name"]
    ]
    (group,) = groups
    assert [bundle["unit_resources"] for bundle in group["bundles"]] == [
        {"CPU": 0.1},
        {"CPU": 0.4},
    ]
    assert {bundle["node_id"] for bundle in group["bundles"]} == {replica["node_id"]}
    assert text_of(f"{app}/tp", "tp")


def test_a_tensor_parallel_replica_no_node_can_hold_fails_its_deploy(cluster, app):
    message = cluster.serve()["tp-too-big"]["message"]
    assert "no node of this Ray cluster can hold a replica" in message
    assert "need 1.2 CPU together on one node (placement_group_strategy STRICT_PACK)" in message
    assert "the largest of the 2 node(s) offering them has 1 CPU" in message


def test_losing_the_second_node_leaves_the_app_serving_from_the_head(cluster, app):
    """Requests routed to the lost node in the seconds before Serve notices fail: a 503
    from the ingress for a model replica there, a 500 from the proxy when the ingress
    itself ran there (Serve restarts it on the head); then the head serves everything."""
    head, second = node_ids(cluster)
    os.kill(cluster.nodes[1].raylet_pid(), signal.SIGKILL)
    killed = time.monotonic()
    answers: list[tuple[float, str, int]] = []

    def settled():
        for model in ("tiny", f"tiny:{ADAPTER}"):
            answers.append((round(time.monotonic() - killed, 1), model, completion(app, model)[0]))
        alive = {node["node_id"] for node in cluster.alive_nodes()}
        placed = [
            {replica["node_id"] for replica in running_replicas(cluster, "loraplex", deployment)}
            for deployment in ("model-tiny", "OpenAIIngress")
        ]
        streak = [status for _, _, status in answers[-8:]]
        return second not in alive and placed == [{head}, {head}] and streak == [200] * 8

    try:
        wait_for(settled, 90, "the head alone serving base and adapter requests")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; answers since the kill: {answers}") from None
    assert {status for _, _, status in answers} <= {200, 500, 503}, answers
