"""A model replica's per-adapter state (deployments/model_server.py) stays bounded while
adapters come and go: every register or unload mints a new multiplexed model id, and the
engine's adapter store, the replica's one host LRU, evicts adapters past its capacity.
No Serve and no engine here: the server's adapter calls run against a real AdapterStore
(its loader makes a stand-in adapter per model id) behind the engine's adapter methods."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraplex.adapters.store import AdapterStore
from loraplex.deployments.catalog import AdapterEntry
from loraplex.deployments.model_server import AdapterRequests, LocalPlace, ModelServer

CAPACITY = 4
WINDOW_S = 60.0


def stand_in_adapter(folder, arch, max_rank, name, root=None) -> SimpleNamespace:
    """What the store's loader returns: an adapter named by its folder's version."""
    return SimpleNamespace(name=name, key=str(folder).encode(), key_hex="00", rank=1, modules={})


class StoreEngine:
    """The AsyncEngine adapter methods a ModelServer calls, on a real AdapterStore."""

    def __init__(self) -> None:
        self.store = AdapterStore(None, 8, CAPACITY, loader=stand_in_adapter, max_workers=1)
        self.loads = 0

    async def load_adapter(self, adapter, name, root, version, model_id):
        self.loads += 1
        future = self.store.load_async(adapter, name, root, version, model_id)
        return await asyncio.wrap_future(future)

    def held_adapter(self, model_id):
        return self.store.held(model_id)

    def held_adapter_ids(self):
        return self.store.held_ids()

    def on_adapter_evicted(self, listener):
        self.store.on_evict(listener)

    def shutdown(self) -> None:
        self.store.shutdown()


class Catalog:
    """Every `t/a@N` id names version N of one tenant adapter; `missing` ids name none."""

    def by_model_id(self, base: str, model_id: str) -> AdapterEntry | None:
        if "missing" in model_id:
            return None
        version = int(model_id.rpartition("@")[2])
        return AdapterEntry("t", base, "a", Path(f"/a{version}"), version, Path("/"))


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
    server.config = SimpleNamespace(name="m")
    server.catalog = Catalog()
    server.metrics = SimpleNamespace(
        tags={},
        adapter_loads=SimpleNamespace(inc=lambda value, tags: None),
        adapter_load=SimpleNamespace(observe=lambda value, tags: None),
    )
    server.engine = StoreEngine()
    server._requests = AdapterRequests(WINDOW_S)
    server.engine.on_adapter_evicted(server._requests.evicted)
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
    """2,000 adapters, each registered, requested and evicted in turn, plus the base
    model: the counts the replica reports are those of the base model and its host tier."""
    call(server, *(m for version in range(2_000) for m in ("", f"t/a@{version}")))
    counts = server._requests.counts()
    assert set(counts) == {""} | set(server.engine.held_adapter_ids())
    assert len(counts) == CAPACITY + 1
    assert counts[""] == 2_000 and counts["t/a@1999"] == 1


def test_a_held_adapter_is_served_without_the_catalog_or_a_load(server):
    call(server, "t/a@1", "t/a@1", "t/a@2", "t/a@1")
    assert server.engine.loads == 2
    assert server._requests.counts() == {"t/a@1": 3, "t/a@2": 1}
    assert sorted(server.engine.held_adapter_ids()) == ["t/a@1", "t/a@2"]


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
