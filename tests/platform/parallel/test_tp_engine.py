"""The engine with tensor_parallel_size=2 (rank 0 here, rank 1 a Ray worker actor) gives
the greedy fp32 outputs of tensor_parallel_size=1, token for token, with base and
adapter requests mixed in one batch: on the default model (3 kv heads: 2 + 1 per
rank) with its demo adapters, and on a tiny model whose single kv head is replicated.
Each rank holds about half the weights and KV; a dead worker fails the engine fast."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from loraplex.platform.async_engine import AsyncEngine, EngineDeadError
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

logger = logging.getLogger(__name__)
DEMO = Path(__file__).resolve().parents[3] / "adapters" / "demo"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's Ray cluster when one runs (the Serve tests start it), else a local one."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def generate(llm: LLM, prompts, adapters) -> tuple[list[list[int]], list, list]:
    """Token ids, the prompt logprobs and the prompts' embeddings (both compared
    approximately)."""
    outputs = llm.generate(prompts, GREEDY, adapters)
    scores = [[(e.token_id, e.logprob) for e in o.prompt_logprobs[1:]] for o in outputs]
    return [o.token_ids for o in outputs], scores, llm.embed(prompts, adapters)


def assert_same_prompt_scores(want: list, got: list) -> None:
    """Prompt logprobs of both sizes: same tokens, logprobs within fp32 noise (the
    sharded vocabulary is gathered across ranks before the log-softmax)."""
    assert len(want) == len(got)
    for ours, theirs in zip(want, got, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=1e-4)


def assert_same_embeddings(want: list, got: list) -> None:
    """Embeddings of both sizes within fp32 noise (the sharded projections sum their
    partial products across ranks)."""
    for ours, theirs in zip(want, got, strict=True):
        assert theirs == pytest.approx(ours, abs=1e-5)


def both_sizes(model: str, adapters: dict[str, Path], prompts, request_adapters, **options):
    """Outputs and shard memory at tensor_parallel_size 1 and 2 (same block count)."""
    results = {}
    for size in (1, 2):
        llm = LLM(model, dtype="float32", tensor_parallel_size=size, **options)
        try:
            for name, folder in adapters.items():
                llm.register_adapter(name, str(folder))
            tokens, scores, embeddings = generate(llm, prompts, request_adapters)
            results[size] = (tokens, llm.engine.shard_memory(), scores, embeddings)
        finally:
            llm.engine.shutdown()
    return results


def test_default_model_with_demo_adapters(ray_cluster):
    prompts = [
        "What is the capital of France?",
        "Tell me about the sea.",
        "What is the capital of France?",
        "Name three fruits.",
        "Tell me about the sea.",
        "How do birds fly?",
    ]
    adapters = {"french": DEMO / "french", "pirate": DEMO / "pirate"}
    request_adapters = [None, "pirate", "french", "french", None, "pirate"]
    results = both_sizes(
        "smollm2-135m-instruct",
        adapters,
        prompts,
        request_adapters,
        max_model_len=256,
        num_blocks_override=64,
    )
    assert results[2][0] == results[1][0]
    assert_same_prompt_scores(results[1][2], results[2][2])
    assert_same_embeddings(results[1][3], results[2][3])
    assert results[1][0][0] != results[1][0][2], "the adapter should change the answer"
    (single,), (rank0, rank1) = results[1][1], results[2][1]
    logger.info("per-rank memory TP=1: %s; TP=2: %s, %s", single, rank0, rank1)
    # 3 kv heads split 2 + 1, the q heads and o_proj columns with them.
    assert rank0.kv_cache_bytes + rank1.kv_cache_bytes == single.kv_cache_bytes
    assert rank0.kv_cache_bytes == 2 * rank1.kv_cache_bytes
    # Only the norms are replicated (a few KiB of a 538 MB model).
    both = rank0.weight_bytes + rank1.weight_bytes
    assert single.weight_bytes < both < 1.001 * single.weight_bytes
    assert max(rank0.weight_bytes, rank1.weight_bytes) < 0.54 * single.weight_bytes


def test_replicated_kv_head_with_mixed_adapters(
    ray_cluster, tiny_model_factory, peft_adapter_factory, tmp_path
):
    base = tiny_model_factory("llama", num_key_value_heads=1)
    attention = peft_adapter_factory(base, tmp_path / "attn", rank=4, seed=1)
    everything = peft_adapter_factory(
        base,
        tmp_path / "all",
        rank=8,
        seed=2,
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
    )
    prompts = [[3, 4, 5, 6, 7] * 4, [9, 8, 7], [3, 4, 5, 6, 7] * 4 + [1, 2], [100, 200], [42] * 30]
    request_adapters = ["attn", None, "all", "all", "attn"]
    results = both_sizes(
        str(base),
        {"attn": attention, "all": everything},
        prompts,
        request_adapters,
        max_model_len=128,
        num_blocks_override=40,
        block_size=4,
        max_num_batched_tokens=24,
    )
    assert results[2][0] == results[1][0]
    assert_same_prompt_scores(results[1][2], results[2][2])
    assert_same_embeddings(results[1][3], results[2][3])
    (single,), (rank0, rank1) = results[1][1], results[2][1]
    # One kv head cannot be split: each rank keeps a full copy of the (small) KV.
    assert rank0.kv_cache_bytes == rank1.kv_cache_bytes == single.kv_cache_bytes


def test_dead_worker_fails_the_engine_instead_of_hanging(ray_cluster, tiny_model_factory):
    import ray

    base = tiny_model_factory("llama")
    llm = LLM(
        str(base),
        tensor_parallel_size=2,
        max_model_len=128,
        distributed_timeout_s=20.0,
        kv_cache_memory_bytes=16 * 2**20,
    )
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    async def scenario() -> float:
        outputs = [o async for o in engine.generate([1, 2, 3], params)]
        assert outputs[-1].finished
        stream = engine.generate([4, 5, 6], long_params)
        await stream.__anext__()
        ray.kill(llm.engine.workers.actors[0], no_restart=True)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        return time.monotonic() - killed

    try:
        waited = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert waited < 30
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


def test_unschedulable_worker_is_a_clear_error(ray_cluster, tiny_model_factory):
    base = tiny_model_factory("llama")
    with pytest.raises(RuntimeError, match="did not start within 3s.*64 CPU"):
        LLM(str(base), tensor_parallel_size=2, worker_num_cpus=64, distributed_timeout_s=3)


def test_saved_modules_are_refused_under_tensor_parallelism(
    ray_cluster, tiny_model_factory, peft_adapter_factory, tmp_path
):
    """An adapter with its own LM head (`modules_to_save`) fails its own request with a
    client fault naming tensor parallelism (the ranks hold vocabulary shards); the base
    request beside it is served."""
    base = tiny_model_factory("llama")
    folder = peft_adapter_factory(base, tmp_path / "own-head", modules_to_save=("lm_head",))
    llm = LLM(
        str(base), tensor_parallel_size=2, max_model_len=128, kv_cache_memory_bytes=16 * 2**20
    )
    try:
        llm.register_adapter("own-head", str(folder))
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        served, refused = llm.generate([[1, 2, 3]] * 2, params, adapters=[None, "own-head"])
        assert served.error is None and len(served.token_ids) == 4
        assert refused.error is not None and refused.error.client_fault
        assert "tensor parallelism" in refused.error.message
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("source", ["quantized on load", "int8 checkpoint"])
def test_int8_projections_at_two_ranks_match_one(
    ray_cluster, tiny_model_factory, peft_adapter_factory, tmp_path, source
):
    """int8 projections sharded over two ranks (column-parallel rows keep their scales;
    a row-parallel shard quantizes its own columns, or reads them from the checkpoint)
    give the prompt logprobs of one rank within int8 rounding, base and adapter mixed."""
    from loraplex.tools.quantize import quantize_folder

    base = tiny_model_factory("llama")
    folder = base if source == "quantized on load" else quantize_folder(base, tmp_path / "w8a8")
    options = {"quantization": "int8"} if source == "quantized on load" else {}
    adapter = peft_adapter_factory(base, tmp_path / "qv", target_modules=("q_proj", "o_proj"))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [27, 18, 28, 18, 28, 45, 90, 45] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    scores = {}
    for size in (1, 2):
        llm = LLM(
            str(folder), dtype="float32", tensor_parallel_size=size, max_model_len=64, **options
        )
        try:
            llm.register_adapter("qv", str(adapter))
            outputs = llm.generate(prompts, params, adapters=[None, "qv"])
            scores[size] = [[e.logprob for e in o.prompt_logprobs[1:]] for o in outputs]
        finally:
            llm.engine.shutdown()
    for one, two in zip(scores[1], scores[2], strict=True):
        assert two == pytest.approx(one, abs=0.05)
