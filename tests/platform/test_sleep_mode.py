"""Sleep and wake (platform/sleep_mode.py): an idle engine releases its KV cache (on a
GPU also its weights' device memory), refuses requests while asleep, and after waking
generates exactly what it generated before, with the prefix cache empty."""

from __future__ import annotations

import pytest
import torch

from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 164))]
KV_BYTES = 64 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    adapter = peft_adapter_factory(base, tmp_path_factory.mktemp("sleepy") / "a", seed=31)
    return base, adapter


def test_an_engine_sleeps_gives_its_kv_cache_back_and_wakes_to_the_same_answers(setup):
    base, adapter = setup
    llm = LLM(str(base), dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_BYTES)
    llm.register_adapter("a", str(adapter))
    adapters = [None, "a", "a"]
    before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, adapters=adapters)]
    kv_bytes = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
    awake_rss = resident_bytes()

    slept = llm.sleep()
    assert llm.engine.asleep
    assert slept.kv_cache_bytes == kv_bytes >= KV_BYTES * 0.9
    assert slept.weight_bytes == 0, "on a CPU the weights are host memory already"
    assert all(t.numel() == 0 for t in llm.engine.runner.kv_caches)
    assert awake_rss - resident_bytes() > 0.8 * kv_bytes, "the KV cache's memory went back"
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(ValueError, match="asleep already"):
        llm.sleep()

    woke = llm.wake_up()
    assert not llm.engine.asleep and woke.kv_cache_bytes == kv_bytes
    outputs = llm.generate(PROMPTS, GREEDY, adapters=adapters)
    assert [o.token_ids for o in outputs] == before
    assert outputs[0].num_cached_tokens == 0, "the prefix cache went with the KV cache"
    with pytest.raises(ValueError, match="awake"):
        llm.wake_up()


def test_an_engine_with_requests_running_does_not_sleep(setup):
    base, _ = setup
    llm = LLM(str(base), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    llm.engine.add_request("r", PROMPTS[0], GREEDY)
    llm.engine.step()
    with pytest.raises(ValueError, match="still running"):
        llm.sleep()
    assert not llm.engine.asleep
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.sleep()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_sleep_frees_the_weights_and_the_kv_cache(setup):
    base, adapter = setup
    llm = LLM(str(base), dtype="float32", max_model_len=128, device="cuda")
    llm.register_adapter("a", str(adapter))
    before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, adapters=[None, "a", None])]
    allocated = torch.cuda.memory_allocated()
    slept = llm.sleep()
    assert slept.weight_bytes > 0
    assert allocated - torch.cuda.memory_allocated() >= slept.kv_cache_bytes + slept.weight_bytes
    llm.wake_up()
    after = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, adapters=[None, "a", None])]
    assert after == before


def test_the_async_engine_lets_open_requests_finish_refuses_new_ones_and_wakes(setup):
    """`AsyncEngine.sleep` refuses requests from its call on, sleeps once the open one
    finished, and `wake_up` serves the same answer again; a sleep whose drain times out
    leaves the engine awake and serving."""
    import asyncio

    from loraplex.platform.async_engine import AsyncEngine, EngineAsleepError
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.failpoints import FAILPOINTS

    base, _ = setup
    config = EngineConfig.from_options(
        str(base), {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 4 << 20}
    )
    engine = AsyncEngine.build(config)
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    async def last(prompt, params):
        outputs = [output async for output in engine.generate(prompt, params)]
        return outputs[-1].token_ids

    async def scenario():
        expected = await last(PROMPTS[1], GREEDY)
        FAILPOINTS.arm("engine.delay", delay_s=0.02)  # 120 steps: 2.4 s at least
        running = asyncio.create_task(last(PROMPTS[0], long))
        await asyncio.sleep(0.2)
        with pytest.raises(ValueError, match="still running"):
            await engine.sleep(drain_timeout_s=0.05)
        assert not engine.asleep and await last(PROMPTS[1], GREEDY) == expected
        sleeping = asyncio.create_task(engine.sleep(drain_timeout_s=60))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineAsleepError):
            await last(PROMPTS[1], GREEDY)
        assert len(await running) == 120, "the open request finished"
        FAILPOINTS.disarm()
        report = await sleeping
        assert engine.asleep and report.kv_cache_bytes > 0
        await engine.wake_up()
        assert await last(PROMPTS[1], GREEDY) == expected

    try:
        asyncio.run(scenario())
    finally:
        FAILPOINTS.disarm()
        engine.shutdown()
