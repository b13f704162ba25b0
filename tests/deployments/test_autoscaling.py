"""Autoscaling a model deployment 1 -> 2 -> 1 replicas under load, and multiplexed
routing of an adapter's calls to the replica that holds it; a model with
`min_replicas: 0` scaling to zero when idle and back on its first request (the cold
start is logged). Each is a further Serve app on the session's Ray cluster."""

from __future__ import annotations

import logging
import threading
import time

import openai
import pytest

APP = "scaling"


def running_replicas(serve) -> int:
    status = serve.status().applications[APP].deployments["model-scaly"]
    return status.replica_states.get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def scaling_app(serve_setup, tmp_path_factory):
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "adapter_root": str(tmp_path_factory.mktemp("scaling-root")),
        "models": [
            {
                "name": "scaly",
                "model": str(serve_setup.base),
                "engine": {"max_model_len": 256, "max_num_seqs": 8, "max_lora_rank": 8},
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
        wait_for(lambda: running_replicas(serve) == 2, 90, "a second replica")

        # The adapter loads on one replica; calls carrying its multiplexed id go there.
        client.completions.create(model="scaly:sa", prompt=[4, 5], max_tokens=2)
        handle = serve.get_deployment_handle("model-scaly", app_name=APP)
        model_id = "shared/sa@0"
        time.sleep(2)  # the replica reports its resident ids to the controller
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
        "adapter_root": str(tmp_path_factory.mktemp("zero-root")),
        # A request that arrives at zero replicas waits for a cold start.
        "ingress": {"first_token_timeout_s": 180},
        "models": [
            {
                "name": "sleepy",
                "model": str(serve_setup.base),
                "engine": {"dtype": "float32", "max_model_len": 128, "max_lora_rank": 8},
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
