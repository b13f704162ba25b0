"""A model replica's per-adapter state (deployments/model_server.py) stays bounded while
adapters come and go: every register or unload mints a new multiplexed model id, and
Serve's multiplexed cache evicts adapters past its capacity. No Serve here: the cache is
an LRU that calls `ResidentAdapter.__del__` on eviction, as `serve.multiplexed` does."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraplex.deployments.catalog import AdapterEntry
from loraplex.deployments.model_server import (
    AdapterRequests,
    LocalPlace,
    ModelServer,
    ResidentAdapter,
)

CAPACITY = 4
WINDOW_S = 60.0


class Cache:
    """serve.multiplexed's LRU of ResidentAdapters; ids without a catalog entry fail."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server
        self.held: OrderedDict[str, ResidentAdapter] = OrderedDict()
        self.engine = SimpleNamespace(evict_adapter=lambda folder, version: None)

    async def __call__(self, model_id: str) -> ResidentAdapter:
        if model_id not in self.held:
            if "missing" in model_id:
                raise LookupError(f"adapter {model_id!r} is not in the catalog")
            version = int(model_id.rpartition("@")[2])
            entry = AdapterEntry("t", "m", "a", Path("/a"), version, Path("/"))
            adapter = SimpleNamespace(key=model_id.encode())
            server = self.server
            self.held[model_id] = ResidentAdapter(
                entry, adapter, self.engine, server._resident_keys, server._requests
            )
            if len(self.held) > CAPACITY:
                self.held.popitem(last=False)[1].__del__()
        self.held.move_to_end(model_id)
        return self.held[model_id]


class CallPlace(LocalPlace):
    """A local replica whose current call names `current[0]` as its model id."""

    def __init__(self, current: list[str]) -> None:
        self.current = current

    def multiplexed_model_id(self) -> str:
        return self.current[0]


@pytest.fixture
def server():
    """A ModelServer with only its adapter state (building one needs Serve)."""
    current = [""]
    server = ModelServer.__new__(ModelServer)
    server.place = CallPlace(current)
    server._resident_keys = {}
    server._requests = AdapterRequests(WINDOW_S)
    server._resident = Cache(server)
    server.current = current
    return server


def call(server: ModelServer, *model_ids: str) -> None:
    """One request for each model id in turn (their loads fail as their calls would)."""

    async def requests() -> None:
        for model_id in model_ids:
            server.current[0] = model_id
            try:
                await server._adapter_for_call()
            except LookupError:
                pass

    asyncio.run(requests())


def test_request_counts_are_kept_for_the_adapters_the_replica_holds(server):
    """10,000 adapters, each registered, requested and evicted in turn, plus the base
    model: the counts the replica reports are those of the base model and its cache."""
    call(server, *(m for version in range(10_000) for m in ("", f"t/a@{version}")))
    counts = server._requests.counts()
    assert set(counts) == {""} | set(server._resident_keys)
    assert len(counts) == CAPACITY + 1
    assert counts[""] == 10_000 and counts["t/a@9999"] == 1


def test_an_adapter_loaded_again_counts_anew(server):
    call(server, "t/a@1", "t/a@1", *(f"t/a@{v}" for v in range(2, 2 + CAPACITY)), "t/a@1")
    assert server._requests.counts()["t/a@1"] == 1


def test_a_failed_load_leaves_no_entry(server):
    call(server, *(f"t/missing@{version}" for version in range(10_000)))
    assert server._requests.counts() == {}
    assert server._requests.in_demand(0.0) == []


def test_request_times_last_the_demand_window_even_after_eviction():
    """An evicted adapter requested within the window is demand (the autoscaler scales
    on adapters in demand over host capacity); older requests are forgotten even when
    nobody asks for the demand."""
    requests = AdapterRequests(WINDOW_S)
    for second in range(10_000):
        requests.record(f"t/a@{second}", float(second))
        requests.evicted(f"t/a@{second}")
        assert len(requests._last_request) <= 2 * WINDOW_S + 1
    assert requests.counts() == {}
    in_demand = requests.in_demand(9_999.0)
    assert len(in_demand) == WINDOW_S + 1 and "t/a@9999" in in_demand
