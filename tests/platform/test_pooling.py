"""Embeddings (platform/pooling.py) equal transformers + PEFT: the final hidden states
pooled as the model folder's sentence-transformers modules say (last token by
default), for the base model and adapters in one batch, over prompts split into chunks,
preempted and recomputed, beside generating requests; the folder's pooling is read
from its modules.json."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from loraplex.platform.llm import LLM
from loraplex.platform.pooling import PoolingSpec, read_pooling, rows_to_pool
from loraplex.platform.request import SamplingParams

ADAPTERS = {
    "qv4": dict(rank=4, target_modules=("q_proj", "v_proj"), seed=21),
    "mlp8": dict(rank=8, target_modules=("o_proj", "gate_proj", "down_proj"), seed=22),
}
POOLINGS = {
    "last": None,
    "mean": ("pooling_mode_mean_tokens", True),
    "cls": ("pooling_mode_cls_token", False),
}
ENGINES = {
    "one_step": dict(),
    "chunked": dict(max_num_batched_tokens=16, block_size=8),
}
TIGHT = dict(num_blocks_override=17, block_size=8, max_num_batched_tokens=24)
"""A KV cache that preempts: 17 blocks of 8 tokens for prompts of up to 63 tokens and
completions that grow."""


def write_sentence_transformers_modules(folder, flag: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**flags, flag: True}))


def test_a_folder_without_modules_pools_the_last_token_normalized(tmp_path):
    assert read_pooling(tmp_path) == PoolingSpec("last", True)


@pytest.mark.parametrize(
    "flag, normalize, want",
    [
        ("pooling_mode_mean_tokens", True, PoolingSpec("mean", True)),
        ("pooling_mode_cls_token", False, PoolingSpec("cls", False)),
        ("pooling_mode_lasttoken", True, PoolingSpec("last", True)),
    ],
)
def test_sentence_transformers_modules_say_how_to_pool(tmp_path, flag, normalize, want):
    write_sentence_transformers_modules(tmp_path, flag, normalize)
    assert read_pooling(tmp_path) == want


def test_a_pooling_the_engine_cannot_do_is_refused(tmp_path):
    write_sentence_transformers_modules(tmp_path, "pooling_mode_max_tokens", True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooling(tmp_path)


def test_chunks_pool_each_position_once():
    mean = PoolingSpec("mean")
    assert [list(rows_to_pool(mean, a, b, 10)) for a, b in [(0, 4), (4, 8), (8, 11)]] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    last, cls = PoolingSpec("last"), PoolingSpec("cls")
    assert [list(rows_to_pool(last, a, b, 10)) for a, b in [(0, 9), (9, 10)]] == [[], [9]]
    assert [list(rows_to_pool(cls, a, b, 10)) for a, b in [(0, 9), (9, 10)]] == [[0], []]


@pytest.fixture(scope="module")
def pooling_setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    """The tiny Llama in one folder per pooling (the same weights), and two adapters."""
    base = tiny_model_factory("llama")
    folders = {}
    for name, modules in POOLINGS.items():
        folder = tmp_path_factory.mktemp(f"pool-{name}")
        shutil.copytree(base, folder, dirs_exist_ok=True)
        if modules is not None:
            write_sentence_transformers_modules(folder, *modules)
        folders[name] = folder
    root = tmp_path_factory.mktemp("pool-adapters")
    adapters = {
        name: peft_adapter_factory(base, root / name, **options)
        for name, options in ADAPTERS.items()
    }
    rng = random.Random(5)
    shared = [rng.randrange(512) for _ in range(24)]
    prompts = [[rng.randrange(512) for _ in range(length)] for length in (1, 5, 17, 40, 63)] + [
        shared + [7],
        shared + [9, 11],
    ]
    cycle = [None, *adapters]
    requests = [(prompt, cycle[i % len(cycle)]) for i, prompt in enumerate(prompts)]
    return base, folders, adapters, requests


def hf_hidden_states(base, adapter_folder, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The oracle: transformers' final hidden states (after the last norm) [T, H] per
    prompt, through PEFT's unmerged adapter when one is given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder).get_base_model()
    model.eval()
    with torch.inference_mode():
        return [model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts]


def pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling]
    normalize = pooling == "last" or POOLINGS[pooling][1]
    return vector / vector.norm() if normalize else vector


@pytest.fixture(scope="module")
def hidden_states(pooling_setup):
    base, _, adapters, requests = pooling_setup
    states: list[torch.Tensor | None] = [None] * len(requests)
    for adapter in [None, *adapters]:
        indices = [i for i, (_, a) in enumerate(requests) if a == adapter]
        folder = adapters[adapter] if adapter else None
        for i, hidden in zip(
            indices, hf_hidden_states(base, folder, [requests[i][0] for i in indices]), strict=True
        ):
            states[i] = hidden
    return states


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("pooling", list(POOLINGS))
def test_embeddings_equal_transformers_and_peft(pooling_setup, hidden_states, pooling, engine):
    _, folders, adapters, requests = pooling_setup
    llm = LLM(
        str(folders[pooling]),
        dtype="float32",
        max_model_len=128,
        max_lora_rank=8,
        **ENGINES[engine],
    )
    for name, folder in adapters.items():
        llm.register_adapter(name, str(folder))
    assert llm.engine.pooling.mode == pooling
    got = llm.embed([p for p, _ in requests], adapters=[a for _, a in requests])
    for index, (vector, hidden) in enumerate(zip(got, hidden_states, strict=True)):
        torch.testing.assert_close(
            torch.tensor(vector),
            pooled(hidden, pooling),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, i=index: f"prompt {i} ({pooling}, {engine}): {m}",
        )
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert kv.pool.num_free == kv.pool.num_blocks, "every embedding request freed its blocks"


def test_embeddings_run_in_the_same_batch_as_generation(pooling_setup, hidden_states):
    """Embedding and generating requests (with and without adapters) share the steps of
    a KV cache too small for them all: preempted embedding requests pool their prompt
    again from the start, the embeddings are unchanged and every completion equals the
    one it gets alone."""
    _, folders, adapters, requests = pooling_setup
    llm = LLM(str(folders["mean"]), dtype="float32", max_model_len=128, max_lora_rank=8, **TIGHT)
    for name, folder in adapters.items():
        llm.register_adapter(name, str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    engine = llm.engine
    embedding_requests = []
    for index, (prompt, adapter) in enumerate(requests):
        lora = engine.load_adapter(adapter)
        engine.add_group(engine.make_request_group(f"g{index}", prompt, params, lora=lora))
        group = engine.make_request_group(
            f"e{index}", prompt, SamplingParams(max_tokens=1), lora=lora, embed=True
        )
        embedding_requests.extend(group)
        engine.add_group(group)
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert any(request.num_preemptions for request in embedding_requests)
    for index, hidden in enumerate(hidden_states):
        assert finished[f"g{index}"].token_ids == alone[index].token_ids
        embedded = finished[f"e{index}"]
        assert embedded.token_ids == [] and embedded.outputs[0].finish_reason == "stop"
        torch.testing.assert_close(
            torch.tensor(embedded.embedding), pooled(hidden, "mean"), rtol=1e-4, atol=1e-5
        )
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


def test_an_embedding_request_takes_one_prompt_and_no_grammar(pooling_setup):
    _, folders, _, _ = pooling_setup
    llm = LLM(str(folders["last"]), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="n = 1"):
        llm.engine.make_request_group("x", [1, 2], SamplingParams(n=2), embed=True)


def test_an_input_may_fill_the_context_and_no_more(pooling_setup):
    _, folders, _, _ = pooling_setup
    llm = LLM(str(folders["last"]), dtype="float32", max_model_len=64)
    (vector,) = llm.embed([list(range(1, 65))])
    assert len(vector) == 64
    with pytest.raises(ValueError, match="input has 65 tokens, but max_model_len is 64"):
        llm.embed([list(range(1, 66))])


def test_an_adapter_whose_hidden_states_overflow_fails_its_request_alone(
    pooling_setup, peft_adapter_factory, tiny_model_factory, tmp_path
):
    """Finite weights so large that the adapted activations overflow float32: that
    embedding request fails as the client's fault; the base request beside it is served."""
    _, folders, _, _ = pooling_setup
    huge = peft_adapter_factory(tiny_model_factory("llama"), tmp_path / "huge", std=1e25)
    llm = LLM(str(folders["last"]), dtype="float32", max_model_len=64, max_lora_rank=8)
    engine = llm.engine
    engine.add_group(
        engine.make_request_group(
            "bad",
            [1, 2, 3],
            SamplingParams(max_tokens=1),
            lora=engine.load_adapter(str(huge)),
            embed=True,
        )
    )
    engine.add_group(engine.make_request_group("ok", [1, 2, 3], SamplingParams(), embed=True))
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            finished[output.request_id] = output
    assert finished["bad"].error.client_fault and "non-finite" in finished["bad"].error.message
    assert finished["ok"].error is None and len(finished["ok"].embedding) == 64
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
