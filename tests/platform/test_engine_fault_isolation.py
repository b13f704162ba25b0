"""One request's failure ends that request only; a failure of shared state resets the
engine in place. Outputs of the other requests equal a clean run, token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch
from fuzz_strategies import COMPLETION_BODY
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from loraplex.adapters.slots import LoRASlots
from loraplex.deployments.protocol import CompletionRequest
from loraplex.kernels.backends import get_backend
from loraplex.platform.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRestartedError,
    EngineStalledError,
    EngineStoppedError,
    RequestFailedError,
    Supervision,
)
from loraplex.platform.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from loraplex.platform.failpoints import FAILPOINTS
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams
from loraplex.platform.sampler import INVALID_TOKEN, Sampler, SamplingBatch

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=2**64 - 1, max_tokens=8)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14], [20, 21]]
POISON = [9, 9, 9, 9, 9, 9]


@pytest.fixture(autouse=True)
def disarmed():
    yield
    FAILPOINTS.disarm()


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("fault-adapters")
    good = peft_adapter_factory(base, root / "good", rank=4, seed=5)
    blowup = peft_adapter_factory(base, root / "blowup", rank=4, seed=6)
    weights = load_file(blowup / "adapter_model.safetensors")
    # Finite weights (validation passes) whose product overflows fp32 in the forward.
    save_file(
        {k: torch.full_like(v, 1e19) for k, v in weights.items()},
        blowup / "adapter_model.safetensors",
    )
    return base, good, blowup


def make_llm(base, **options) -> LLM:
    options = {"block_size": 4, **options}
    return LLM(
        str(base), dtype="float32", max_model_len=64, max_loras=2, max_lora_rank=8, **options
    )


def run(llm: LLM, prompts, params, adapters=None):
    outputs = llm.generate(prompts, params, adapters=adapters)
    llm.engine.kv_cache.check_invariants()
    assert llm.engine.kv_cache.pool.num_free == llm.engine.kv_cache.pool.num_blocks
    return outputs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_sampling_failure_ends_only_its_request(setup, params):
    base, _, _ = setup
    llm = make_llm(base)
    clean = run(llm, PROMPTS, params)
    FAILPOINTS.arm("sampler.row", prompt=POISON)
    outputs = run(llm, [*PROMPTS[:2], POISON, *PROMPTS[2:]], params)
    failed = outputs[2]
    assert failed.error is not None and not failed.error.client_fault
    assert "sampling failed" in failed.error.message
    assert failed.outputs[0].finish_reason == "error"
    assert [o.token_ids for o in outputs[:2] + outputs[3:]] == [o.token_ids for o in clean]
    assert all(o.error is None for o in outputs[:2] + outputs[3:])


def test_non_finite_logits_fail_only_the_adapter_that_made_them(setup):
    base, good, blowup = setup
    llm = make_llm(base)
    adapters = [None, str(good), None, str(good)]
    clean = run(llm, PROMPTS, GREEDY, adapters)
    outputs = run(llm, [*PROMPTS, PROMPTS[0]], GREEDY, [*adapters, str(blowup)])
    assert [o.token_ids for o in outputs[:4]] == [o.token_ids for o in clean]
    failed = outputs[4]
    assert failed.error is not None and failed.error.client_fault
    assert "non-finite" in failed.error.message and "blowup" in failed.error.message
    assert all(0 <= t < llm.engine.arch.vocab_size for o in outputs for t in o.token_ids)
    # Its KV blocks left the prefix cache: a retry recomputes (and fails) instead of
    # reading the NaN blocks, and nobody else could reach them anyway (adapter key).
    again = run(llm, [PROMPTS[0]], GREEDY, [str(blowup)])[0]
    assert again.error is not None and again.num_cached_tokens == 0


def test_non_finite_prompt_logits_fail_the_scored_request_before_it_samples(setup):
    """A prompt chunk that samples nothing still checks the logits it scores: the broken
    adapter's request ends with a client fault and books no NaN logprob."""
    base, good, blowup = setup
    llm = make_llm(base, max_num_batched_tokens=8, enable_chunked_prefill=True)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    long_prompt = list(range(30, 50))
    outputs = run(
        llm, [long_prompt, long_prompt, PROMPTS[1]], scored, [str(blowup), str(good), None]
    )
    failed = outputs[0]
    assert failed.error is not None and failed.error.client_fault
    assert "non-finite" in failed.error.message and "blowup" in failed.error.message
    assert failed.outputs[0].token_ids == []
    assert all(math.isfinite(entry.logprob) for entry in failed.prompt_logprobs[1:])
    assert len(failed.prompt_logprobs) < len(long_prompt), "it failed at its first chunk"
    for output in outputs[1:]:
        assert output.error is None
        assert all(math.isfinite(entry.logprob) for entry in output.prompt_logprobs[1:])


def test_an_adapter_that_cannot_take_a_slot_fails_only_its_requests(setup, monkeypatch):
    base, good, _ = setup
    llm = make_llm(base)
    clean = run(llm, PROMPTS, GREEDY)
    real_load = LoRASlots.load

    def load(self, adapter, slot):
        if adapter.name == "good":
            raise RuntimeError("slot write failed")
        return real_load(self, adapter, slot)

    monkeypatch.setattr(LoRASlots, "load", load)
    outputs = run(llm, [*PROMPTS, PROMPTS[1] * 3], GREEDY, [None] * 4 + [str(good)])
    assert [o.token_ids for o in outputs[:4]] == [o.token_ids for o in clean]
    assert outputs[4].error is not None and outputs[4].error.client_fault
    assert "could not be loaded into a slot" in outputs[4].error.message
    # A step that never ran publishes no block: a base request of that step aborted
    # before it ran leaves nothing a later request could hit (its K/V was never written).
    engine = llm.engine
    prompt = PROMPTS[1] * 4
    engine.add_request("base", prompt, GREEDY)
    engine.add_request("lora", prompt, GREEDY, adapter=str(good))
    failed = engine.step()
    assert [o.request_id for o in failed] == ["lora"] and failed[0].error is not None
    engine.abort_request("base")
    later = run(llm, [prompt], GREEDY)[0]
    assert later.num_cached_tokens == 0
    monkeypatch.setattr(LoRASlots, "load", real_load)
    assert later.token_ids == run(make_llm(base), [prompt], GREEDY)[0].token_ids


def test_a_detokenizing_failure_ends_only_its_group(setup, monkeypatch):
    base, _, _ = setup
    llm = make_llm(base)
    clean = run(llm, PROMPTS, GREEDY)
    real_append = IncrementalDetokenizer.append

    def append(self, new_token_ids):
        if self._ids[:CONTEXT_TOKENS] == POISON[-CONTEXT_TOKENS:]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return real_append(self, new_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "append", append)
    pair = dataclasses.replace(GREEDY, n=2)
    outputs = run(llm, [*PROMPTS[:2], POISON, *PROMPTS[2:]], [GREEDY, GREEDY, pair, GREEDY, GREEDY])
    failed = outputs[2]
    assert failed.error is not None and not failed.error.client_fault
    assert "detokenizing the output failed" in failed.error.message
    assert [o.finish_reason for o in failed.outputs] == ["error", "error"]
    assert [o.token_ids for o in outputs[:2] + outputs[3:]] == [o.token_ids for o in clean]
    assert [o.text for o in outputs[:2] + outputs[3:]] == [o.text for o in clean]
    assert all(o.error is None for o in outputs[:2] + outputs[3:])


def test_a_shared_state_failure_resets_the_engine_in_place(setup):
    base, good, _ = setup
    llm = make_llm(base)
    clean = run(llm, PROMPTS, GREEDY, [None, str(good), None, None])
    engine = AsyncEngine(llm.engine)
    FAILPOINTS.arm("engine.step", times=1)

    async def scenario():
        with pytest.raises(EngineRestartedError, match="failpoint engine.step"):
            async for _ in engine.generate(PROMPTS[0], GREEDY):
                pass
        results = []
        for prompt, adapter in zip(PROMPTS, [None, str(good), None, None], strict=True):
            outputs = [o async for o in engine.generate(prompt, GREEDY, adapter=adapter)]
            results.append(outputs[-1].token_ids)
        return results

    try:
        results = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert results == [o.token_ids for o in clean]
        assert llm.engine.restarts == 1
        engine.check_health()
        llm.engine.kv_cache.check_invariants()
    finally:
        engine.shutdown()


def test_a_persistent_step_fault_stops_the_loop_after_the_restart_budget(setup):
    """Issue 31.4: a fault that comes back on every step (a poisoned device, a recurring
    OOM) must not fail every tenant's requests forever while the replica looks healthy:
    after `max_restarts` restarts within the window the loop gives up and
    `check_health` raises, so Serve replaces the replica."""
    base, _, _ = setup
    engine = AsyncEngine(
        make_llm(base).engine, supervision=Supervision(max_restarts=2, restart_window_s=60)
    )
    FAILPOINTS.arm("engine.step")

    async def attempt() -> BaseException | None:
        try:
            async for _ in engine.generate(PROMPTS[0], GREEDY):
                pass
        except (EngineRestartedError, EngineDeadError) as exc:
            return exc
        return None

    async def scenario():
        return [await attempt() for _ in range(4)]

    try:
        errors = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert [type(e) for e in errors] == [
            EngineRestartedError,
            EngineRestartedError,
            EngineDeadError,
            EngineDeadError,
        ]
        assert "giving up" in str(errors[2])
        with pytest.raises(EngineDeadError, match="giving up"):
            engine.check_health()
    finally:
        FAILPOINTS.disarm()
        engine.shutdown()


def test_a_step_that_hangs_past_the_watchdog_fails_its_streams_and_health(setup):
    """Issue 31.4: a hung step (here: a failpoint sleeping 3 s with a 0.5 s watchdog)
    fails the open streams with a clear error and makes `check_health` raise."""
    base, _, _ = setup
    engine = AsyncEngine(make_llm(base).engine, supervision=Supervision(step_watchdog_s=0.5))

    async def scenario():
        stream = engine.generate(PROMPTS[0], GREEDY)
        FAILPOINTS.arm("engine.delay", delay_s=3.0, times=1)
        consumer = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(1.0)
        with pytest.raises(EngineStalledError, match="no progress"):
            engine.check_health()
        with pytest.raises(EngineStalledError):
            await asyncio.wait_for(consumer, timeout=5)

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        engine.shutdown()


def test_an_idle_engine_never_trips_the_watchdog(setup):
    base, _, _ = setup
    engine = AsyncEngine(
        make_llm(base).engine, idle_poll_s=0.3, supervision=Supervision(step_watchdog_s=0.2)
    )
    try:
        import time

        time.sleep(1.0)
        engine.check_health()
    finally:
        engine.shutdown()


def test_shutdown_fails_the_streams_still_open(setup):
    """Issue 31.9: a stopping engine ends its open streams with a clear error instead
    of leaving their consumers waiting."""
    base, _, _ = setup
    engine = AsyncEngine(make_llm(base).engine)
    long = dataclasses.replace(GREEDY, max_tokens=40)

    async def scenario():
        stream = engine.generate(PROMPTS[0], long)
        await anext(stream)
        FAILPOINTS.arm("engine.delay", delay_s=0.2)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineStoppedError, match="shutting down"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_the_async_engine_raises_request_failures_to_their_consumer_only(setup):
    base, _, blowup = setup
    llm = make_llm(base)
    engine = AsyncEngine(llm.engine)

    async def scenario():
        async def consume(prompt, adapter):
            outputs = [o async for o in engine.generate(prompt, GREEDY, adapter=adapter)]
            return outputs[-1]

        return await asyncio.gather(
            consume(PROMPTS[0], None), consume(PROMPTS[1], str(blowup)), return_exceptions=True
        )

    try:
        fine, failed = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert isinstance(failed, RequestFailedError) and failed.failure.client_fault
        assert fine.outputs[0].finish_reason == "length"
        engine.check_health()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_a_nan_row_never_yields_a_token_and_spares_the_others(kernels):
    logits = torch.randn(4, 32)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[3, 0] = float("inf")
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    ):
        requests = [_request(params, i) for i in range(4)]
        batch = SamplingBatch.from_requests(requests, torch.device("cpu"))
        out = Sampler(get_backend(kernels))(logits.clone(), batch)
        assert out.invalid_rows == [1, 2, 3]
        assert out.token_ids[1:] == [INVALID_TOKEN] * 3
        assert 0 <= out.token_ids[0] < 32


def _request(params, index):
    from loraplex.platform.request import Request

    return Request(request_id=f"r{index}", prompt_token_ids=[1], sampling_params=params)


def test_model_dependent_bounds_are_value_errors(setup):
    base, _, _ = setup
    llm = make_llm(base, num_blocks_override=8, block_size=8)
    vocab = llm.engine.arch.vocab_size
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary size"):
        llm.generate([[1, 2]], SamplingParams(top_k=vocab + 1))
    with pytest.raises(ValueError, match="KV cache blocks"):
        llm.generate([[1, 2]], SamplingParams(n=4, max_tokens=40))
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**64)
    for seed in (-(2**63), 2**64 - 1, 2**63):
        out = run(llm, [[1, 2]], SamplingParams(seed=seed, top_k=vocab, max_tokens=3, n=2))
        assert all(len(c.token_ids) == 3 for c in out[0].outputs)


def test_cache_salts_keep_prefix_caches_apart(setup):
    base, _, _ = setup
    llm = make_llm(base)
    engine = llm.engine
    prompt = list(range(1, 30))
    ids = iter(range(100))

    def cached(salt: str | None) -> int:
        group = engine.make_request_group(f"r{next(ids)}", prompt, GREEDY, cache_salt=salt)
        engine.add_group(group)
        while engine.has_unfinished():
            outputs = engine.step()
        return outputs[-1].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0, "another salt must not hit tenant-a's blocks"
    assert cached(None) == 0
    assert cached("tenant-b") > 0


# ---- fuzz: every value of every field is served or refused, the engine never dies ----


@pytest.fixture(scope="module")
def fuzz_llm(setup):
    return make_llm(setup[0])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=COMPLETION_BODY)
def test_sampling_fields_fuzz_served_or_refused(fuzz_llm, body):
    """Through the API's own schema and the engine's checks, as the model server does:
    each draw is refused (schema or ValueError: a 400) or served to the end."""
    try:
        request = CompletionRequest.model_validate(body)
        params = request.sampling_params(request.max_tokens or 4, request.logprobs)
    except (ValidationError, ValueError):
        return
    engine = fuzz_llm.engine
    try:
        group = engine.make_request_group("fuzz", request.prompt, params)
    except ValueError:
        return
    engine.add_group(group)
    finished = False
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            finished = finished or output.finished
    assert finished
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
