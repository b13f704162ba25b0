"""One real Ray Serve app for the whole test session (starting one costs ~15 s)."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def serve_url(tiny_model_factory):
    import ray
    from ray import serve

    from loraplex.deployments.app import build_app

    folder = tiny_model_factory("llama")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "models": [
                {
                    "name": "tiny",
                    "model": str(folder),
                    "engine": {"max_model_len": 128, "max_num_seqs": 16},
                    "server": {"num_cpus": 0.1},
                }
            ]
        }
    )
    serve.run(app, name="loraplex", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def client(serve_url):
    import openai

    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
