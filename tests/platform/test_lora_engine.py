"""Mixed-adapter batches equal PEFT (unmerged adapters on HF transformers), greedy fp32,
token for token: base and several adapters of different ranks and target modules in
one batch, with prefix caching, forced preemption and fewer slots than adapters."""

from __future__ import annotations

import random
import shutil

import pytest

from loraplex.adapters.peft_format import SUPPORTED_MODULES
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

MAX_NEW = 10

ADAPTERS = {
    "qv4": dict(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), seed=1),
    "all8": dict(
        rank=8,
        alpha=16.0,
        target_modules=SUPPORTED_MODULES,
        seed=2,
    ),
    "mlp2rs": dict(
        rank=2,
        alpha=4.0,
        target_modules=("o_proj", "gate_proj", "down_proj"),
        use_rslora=True,
        seed=3,
    ),
    "pattern16": dict(
        rank=16,
        alpha=8.0,
        target_modules=("k_proj", "up_proj"),
        rank_pattern={"up_proj": 4},
        alpha_pattern={"k_proj": 32.0},
        seed=4,
    ),
}

MODES = {
    "prefix_cache": dict(),
    "preempt": dict(num_blocks_override=24, block_size=8),
    "two_slots": dict(max_loras=2, max_num_batched_tokens=40),
}


@pytest.fixture(scope="module")
def lora_setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("adapters")
    folders = {
        name: peft_adapter_factory(base, root / name, **options)
        for name, options in ADAPTERS.items()
    }
    return base, folders


def mixed_requests(vocab: int, names: list[str], seed: int = 0):
    """18 (prompt, adapter) pairs: every adapter and the base, mixed lengths, a shared
    33-token prefix across adapters, and one prompt sent to two adapters."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(33)]
    cycle = [None, *names]
    requests = []
    for i in range(16):
        tail = [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 9, 17, 30]))]
        prompt = shared + tail if i % 2 == 0 else tail
        requests.append((prompt, cycle[i % len(cycle)]))
    same = [rng.randrange(vocab) for _ in range(20)]
    requests.append((shared + same, names[0]))
    requests.append((shared + same, names[1]))
    return requests


@pytest.fixture(scope="module")
def expected(lora_setup, peft_oracle, hf_greedy):
    """The oracle's outputs: PEFT's unmerged adapter (or the bare base) on HF
    transformers, greedy."""
    base, folders = lora_setup
    requests = mixed_requests(512, list(folders))
    by_adapter: dict[str | None, list[int]] = {}
    for index, (_, adapter) in enumerate(requests):
        by_adapter.setdefault(adapter, []).append(index)
    result: list[list[int] | None] = [None] * len(requests)
    for adapter, indices in by_adapter.items():
        prompts = [requests[i][0] for i in indices]
        folder = folders[adapter] if adapter else None
        outputs = hf_greedy(peft_oracle(base, folder), prompts, MAX_NEW)
        for i, out in zip(indices, outputs, strict=True):
            result[i] = out
    return requests, result


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_adapters_match_peft(lora_setup, expected, mode):
    base, folders = lora_setup
    requests, want = expected
    llm = LLM(str(base), dtype="float32", max_model_len=128, max_lora_rank=16, **MODES[mode])
    for name, folder in folders.items():
        llm.register_adapter(name, str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    got = [o.token_ids for o in outputs]
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, f"requests {mismatches} differ from PEFT ({mode})"
    engine = llm.engine
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if mode == "two_slots":
        assert engine.runner.lora_slots.stats.evictions > 0
    if mode == "prefix_cache":
        # The shared prefix is cached per adapter: the two-adapter pair shares no KV.
        assert outputs[-1].num_cached_tokens <= 32


def test_adapters_change_outputs(expected):
    """Guards the oracle: every adapter's greedy output differs from the base's somewhere."""
    requests, want = expected
    base_outputs = {
        tuple(p): out for (p, adapter), out in zip(requests, want, strict=True) if adapter is None
    }
    assert base_outputs
    llm_outputs = {adapter for (_, adapter), out in zip(requests, want, strict=True)}
    assert len(llm_outputs) == len(ADAPTERS) + 1
    pair = want[-2:]
    assert pair[0] != pair[1], "two adapters on the same prompt should disagree"


def test_same_name_new_weights_gives_new_outputs_and_no_stale_kv(
    lora_setup, tmp_path, peft_adapter_factory, peft_oracle, hf_greedy
):
    """The adapter identity is its content: rewriting an adapter under the same name
    changes outputs and never reuses KV blocks computed with the old weights."""
    base, folders = lora_setup
    folder = tmp_path / "tenant-adapter"
    shutil.copytree(folders["qv4"], folder)
    llm = LLM(str(base), dtype="float32", max_model_len=128)
    llm.register_adapter("mine", str(folder))
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([prompt], params, adapters=["mine"])[0]
    again = llm.generate([prompt], params, adapters=["mine"])[0]
    assert again.num_cached_tokens > 0, "same adapter, same prompt: the prefix cache hits"
    assert again.token_ids == first.token_ids
    old_key = llm.engine.adapters.load("mine").key

    shutil.rmtree(folder)
    peft_adapter_factory(base, folder, **{**ADAPTERS["qv4"], "seed": 99})
    new = llm.generate([prompt], params, adapters=["mine"])[0]
    assert llm.engine.adapters.load("mine").key != old_key
    assert new.num_cached_tokens == 0, "KV computed with the old weights was reused"
    assert new.token_ids == hf_greedy(peft_oracle(base, folder), [prompt], MAX_NEW)[0]
    assert new.token_ids != first.token_ids


def test_triton_lora_path_matches_torch_path(lora_setup, monkeypatch):
    """The engine's greedy outputs are the same through the Triton LoRA kernels (run by
    the interpreter on CPU) as through the torch path."""
    base, folders = lora_setup
    requests = mixed_requests(512, list(folders), seed=5)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LORAPLEX_KERNEL_BACKEND", backend)
        llm = LLM(str(base), dtype="float32", max_model_len=128)
        assert llm.engine.runner.lora_slots.projections[0].lora_kernels.name == backend
        for name, folder in folders.items():
            llm.register_adapter(name, str(folder))
        results = llm.generate([p for p, _ in requests], params, [a for _, a in requests])
        outputs[backend] = [o.token_ids for o in results]
    assert outputs["triton"] == outputs["torch"]
