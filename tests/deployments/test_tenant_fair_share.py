"""Tenant fair share through a real ModelServer (deployments/model_server.py): the
tenant and weight a GenerateCall carries reach the engine, whose served default policy
is `fair` (platform/fair_share.py). A batch of one place, steps slowed by a failpoint:
a light tenant's request, sent after a heavy tenant's backlog of six, runs as soon as
the place frees, where FCFS (`engine.policy: fcfs`) leaves it for last."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.deployments.config import ModelDeploymentConfig
from loraplex.deployments.model_server import LocalPlace, ModelServer
from loraplex.deployments.wire import GenerateCall, GenerateError
from loraplex.platform.failpoints import FAILPOINTS
from loraplex.platform.request import SamplingParams


def finish_order(model_folder: str, adapter_root: str, policy: str | None) -> list[str]:
    engine = {
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_seqs": 1,
        "max_loras": 0,
        "kv_cache_memory_bytes": 1 << 22,
    }
    if policy is not None:
        engine["policy"] = policy
    config = ModelDeploymentConfig(
        name="shared", model=model_folder, engine=engine, fault_injection=True
    )
    server = ModelServer(config, adapter_root, place=LocalPlace())
    server.arm_failpoint("engine.delay", delay_s=0.02)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    finished: list[str] = []

    async def run(request_id: str, tenant: str) -> None:
        call = GenerateCall(request_id, params, prompt=[1, 2, 3], tenant=tenant)
        items = [item async for item in server.generate(call)]
        assert not any(isinstance(item, GenerateError) for item in items), items
        finished.append(request_id)

    async def scenario() -> None:
        heavy = [asyncio.create_task(run(f"heavy{i}", "heavy")) for i in range(6)]
        await asyncio.sleep(0.05)
        light = asyncio.create_task(run("light", "light"))
        await asyncio.gather(*heavy, light)

    try:
        asyncio.run(scenario())
    finally:
        FAILPOINTS.disarm()
        server.engine.shutdown()
    return finished


@pytest.mark.parametrize("policy", [None, "fcfs"])
def test_a_light_tenant_runs_before_a_heavy_backlog(tiny_model_factory, tmp_path, policy):
    order = finish_order(str(tiny_model_factory("llama")), str(tmp_path / "adapters"), policy)
    assert sorted(order) == sorted([*(f"heavy{i}" for i in range(6)), "light"])
    if policy is None:
        assert order.index("light") <= 2, f"the served default is fair share: {order}"
    else:
        assert order[-1] == "light", f"FCFS keeps arrival order: {order}"
