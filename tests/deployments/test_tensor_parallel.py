"""A tensor_parallel_size=2 model deployment (a third Serve app on the session's Ray
cluster): one placement-group bundle per rank, served through the openai SDK with the
greedy outputs of one rank; killing its worker mid-stream gives the client an error
(not a hang) and Serve replaces the replica."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

APP = "tp"
MODEL = "tpmodel"


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception:  # the replica may be restarting
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tp_app(serve_setup, tmp_path_factory):
    from ray import serve

    from loraplex.deployments.app import build_app

    config = {
        "auth": "none",
        "adapter_root": str(tmp_path_factory.mktemp("tp-root")),
        "models": [
            {
                "name": MODEL,
                "model": str(serve_setup.base),
                "engine": {
                    "max_model_len": 512,
                    "max_lora_rank": 8,
                    "tensor_parallel_size": 2,
                    "distributed_timeout_s": 20,
                    "kv_cache_memory_bytes": 1 << 26,
                },
                "adapters": {"sa": str(serve_setup.shared["sa"])},
                "server": {"num_cpus": 0.1, "health_check_period_s": 1},
            }
        ],
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield serve
    serve.delete(APP)


def replica_info(serve) -> dict:
    handle = serve.get_deployment_handle(f"model-{MODEL}", app_name=APP)
    return handle.replica_info.remote().result(timeout_s=10)


def test_tp2_deployment_serves_base_and_adapter_like_one_rank(tp_app, serve_setup, serve_url):
    client = openai.OpenAI(base_url=f"{serve_url}/{APP}/v1", api_key="none", max_retries=0)
    prompt = [5, 6, 7, 8, 9, 10]
    served = {
        model: client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for model in (MODEL, f"{MODEL}:sa")
    }
    llm = LLM(str(serve_setup.base), max_model_len=512, max_lora_rank=8)
    llm.register_adapter("sa", str(serve_setup.shared["sa"]))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [o.text for o in llm.generate([prompt, prompt], params, [None, "sa"])]
    assert [served[MODEL], served[f"{MODEL}:sa"]] == expected
    assert expected[0] != expected[1]
    shards = replica_info(tp_app)["shards"]
    assert [s["rank"] for s in shards] == [0, 1] and shards[0]["pid"] != shards[1]["pid"]


def test_killed_worker_errors_the_stream_and_the_replica_is_replaced(tp_app, serve_url):
    client = openai.OpenAI(base_url=f"{serve_url}/{APP}/v1", api_key="none", max_retries=0)
    before = replica_info(tp_app)
    worker_pid = before["shards"][1]["pid"]
    stream = client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3],
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="failed while serving|replica is unavailable"):
        for index, _ in enumerate(stream):
            if index == 2:
                os.kill(worker_pid, signal.SIGKILL)
    assert time.monotonic() - started < 30

    def recovered():
        info = replica_info(tp_app)
        if info["replica"] == before["replica"]:
            return None
        reply = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3)
        return info if reply.choices[0].text else None

    after = wait_for(recovered, 120, "a replacement replica")
    assert after["shards"][1]["pid"] != worker_pid
