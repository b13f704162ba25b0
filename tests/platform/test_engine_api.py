"""LLMEngine / AsyncEngine / LLM behaviour on a tiny model: bad input, aborts, n > 1,
seeds, stop conditions, logprobs, streaming."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.platform import LLM, AsyncEngine, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), max_model_len=64, dtype="float32")


def assert_no_leak(engine: LLMEngine) -> None:
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
    assert not engine.has_unfinished()


def test_prompt_longer_than_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([list(range(1, 80))], SamplingParams(max_tokens=2))
    assert_no_leak(llm.engine)


def test_empty_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], SamplingParams(max_tokens=2))
    assert_no_leak(llm.engine)


def test_out_of_vocab_token_is_rejected(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10_000]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(temperature=-1.0), "temperature"),
        (dict(n=0), "n must be >= 1"),
    ],
)
def test_bad_sampling_params_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_kv_budget_too_small_fails_at_start_with_numbers(tiny_model_factory):
    with pytest.raises(ValueError, match=r"buys 2 blocks .* needs 4 blocks"):
        LLM(
            str(tiny_model_factory("llama")),
            max_model_len=64,
            block_size=16,
            num_blocks_override=2,
        )
    folder = str(tiny_model_factory("llama"))
    with pytest.raises(ValueError, match="KV cache budget too small: 1000 bytes"):
        LLMEngine(
            EngineConfig.from_options(folder, {"max_model_len": 64, "kv_cache_memory_bytes": 1000})
        )


def test_unknown_engine_option_is_a_type_error(tiny_model_factory):
    with pytest.raises(TypeError):
        LLM(str(tiny_model_factory("llama")), max_num_seq=4)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("victim", list(range(1, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("other", list(range(1, 10)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_cache.pool.num_free < engine.kv_cache.pool.num_blocks
    output = engine.abort_request("victim")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


def test_max_tokens_and_stop_token_ids(llm):
    prompt = list(range(5, 25))
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(free.token_ids) == 8 and free.outputs[0].finish_reason == "length"
    stop_at = free.token_ids[3]
    (stopped,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at])
    )
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_at


def test_stop_string_truncates_text(llm):
    prompt = list(range(30, 50))
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))
    words = free.text.split()
    assert len(words) >= 4
    stop = words[2]
    (stopped,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=[stop]))
    assert stopped.outputs[0].finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)
    assert_no_leak(llm.engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([[1, 2, 3, 4]], params)
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([[9, 9, 9], [1, 2, 3, 4], [7] * 20], [others, params, others])
    assert batch[1].token_ids == alone.token_ids
    (other_seed,) = llm.generate(
        [[1, 2, 3, 4]], SamplingParams(temperature=1.0, max_tokens=10, seed=99, ignore_eos=True)
    )
    assert other_seed.token_ids != alone.token_ids


def test_n_greater_than_one_forks_and_frees(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    (output,) = llm.generate([list(range(1, 21))], params)
    assert len(output.outputs) == 4
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    (greedy,) = llm.generate(
        [list(range(1, 21))], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    )
    (single,) = llm.generate([list(range(1, 21))], SamplingParams(temperature=0, max_tokens=12))
    assert all(c.token_ids == single.token_ids for c in greedy.outputs)
    assert_no_leak(llm.engine)


def test_logprobs_are_returned_per_token(llm):
    (output,) = llm.generate(
        [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )
    logprobs = output.outputs[0].logprobs
    assert len(logprobs) == 4
    for token_id, step in zip(output.token_ids, logprobs, strict=True):
        assert step.token_id == token_id
        assert len(step.top) == 3
        assert step.logprob == pytest.approx(max(step.top.values()), abs=1e-5)


def test_from_loraplex_platform_imports():
    import loraplex.platform as platform_package

    assert {"LLM", "SamplingParams"} <= set(platform_package.__all__)


def test_async_engine_streams_and_aborts(llm):
    engine = AsyncEngine(llm.engine)

    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = [o async for o in engine.generate([1, 2, 3, 4, 5], params)]
        assert outputs[-1].finished
        assert len(outputs[-1].token_ids) == 6
        lengths = [len(o.token_ids) for o in outputs]
        assert lengths == sorted(lengths)

        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        stream = engine.generate(list(range(1, 20)), long, request_id="cut")
        async for output in stream:
            if len(output.token_ids) >= 2:
                break
        await stream.aclose()
        for _ in range(100):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.02)

        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in engine.generate([], params):
                pass

    try:
        asyncio.run(scenario())
        assert_no_leak(llm.engine)
        engine.check_health()
    finally:
        engine.shutdown()


def test_a_failed_step_restarts_the_engine_in_place(tiny_model_factory):
    """A step that raises outside any one request (here: an injected fault) fails the
    in-flight consumers with EngineRestartedError; the same engine resets (fresh blocks,
    same weights), stays healthy and serves the next request as before."""
    from loraplex.platform.async_engine import EngineRestartedError

    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=5)
    expected = llm.generate([[1, 2, 3]], params)[0].token_ids
    engine = AsyncEngine(llm.engine)
    real_step = llm.engine.step
    faults = [RuntimeError("injected fault")]

    def step_once_broken():
        if faults:
            raise faults.pop()
        return real_step()

    llm.engine.step = step_once_broken

    async def scenario():
        with pytest.raises(EngineRestartedError, match="injected fault"):
            async for _ in engine.generate([1, 2, 3], params):
                pass
        engine.check_health()
        outputs = [o async for o in engine.generate([1, 2, 3], params)]
        return outputs[-1]

    try:
        output = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
        assert output.token_ids == expected
        assert llm.engine.restarts == 1
        assert_no_leak(llm.engine)
        engine.check_health()
    finally:
        engine.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_loop_fails_health_and_every_waiting_stream(tiny_model_factory):
    """If the step loop dies (here: a fault whose reset fails too), check_health raises
    and waiting consumers get EngineDeadError instead of hanging."""
    from loraplex.platform.async_engine import EngineDeadError

    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64, dtype="float32")
    engine = AsyncEngine(llm.engine)

    def broken_step():
        raise RuntimeError("injected fault")

    def broken_reset():
        raise RuntimeError("injected fault in reset")

    llm.engine.step = broken_step
    llm.engine.reset = broken_reset

    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=5)
        with pytest.raises(EngineDeadError, match="injected fault"):
            async for _ in engine.generate([1, 2, 3], params):
                pass

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


def test_warm_up_leaves_no_trace_and_changes_no_output(tiny_model_factory):
    """After `warm_up` every block is free, nothing is queued, no warm-up prompt can hit
    the prefix cache, and greedy outputs equal a cold engine's token for token."""
    folder = str(tiny_model_factory("llama"))
    options = dict(max_model_len=64, dtype="float32", max_num_seqs=8, max_num_batched_tokens=96)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8] * 3, [1] * 20]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = [o.token_ids for o in LLM(folder, **options).generate(prompts, params)]
    warm = LLM(folder, **options)
    seconds = warm.engine.warm_up()
    assert seconds > 0
    assert_no_leak(warm.engine)
    assert warm.engine.kv_cache.pool.num_cached == 0
    assert [o.token_ids for o in warm.generate(prompts, params)] == cold
    assert_no_leak(warm.engine)


def test_num_threads_sets_torch_threads(tiny_model_factory):
    import os

    import torch

    folder = str(tiny_model_factory("llama"))
    before = torch.get_num_threads()
    try:
        LLM(folder, max_model_len=32, num_threads=1)
        assert torch.get_num_threads() == 1
        LLM(folder, max_model_len=32)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        EngineConfig.from_options(folder, {"num_threads": 0})


STEP_THREAD_PROBE = """
import asyncio, ctypes, sys
from loraplex.platform import AsyncEngine, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine import LLMEngine

gomp = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
omp_get_max_threads = ctypes.CDLL(gomp).omp_get_max_threads
engine = LLMEngine(EngineConfig.from_options(sys.argv[1], {"max_model_len": 32, "num_threads": 2}))
seen = []
step = engine.step
def recording_step():
    seen.append(omp_get_max_threads())
    return step()
engine.step = recording_step
async def main():
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    async for _ in async_engine.generate([1, 2, 3], params):
        pass
    async_engine.shutdown()
asyncio.run(main())
print(sorted(set(seen)))
"""


def test_the_step_thread_computes_with_the_engine_threads(tiny_model_factory):
    """OpenMP GEMMs read the calling thread's thread count, and a new thread starts
    from OMP_NUM_THREADS (Ray sets it to 1 for a fractional replica): the engine loop
    thread must apply the engine's count itself."""
    import os
    import subprocess
    import sys

    folder = str(tiny_model_factory("llama"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", STEP_THREAD_PROBE, folder],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[2]"


def test_build_runs_every_step_on_the_thread_that_built_the_engine(tiny_model_factory, monkeypatch):
    """One OpenMP master per engine: building in the caller and stepping on the loop
    thread cost ~10% on CPU (platform/compute_threads.py)."""
    import threading

    from loraplex.platform import async_engine as async_engine_module

    threads: dict[str, set[int]] = {"built": set(), "warmed": set(), "stepped": set()}
    real_init, real_warm_up, real_step = LLMEngine.__init__, LLMEngine.warm_up, LLMEngine.step

    def init(self, config):
        threads["built"].add(threading.get_ident())
        real_init(self, config)

    def warm_up(self):
        threads["warmed"].add(threading.get_ident())
        return real_warm_up(self)

    def step(self):
        threads["stepped"].add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(async_engine_module.LLMEngine, "__init__", init)
    monkeypatch.setattr(async_engine_module.LLMEngine, "warm_up", warm_up)
    monkeypatch.setattr(async_engine_module.LLMEngine, "step", step)
    config = EngineConfig.from_options(str(tiny_model_factory("llama")), {"max_model_len": 64})
    engine = AsyncEngine.build(config, warm_up=True)

    async def one() -> None:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        async for _ in engine.generate([1, 2, 3], params):
            pass

    try:
        asyncio.run(one())
    finally:
        engine.shutdown()
    assert threads["built"] == threads["warmed"] == threads["stepped"]
    assert threads["built"] != {threading.get_ident()}


def test_build_raises_what_building_raised(tiny_model_factory):
    config = EngineConfig.from_options(
        str(tiny_model_factory("llama")), {"max_model_len": 64, "kv_cache_memory_bytes": 1}
    )
    with pytest.raises(ValueError, match="KV"):
        AsyncEngine.build(config)


def test_coalescing_schedule():
    from loraplex.platform.async_engine import _Coalescing

    def yielded(messages_per_step: int, streams: int, outputs: int, offset: int = 0):
        coalescing = _Coalescing(messages_per_step, offset)
        return [
            index
            for index in range(1, outputs + 1)
            if not coalescing.holds_back(index == outputs, streams)
        ]

    assert yielded(16, 1, 10) == list(range(1, 11))
    assert yielded(16, 16, 10) == list(range(1, 11))
    assert yielded(0, 64, 10) == list(range(1, 11))
    assert yielded(16, 64, 10) == [1, 4, 8, 10]
    assert yielded(16, 64, 10, offset=1) == [1, 3, 7, 10]
    with pytest.raises(ValueError, match="messages_per_step"):
        AsyncEngine(LLMEngine.__new__(LLMEngine), messages_per_step=-1)


def test_coalesced_streams_lose_and_repeat_nothing(llm):
    """8 streams, 2 messages per step: each stream yields about every 4th step, and what
    every stream ends with equals the engine's own greedy output, token for token."""
    import itertools

    prompts = [[1 + i, 2 + i, 3, 4 + i] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine = AsyncEngine(llm.engine, messages_per_step=2)

    async def stream(index: int) -> list[list[int]]:
        seen = []
        async for output in engine.generate(prompts[index], params, request_id=f"c{index}"):
            seen.append(list(output.outputs[0].token_ids))
        return seen

    async def scenario():
        return await asyncio.gather(*(stream(i) for i in range(8)))

    try:
        streams = asyncio.run(scenario())
    finally:
        engine.shutdown()
    for seen, tokens in zip(streams, expected, strict=True):
        assert seen[-1] == list(tokens)
        for earlier, later in itertools.pairwise(seen):
            assert later[: len(earlier)] == earlier and len(later) > len(earlier)
        assert len(seen) <= 6
    assert_no_leak(llm.engine)


def test_forwarded_outputs_are_the_ones_between_the_first_and_the_last(llm):
    """With `forward`, the iterator yields a DELTA request's first output and its last,
    and `forward` gets every one between them: all of them joined in that order equal
    the engine's greedy output. A `forward` that raises ends the request with its error
    and frees its blocks."""
    from loraplex.platform.request import DELTA, merge_outputs

    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=DELTA)
    (expected,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    engine = AsyncEngine(llm.engine)

    async def scenario():
        forwarded = []
        yielded = [o async for o in engine.generate(prompt, params, forward=forwarded.append)]
        assert len(yielded) == 2 and yielded[-1].finished and len(forwarded) == 6
        joined = yielded[0]
        for output in [*forwarded, yielded[1]]:
            joined = merge_outputs(joined, output, DELTA)
        assert joined.token_ids == expected.token_ids and joined.text == expected.text

        def refuse(output):
            raise RuntimeError("the channel is gone")

        with pytest.raises(RuntimeError, match="the channel is gone"):
            async for _ in engine.generate(prompt, params, request_id="refused", forward=refuse):
                pass
        for _ in range(100):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(scenario())
        assert_no_leak(llm.engine)
    finally:
        engine.shutdown()


def test_the_server_facing_api_reads_the_engine(llm):
    """What the model deployment reads through AsyncEngine instead of reaching into
    engine internals: limits, prompt ids (text, ids, chat), stats, a snapshot."""
    engine = AsyncEngine(llm.engine)
    try:
        assert engine.max_model_len == llm.engine.max_model_len
        assert engine.prompt_ids([5, 6, 7]) == [5, 6, 7]
        assert engine.prompt_ids("hello there") == llm.engine.tokenize("hello there")
        snapshot = engine.snapshot()
        assert snapshot.free_blocks == snapshot.total_blocks > 0
        assert snapshot.streams == 0 and not snapshot.unfinished
        assert snapshot.engine_restarts == 0
        assert engine.stats()["engine_restarts"] == 0
        engine.evict_adapter("/nonexistent", None)
    finally:
        engine.shutdown()


def test_a_reclaimed_place_starts_a_light_request_and_keeps_greedy_outputs(tiny_model_factory):
    """Fair share on a real model: with both places taken by a heavy tenant, a light
    tenant's request samples its first token in the next step (a heavy request is
    preempted), and every output equals the FCFS run's, where nothing is preempted."""
    folder = str(tiny_model_factory("llama"))
    heavy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    light = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(policy: str) -> tuple[dict[str, list[int]], int, int]:
        options = dict(max_model_len=64, dtype="float32", max_num_seqs=2, policy=policy)
        engine = LLMEngine(EngineConfig.from_options(folder, options))
        for i in range(2):
            prompt = [5 + i, 6, 7, 8, 9] * 4
            engine.add_group(engine.make_request_group(f"h{i}", prompt, heavy, tenant="heavy"))
        for _ in range(3):
            engine.step()
        engine.add_group(engine.make_request_group("l0", [11, 12, 13], light, tenant="light"))
        outputs, light_first_step, step = {}, 0, 0
        while engine.has_unfinished():
            step += 1
            for output in engine.step():
                if output.request_id == "l0" and output.outputs[0].token_ids:
                    light_first_step = light_first_step or step
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
        assert_no_leak(engine)
        return outputs, light_first_step, engine.scheduler.num_preemptions

    fair, fair_first_step, fair_preemptions = run("fair")
    fcfs, fcfs_first_step, fcfs_preemptions = run("fcfs")
    assert (fair_first_step, fair_preemptions) == (1, 1)
    assert fcfs_first_step > 1 and fcfs_preemptions == 0
    assert fair == fcfs and len(fair) == 3 and all(len(fair[f"h{i}"]) == 12 for i in range(2))
