"""Autoscaling a model deployment 1 -> 2 -> 1 replicas under load, and multiplexed
routing of an adapter's calls to the replica that holds it; 1 -> 2 -> 1 under one
client's requests spread over more adapters than a replica holds (the adapter
working-set policy, deployments/autoscaling.py, also unit-tested here); a model with
`min_replicas: 0` scaling to zero when idle and back on its first request (the cold
start is logged). Each served case is a further Serve app on the session's Ray cluster."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import openai
import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from loraplex.deployments.autoscaling import (
    ADAPTER_POLICY,
    ADAPTERS_IN_DEMAND,
    HOST_ADAPTER_CAPACITY,
    adapter_working_set_policy,
    replicas_for_adapters,
    with_adapter_policy,
)

APP = "scaling"


def test_the_adapters_in_demand_need_their_sum_over_one_replicas_capacity():
    assert replicas_for_adapters({"a": 5, "b": 4}, {"a": 4, "b": 4}) == 3
    assert replicas_for_adapters({"a": 4, "b": 4}, {"a": 4, "b": 4}) == 2
    assert replicas_for_adapters({"a": 0}, {"a": 4}) == 0
    assert replicas_for_adapters({"a": 3}, {}) == 0, "no capacity reported yet"


def test_autoscaled_models_get_the_adapter_policy_unless_they_name_one():
    config = {"min_replicas": 1, "max_replicas": 4}
    assert with_adapter_policy(config)["policy"] == {"policy_function": ADAPTER_POLICY}
    own = {**config, "policy": {"policy_function": "mine:policy"}}
    assert with_adapter_policy(own) == own
    assert AutoscalingConfig(**with_adapter_policy(config)).policy.get_policy() is not None


def policy_context(ongoing: float, in_demand: list[float], max_replicas: int = 4, state=None):
    deployment = DeploymentID(name="model-m", app_name="app")
    replicas = [ReplicaID(f"r{i}", deployment) for i in range(len(in_demand))]
    config = AutoscalingConfig(min_replicas=1, max_replicas=max_replicas)
    return AutoscalingContext(
        deployment_id=deployment,
        deployment_name="model-m",
        app_name="app",
        current_num_replicas=len(replicas),
        target_num_replicas=len(replicas),
        running_replicas=replicas,
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics={
            ADAPTERS_IN_DEMAND: dict(zip(replicas, in_demand, strict=True)),
            HOST_ADAPTER_CAPACITY: dict.fromkeys(replicas, 4.0),
        },
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


def test_the_policy_takes_the_larger_of_the_queue_and_the_adapters_within_bounds(caplog):
    target = AutoscalingConfig(min_replicas=1, max_replicas=4).get_target_ongoing_requests()
    with caplog.at_level(logging.INFO, logger="ray.serve.loraplex.autoscaling"):
        quiet, _ = adapter_working_set_policy(policy_context(1, [4]))
        assert quiet == 1 and not caplog.text, "the adapters fit: the queue and the bounds"
        busy, _ = adapter_working_set_policy(policy_context(3 * target, [4]))
        assert busy == pytest.approx(3) and not caplog.text
        spread, state = adapter_working_set_policy(policy_context(1, [7, 5]))
    assert spread == 3 and "12.0 adapters in demand over 2 replicas need 3" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ray.serve.loraplex.autoscaling"):
        again, _ = adapter_working_set_policy(policy_context(1, [7, 5], state=state))
    assert again == 3 and not caplog.text, "one log line per decision"
    busy, _ = adapter_working_set_policy(policy_context(3 * target, [3, 3]))
    assert busy == pytest.approx(3), "the queue decides when it asks for more"
    capped, _ = adapter_working_set_policy(policy_context(1, [30], max_replicas=2))
    assert capped == 2


def replica_states(serve, app: str, deployment: str) -> dict[str, int]:
    return dict(serve.status().applications[app].deployments[deployment].replica_states)


def running_replicas(serve) -> int:
    return replica_states(serve, APP, "model-scaly").get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str, step=lambda: time.sleep(0.5)) -> float:
    """Seconds until `predicate()` held, calling `step()` between checks; fails after
    `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        step()
    return time.monotonic() - started


def replica_state_log(serve, app: str, deployment: str):
    """A `wait_for` step's companion: records each change of the deployment's replica
    states with its time, so a timed-out wait says what the controller did meanwhile."""
    changes: list[tuple[float, dict[str, int]]] = []
    started = time.monotonic()

    def states() -> dict[str, int]:
        now = replica_states(serve, app, deployment)
        if not changes or changes[-1][1] != now:
            changes.append((round(time.monotonic() - started, 1), now))
        return now

    return states, changes


# The controller's decision is the policy under test and comes within seconds; the new
# replica's start (a Ray worker, torch, the model) took 40-80 s on a loaded 2-core CI VM.
DECISION_S = 90
REPLICA_START_S = 240


def wait_for_second_replica(serve, app: str, deployment: str, step) -> None:
    """Waits for the controller to add a replica, then for it to run, calling `step()`
    (which keeps the load up) between checks; logs both times."""

    states, changes = replica_state_log(serve, app, deployment)

    def started() -> bool:
        now = states()
        return now.get("STARTING", 0) + now.get("RUNNING", 0) >= 2

    try:
        decided_s = wait_for(started, DECISION_S, f"{app}: a second replica decided", step)
        running_s = wait_for(
            lambda: states().get("RUNNING", 0) >= 2,
            REPLICA_START_S,
            f"{app}: the second replica running",
            step,
        )
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}; replica states by second: {changes}") from None
    logging.getLogger(__name__).warning(
        "%s: second replica decided after %.1f s, running %.1f s later", app, decided_s, running_s
    )


@pytest.fixture(scope="module")
def scaling_app(serve_setup, tmp_path_factory):
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "auth": "none",
        "adapter_root": str(tmp_path_factory.mktemp("scaling-root")),
        "models": [
            {
                "name": "scaly",
                "model": str(serve_setup.base),
                "engine": {
                    "max_model_len": 256,
                    "max_num_seqs": 8,
                    "max_lora_rank": 8,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "adapters": {"sa": str(serve_setup.shared["sa"])},
                "server": {
                    "num_cpus": 0.1,
                    # Above the load's concurrency: a busy holder would make Serve fall
                    # back to another replica, which is its policy, not a routing miss.
                    "max_ongoing_requests": 16,
                    "autoscaling_config": {
                        "min_replicas": 1,
                        "max_replicas": 2,
                        "target_ongoing_requests": 1,
                        "upscale_delay_s": 0,
                        "downscale_delay_s": 2,
                        "metrics_interval_s": 0.5,
                        "look_back_period_s": 1,
                    },
                },
            }
        ],
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield serve
    serve.delete(APP)


def test_scales_up_under_load_routes_adapters_to_their_replica_and_scales_down(
    scaling_app, serve_url
):
    serve = scaling_app
    client = openai.OpenAI(base_url=f"{serve_url}/{APP}/v1", api_key="none", max_retries=0)
    assert running_replicas(serve) == 1
    stop = threading.Event()
    errors: list[BaseException] = []

    def load():
        while not stop.is_set():
            try:
                client.completions.create(
                    model="scaly",
                    prompt=[1, 2, 3],
                    max_tokens=200,
                    extra_body={"ignore_eos": True},
                )
            except BaseException as exc:
                errors.append(exc)
                return

    workers = [threading.Thread(target=load) for _ in range(6)]
    for worker in workers:
        worker.start()
    try:
        wait_for_second_replica(serve, APP, "model-scaly", lambda: time.sleep(0.5))

        # The adapter loads on one replica; calls carrying its multiplexed id go there.
        client.completions.create(model="scaly:sa", prompt=[4, 5], max_tokens=2)
        handle = serve.get_deployment_handle("model-scaly", app_name=APP)
        model_id = "shared/sa@0"
        # The replica reports its resident ids to the controller, and this process's
        # new router polls the replicas' routing stats: one call, then their periods.
        handle.options(multiplexed_model_id=model_id).replica_info.remote().result()
        time.sleep(2)
        infos = [
            handle.options(multiplexed_model_id=model_id).replica_info.remote().result()
            for _ in range(8)
        ]
        holders = {i["replica"] for i in infos if model_id in i["resident_model_ids"]}
        assert holders and {i["replica"] for i in infos} == holders, infos
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert not errors, errors[:1]
    wait_for(lambda: running_replicas(serve) == 1, 90, "scaling back down to one replica")


@pytest.fixture(scope="module")
def zero_app(serve_setup, tmp_path_factory):
    """A model that scales to zero replicas when idle (`min_replicas: 0`)."""
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "auth": "none",
        "adapter_root": str(tmp_path_factory.mktemp("zero-root")),
        # A request that arrives at zero replicas waits for a cold start.
        "ingress": {"first_token_timeout_s": 180},
        "models": [
            {
                "name": "sleepy",
                "model": str(serve_setup.base),
                "engine": {
                    "dtype": "float32",
                    "max_model_len": 128,
                    "max_lora_rank": 8,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "server": {
                    "num_cpus": 0.1,
                    "autoscaling_config": {
                        "min_replicas": 0,
                        "initial_replicas": 1,
                        "max_replicas": 1,
                        "target_ongoing_requests": 1,
                        "upscale_delay_s": 0,
                        "downscale_delay_s": 2,
                        "downscale_to_zero_delay_s": 2,
                        "metrics_interval_s": 0.5,
                        "look_back_period_s": 1,
                    },
                },
            }
        ],
    }
    serve.run(build_app(config), name=ZERO_APP, route_prefix=f"/{ZERO_APP}")
    yield serve
    serve.delete(ZERO_APP)


ZERO_APP = "zero"


def test_a_model_scales_to_zero_and_the_first_request_brings_it_back(zero_app, serve_url):
    serve = zero_app

    def replicas() -> int:
        status = serve.status().applications[ZERO_APP].deployments["model-sleepy"]
        return status.replica_states.get("RUNNING", 0)

    client = openai.OpenAI(base_url=f"{serve_url}/{ZERO_APP}/v1", api_key="none", max_retries=0)
    wait_for(lambda: replicas() == 0, 90, "scaling to zero replicas")
    started = time.monotonic()
    reply = client.completions.create(
        model="sleepy", prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True}, timeout=240
    )
    cold_start_s = time.monotonic() - started
    assert reply.usage.completion_tokens == 4
    assert replicas() == 1
    logging.getLogger(__name__).warning("first request at zero replicas: %.1f s", cold_start_s)
    wait_for(lambda: replicas() == 0, 90, "scaling back to zero")


SPREAD_APP = "spread"


@pytest.fixture(scope="module")
def spread_app(serve_setup, tmp_path_factory):
    """A model whose replicas hold one adapter each in host memory, autoscaled 1..2 with a
    queue target no single client reaches; its three shared adapters."""
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "auth": "none",
        "adapter_root": str(tmp_path_factory.mktemp("spread-root")),
        "models": [
            {
                "name": "spready",
                "model": str(serve_setup.base),
                "engine": {
                    "max_model_len": 128,
                    "max_lora_rank": 8,
                    "max_loras": 1,
                    "max_cpu_loras": 1,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "adapters": {name: str(folder) for name, folder in serve_setup.shared.items()},
                "server": {
                    "num_cpus": 0.1,
                    # Longer than a few one-at-a-time calls take on a loaded CI VM (each
                    # swaps its adapter in): with 4 s, slow calls left one adapter in the
                    # window, the policy asked for one replica again and Serve stopped the
                    # second while it started (CI, stop 44).
                    "adapter_demand_window_s": 20,
                    "autoscaling_config": {
                        "min_replicas": 1,
                        "max_replicas": 2,
                        "target_ongoing_requests": 8,
                        "upscale_delay_s": 0,
                        "downscale_delay_s": 2,
                        "metrics_interval_s": 0.5,
                        "look_back_period_s": 1,
                    },
                },
            }
        ],
    }
    serve.run(build_app(config), name=SPREAD_APP, route_prefix=f"/{SPREAD_APP}")
    yield serve, sorted(serve_setup.shared)
    serve.delete(SPREAD_APP)


def test_adapter_spread_load_adds_a_replica_and_its_end_removes_it(spread_app, serve_url):
    serve, adapters = spread_app

    def replicas() -> int:
        return replica_states(serve, SPREAD_APP, "model-spready").get("RUNNING", 0)

    client = openai.OpenAI(base_url=f"{serve_url}/{SPREAD_APP}/v1", api_key="none", max_retries=0)
    assert replicas() == 1
    names = itertools.cycle(adapters)

    def one_call_per_adapter_in_turn() -> None:
        reply = client.completions.create(
            model=f"spready:{next(names)}", prompt=[1, 2], max_tokens=2, timeout=60
        )
        assert reply.usage.completion_tokens == 2

    wait_for_second_replica(serve, SPREAD_APP, "model-spready", one_call_per_adapter_in_turn)
    wait_for(lambda: replicas() == 1, 90, "scaling back to one replica after the load")
