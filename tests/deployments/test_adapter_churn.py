"""Adapter churn on the session's real Serve app: every register and every unload mints a
new multiplexed model id, and nothing kept per id may outlive it. Each cycle registers
a tenant adapter, serves one request on it (so the replica loads that id, counts its
requests and publishes it), unloads it (a new id) and deletes it. Afterwards the model
replica's routing stats, the residency registry's view and the resident memory of the
model replica, the ingress and the registry are compared with where they stood after a
warm-up.

`LORAPLEX_ADAPTER_CYCLES` sets the number of cycles (default 100: what CI runs); the
docs/operations.md's figure comes from a 10,000-cycle run.
"""

from __future__ import annotations

import json
import logging
import os
import time

import psutil
import pytest
import ray
from test_lora_serving import admin, install

logger = logging.getLogger(__name__)

CYCLES = int(os.environ.get("LORAPLEX_ADAPTER_CYCLES", "100"))
WARMUP = 20
pytestmark = pytest.mark.timeout(300 + CYCLES)
"""About 0.15 s a cycle on a 2-vCPU VM: 10,000 cycles take some 25 minutes."""
MEMORY_GROWTH = (1.15, 64.0)
"""At most this factor of the warmed-up resident memory plus this many MiB (as the load
suite): a per-id leak of 10 KiB over 10,000 cycles (20,000 ids) would be 200 MiB."""
SIZE_SLACK = 256
"""Bytes the serialized routing stats and residency view may differ by (ids are not all
the same length): one id left behind per cycle would add kilobytes."""


def _process_mib(title: str) -> float:
    """Resident memory of this session cluster's one live actor of class `title`, read
    from its GCS actor table (other clusters on the machine, such as a parallel
    worker's, run replicas of the same name)."""
    pids = [
        actor["Pid"]
        for actor in ray.state.actors().values()
        if actor["ActorClassName"] == title and actor["State"] == "ALIVE"
    ]
    assert len(pids) == 1, (title, pids)
    return psutil.Process(pids[0]).memory_info().rss / 2**20


def _state(url: str, operator_key: str, model_handles) -> dict[str, float]:
    stats = model_handles("tiny").record_routing_stats.remote().result()
    status, residency = admin(url, operator_key, "GET", "/v1/admin/residency?model=tiny")
    assert status == 200, residency
    return {
        "routing_stats_bytes": len(json.dumps(stats, sort_keys=True)),
        "residency_bytes": len(json.dumps(residency["data"], sort_keys=True)),
        "model-tiny MiB": _process_mib("ServeReplica:loraplex:model-tiny"),
        "ingress MiB": _process_mib("ServeReplica:loraplex:OpenAIIngress"),
        "registry MiB": _process_mib("ServeReplica:loraplex:residency-registry"),
    }


def _cycle(url: str, key: str, i: int) -> None:
    status, card = admin(
        url, key, "POST", "/v1/adapters", {"model": "tiny", "name": "churn", "path": "churn"}
    )
    assert status == 201, (i, card)
    status, body = admin(
        url,
        key,
        "POST",
        "/v1/completions",
        {"model": "tiny:churn", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0},
    )
    assert status == 200, (i, body)
    status, body = admin(url, key, "POST", "/v1/adapters/tiny/churn/unload")
    assert status == 200, (i, body)
    status, body = admin(url, key, "DELETE", "/v1/adapters/tiny/churn")
    assert status == 200, (i, body)


@pytest.fixture(scope="module")
def churn(serve_setup, tenant_keys, operator_key, peft_adapter_factory, model_handles):
    url, key = serve_setup.url, tenant_keys["acme"]
    install(serve_setup, peft_adapter_factory, "acme", "churn", rank=4, seed=5)
    for i in range(WARMUP):
        _cycle(url, key, i)
    time.sleep(2.0)  # the replica's routing stats and residency publish catch up
    before = _state(url, operator_key, model_handles)
    started = time.monotonic()
    for i in range(CYCLES):
        _cycle(url, key, WARMUP + i)
        if (i + 1) % 1000 == 0:
            logger.warning("adapter churn: %d cycles, %.0f s", i + 1, time.monotonic() - started)
    time.sleep(2.0)
    after = _state(url, operator_key, model_handles)
    logger.warning(
        "adapter churn: %d cycles in %.0f s; before %s; after %s",
        CYCLES,
        time.monotonic() - started,
        before,
        after,
    )
    return before, after


def test_routing_stats_and_the_registry_view_stay_the_same_size(churn):
    before, after = churn
    for name in ("routing_stats_bytes", "residency_bytes"):
        assert after[name] <= before[name] + SIZE_SLACK, (name, before, after)


def test_resident_memory_stays_flat(churn):
    before, after = churn
    factor, slack_mib = MEMORY_GROWTH
    for name, mib in before.items():
        if name.endswith("MiB"):
            assert after[name] <= mib * factor + slack_mib, (name, before, after)
