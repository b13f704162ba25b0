"""Disk registry and host LRU of the adapter store; loading off the engine loop."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import pytest

from loraplex.adapters.peft_format import AdapterError, load_peft_adapter
from loraplex.adapters.store import AdapterStore
from loraplex.platform import LLM, AsyncEngine, SamplingParams
from loraplex.platform.arch import ModelArch


@pytest.fixture(scope="module")
def base(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory, peft_adapter_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("store-root")
    return {
        name: peft_adapter_factory(base, root / name, seed=seed)
        for seed, name in enumerate(["alpha", "beta", "gamma"])
    }


def make_store(base: Path, **options) -> AdapterStore:
    return AdapterStore(ModelArch.from_folder(base), max_rank=16, **{"max_cpu_loras": 2, **options})


def test_adapter_root_registers_its_subfolders_by_name(base, folders):
    store = make_store(base, root=folders["alpha"].parent)
    assert store.names() == ["alpha", "beta", "gamma"]
    assert store.load("beta").name == "beta"


def test_register_unregister_and_bad_names(base, folders, tmp_path):
    store = make_store(base)
    store.register("mine", folders["alpha"])
    assert store.names() == ["mine"]
    assert store.load("mine").key == load_peft_adapter(folders["alpha"], store.arch, 16).key
    store.unregister("mine")
    assert store.names() == []
    with pytest.raises(AdapterError, match="not registered"):
        store.unregister("mine")
    with pytest.raises(AdapterError, match="adapter name"):
        store.register("../escape", folders["alpha"])
    with pytest.raises(AdapterError, match="must be 1-64 letters"):
        store.register("a" * 65, folders["alpha"])
    with pytest.raises(AdapterError, match="does not exist"):
        store.register("ghost", tmp_path / "nowhere")
    with pytest.raises(AdapterError, match="unknown adapter 'ghost'"):
        store.load("ghost")


def test_host_cache_is_lru_with_counts(base, folders):
    store = make_store(base, max_cpu_loras=2)
    for name, folder in folders.items():
        store.register(name, folder)
    first = store.load("alpha")
    store.load("beta")
    assert store.load("alpha") is first
    store.load("gamma")  # evicts beta, the least recently used
    assert (store.stats.loads, store.stats.hits, store.stats.evictions) == (3, 1, 1)
    assert store.num_cached == 2
    assert store.load("alpha") is first
    store.load("beta")
    assert store.stats.loads == 4
    assert set(store.stats.load_seconds) == {(folders["alpha"], None), (folders["beta"], None)}


def test_host_bytes_bound_counts_saved_modules(base, folders, tmp_path, peft_adapter_factory):
    """With `max_cpu_bytes`, a copy's cost is its tensors: an adapter that saves its own
    LM head costs as much as several plain ones, and evicts them."""
    heavy = peft_adapter_factory(base, tmp_path / "heavy", modules_to_save=("lm_head",))
    plain = load_peft_adapter(folders["alpha"], ModelArch.from_folder(base), 16).num_bytes
    store = make_store(base, max_cpu_loras=8, max_cpu_bytes=3 * plain)
    for name, folder in {**folders, "heavy": heavy}.items():
        store.register(name, folder)
    for name in ("alpha", "beta", "gamma"):
        store.load(name)
    assert store.num_cached == 3 and store.held_bytes == 3 * plain
    adapter = store.load("heavy")
    assert adapter.num_bytes > 3 * plain
    assert store.num_cached == 1 and store.held_bytes == adapter.num_bytes
    assert store.stats.evictions == 3
    store.load("alpha")
    assert store.num_cached == 1 and store.held_bytes == plain


def test_files_rewritten_in_place_are_reloaded_with_a_new_identity(
    base, folders, tmp_path, peft_adapter_factory
):
    store = make_store(base)
    folder = tmp_path / "live"
    shutil.copytree(folders["alpha"], folder)
    store.register("live", folder)
    old = store.load("live")
    shutil.rmtree(folder)
    peft_adapter_factory(base, folder, seed=42)
    new = store.load("live")
    assert new is not old and new.key != old.key


def test_concurrent_loads_of_one_folder_read_it_once(base, folders):
    gate = threading.Event()
    calls = []

    def gated_loader(folder, arch, max_rank, name):
        calls.append(folder)
        gate.wait(10)
        return load_peft_adapter(folder, arch, max_rank, name)

    store = make_store(base, loader=gated_loader)
    store.register("alpha", folders["alpha"])
    futures = [store.load_async("alpha") for _ in range(3)]
    gate.set()
    assert len({id(f.result()) for f in futures}) == 1
    assert len(calls) == 1


def test_a_failing_load_is_reported_and_not_cached(base, folders, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folders["alpha"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    store = make_store(base)
    store.register("broken", broken)
    with pytest.raises(AdapterError, match="corrupt"):
        store.load("broken")
    assert store.stats.failures == 1 and store.num_cached == 0


def test_async_engine_serves_others_while_an_adapter_loads(base, folders):
    """A request whose adapter is still loading waits outside the engine; a base-model
    request submitted after it finishes first."""
    llm = LLM(str(base), dtype="float32", max_model_len=64)
    gate = threading.Event()
    real_loader = llm.engine.adapters.loader

    def slow_loader(folder, arch, max_rank, name):
        gate.wait(20)
        return real_loader(folder, arch, max_rank, name)

    llm.engine.adapters.loader = slow_loader
    llm.register_adapter("alpha", str(folders["alpha"]))
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    finished: list[str] = []

    async def run(name: str, adapter: str | None) -> list[int]:
        outputs = [o async for o in engine.generate([1, 2, 3], params, adapter=adapter)]
        finished.append(name)
        return outputs[-1].token_ids

    async def scenario():
        lora_task = asyncio.create_task(run("lora", "alpha"))
        await asyncio.sleep(0.05)
        base_tokens = await asyncio.wait_for(run("base", None), timeout=30)
        assert finished == ["base"] and not lora_task.done()
        gate.set()
        lora_tokens = await asyncio.wait_for(lora_task, timeout=30)
        assert lora_tokens != base_tokens
        with pytest.raises(AdapterError, match="unknown adapter"):
            await run("missing", "no-such-adapter")

    try:
        asyncio.run(scenario())
        assert finished == ["base", "lora"]
    finally:
        engine.shutdown()


class StubAdapter:
    """What the store reads of a loaded adapter, without reading files."""

    def __init__(self, name: str) -> None:
        self.name, self.rank, self.modules, self.key_hex = name, 1, {}, "0" * 12


def test_load_times_are_kept_for_the_copies_in_host_memory_only(tmp_path):
    """Every catalog version is a new copy: 10,000 versions loaded, half of them evicted
    at once, keep no more load times than the host cache holds copies."""
    store = AdapterStore(None, 16, 2, loader=lambda folder, *_, **__: StubAdapter(folder.name))
    for version in range(10_000):
        store.load(tmp_path, "a", root=tmp_path, version=version)
        if version % 2:
            store.evict(tmp_path, version)
    assert len(store.stats.load_seconds) <= store.max_cpu_loras
    assert set(store.stats.load_seconds) == {(tmp_path, 9998)}
    store.register("a", tmp_path)
    store.load("a")
    assert set(store.stats.load_seconds) == {(tmp_path, 9998), (tmp_path, None)}
    store.unregister("a")
    assert store.stats.load_seconds == {}, "unregister drops every copy of the folder"
    store.shutdown()


def test_copies_loaded_under_model_ids_are_found_and_their_evictions_told(base, folders):
    """The host LRU is the replica's only one: a copy loaded under a catalog model id is
    found by it without the catalog, and each eviction tells the listeners its ids."""
    store = make_store(base)
    evicted: list[str] = []
    store.on_evict(evicted.append)
    alpha = store.load_async(folders["alpha"], version=1, model_id="t/alpha@1").result()
    beta = store.load_async(folders["beta"], version=1, model_id="t/beta@1").result()
    assert store.held_ids() == {"t/alpha@1": alpha.key, "t/beta@1": beta.key}
    assert store.held("t/alpha@1") is alpha and store.held("t/gamma@1") is None
    store.load_async(folders["gamma"], version=1, model_id="t/gamma@1").result()
    assert evicted == ["t/beta@1"]  # alpha was used last by `held`
    assert set(store.held_ids()) == {"t/alpha@1", "t/gamma@1"}
    store.evict(folders["alpha"], 1)
    assert evicted == ["t/beta@1", "t/alpha@1"] and store.held("t/alpha@1") is None


def test_an_unpinned_copy_whose_files_changed_is_not_held(base, folders, tmp_path):
    folder = tmp_path / "moving"
    shutil.copytree(folders["alpha"], folder)
    store = make_store(base)
    store.load_async(folder, model_id="shared/moving@1").result()
    assert store.held("shared/moving@1") is not None
    shutil.copyfile(
        folders["beta"] / "adapter_model.safetensors", folder / "adapter_model.safetensors"
    )
    assert store.held("shared/moving@1") is None
    assert store.load_async(folder, model_id="shared/moving@1").result().key == (
        store.held("shared/moving@1").key
    )


def test_many_model_ids_leave_the_host_tier_bounded(base, folders):
    """Every register or unload mints a new model id: the labels stay as bounded as the
    copies, and each id is told evicted exactly once."""
    store = make_store(base, max_cpu_loras=2)
    evicted: list[str] = []
    store.on_evict(evicted.append)
    for version in range(300):
        name = ("alpha", "beta", "gamma")[version % 3]
        store.load_async(folders[name], version=version, model_id=f"t/{name}@{version}").result()
    assert len(store.held_ids()) == 2 and store.num_cached == 2
    assert len(evicted) == len(set(evicted)) == 298
