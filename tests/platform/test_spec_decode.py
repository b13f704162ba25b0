"""Speculative decoding (n-gram prompt lookup): the proposer and the verification rule,
the speculative_config option, and greedy fp32 outputs equal to a non-speculative
engine token for token on a tiny random Llama (plain, both CPU kernel paths, LoRA
adapters mixed with base requests, chunked prefill, preemption, prefix-cache hits,
sampled requests in the same steps, stops inside an accepted run of drafts), with the
KV invariants checked after every step and drafts both proposed and accepted.

A random tiny model rarely repeats a prompt by chance, so the prompts here quote its
own greedy continuation: prompt + continuation + prompt again makes the second
continuation's n-grams findable in the prompt.
"""

from __future__ import annotations

import random

import pytest

from loraplex.platform.config import EngineConfig, SpeculativeConfig
from loraplex.platform.engine import LLMEngine
from loraplex.platform.request import Request, SamplingParams
from loraplex.platform.spec_decode import (
    NgramProposer,
    SpecDecodeStats,
    num_accepted,
    speculates,
)

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ---- the proposer and the verification rule -------------------------------------------
def proposer(k=3, low=1, high=3, max_model_len=1000) -> NgramProposer:
    config = SpeculativeConfig("ngram", k, low, high)
    return NgramProposer(config, max_model_len)


def naive_drafts(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The definition: the longest suffix (high .. low tokens) found earlier, its latest
    earlier occurrence, the up to k tokens after it."""
    for size in range(high, low - 1, -1):
        if size >= len(tokens):
            continue
        suffix = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + k]
    return []


def test_longest_suffix_wins_and_its_latest_occurrence():
    tokens = [5, 2, 3, 4, 8, 9, 3, 4, 6, 7, 2, 3, 4]
    # (2, 3, 4) occurred at 1..3 -> 8 9; (3, 4) alone would give 6 7 (a later match).
    assert proposer().lookup("r", tokens, 3) == [8, 9, 3]
    tokens = [1, 3, 4, 6, 9, 3, 4, 7, 5, 3, 4]
    assert proposer().lookup("r", tokens, 2) == [7, 5]


def test_no_match_below_min_and_never_the_suffix_itself():
    assert proposer().lookup("r", [1, 2, 3], 3) == []
    assert proposer(low=2).lookup("r", [1, 2, 5, 2], 3) == []
    assert proposer(low=1).lookup("r", [1, 2, 5, 2], 3) == [5, 2]
    assert proposer().lookup("r", [7, 7], 3) == [7]


@pytest.mark.parametrize("seed", range(4))
def test_incremental_index_equals_the_definition(seed):
    """Growing one request's tokens step by step (several at a time, as accepted drafts
    arrive) gives the drafts the naive search gives from scratch."""
    rng = random.Random(seed)
    low, high, k = rng.choice([(1, 3), (2, 4), (3, 3)]) + (rng.randint(1, 5),)
    tokens = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
    lookup = proposer(k, low, high)
    for _ in range(60):
        assert lookup.lookup("r", tokens, k) == naive_drafts(tokens, k, low, high)
        tokens = tokens + [rng.randrange(6) for _ in range(rng.randint(1, 4))]
    lookup.forget("r")
    assert lookup.num_indexed == 0


def test_after_a_miss_the_next_proposal_is_one_draft():
    lookup = proposer(k=3)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert lookup.lookup("r", tokens, 3) == [3, 4, 5]
    lookup.observe("r", 0)
    assert lookup.lookup("r", tokens, 3) == [3]
    lookup.observe("r", 1)
    assert lookup.lookup("r", tokens, 3) == [3, 4, 5]


def request(params: SamplingParams, prompt=(1, 2, 3), outputs=(), request_id="r") -> Request:
    req = Request(request_id, list(prompt), params)
    for token in outputs:
        req.append_output_token(token, None)
    return req


def test_drafts_leave_room_for_max_tokens_and_max_model_len():
    lookup = proposer(k=4, max_model_len=12)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    roomy = SamplingParams(temperature=0, max_tokens=9)
    # 4 more tokens fit in max_model_len: 3 drafts + 1 bonus token.
    assert lookup.propose(request(roomy, prompt, request_id="a"), 9) == [3, 1, 2]
    short = SamplingParams(temperature=0, max_tokens=3)
    assert lookup.propose(request(short, prompt, outputs=[3], request_id="b"), 9) == [1]
    assert lookup.propose(request(roomy, prompt, request_id="c"), 1) == [3]


@pytest.mark.parametrize(
    "params, outputs, expected",
    [
        (SamplingParams(temperature=0.0), (), True),
        (SamplingParams(temperature=0.0, logprobs=2, logit_bias={3: 1.0}), (), True),
        (SamplingParams(temperature=0.0, stop=["x"], stop_token_ids=[4]), (), True),
        (SamplingParams(temperature=0.7, seed=1), (), False),
        (SamplingParams(temperature=0.0, n=2), (), False),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), (), False),
        (SamplingParams(temperature=0.0, repetition_penalty=1.2), (), False),
        (SamplingParams(temperature=0.0, min_tokens=2), (5,), False),
        (SamplingParams(temperature=0.0, min_tokens=2), (5, 6), True),
    ],
)
def test_which_requests_speculate(params, outputs, expected):
    assert speculates(request(params, outputs=outputs)) is expected


def test_num_accepted_is_the_matching_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4], [3, 4]) == 0
    assert num_accepted([], [3]) == 0
    with pytest.raises(ValueError, match="3 drafts need 4 target tokens"):
        num_accepted([1, 2, 3], [1, 2, 3])


def test_stats_count_per_position():
    stats = SpecDecodeStats(3)
    stats.observe(3, 2)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(0.4)
    assert stats.mean_accepted_length == pytest.approx(2.0)


# ---- the option ---------------------------------------------------------------------------
def test_speculative_config_option_is_off_by_default_and_parsed_like_vllm():
    assert not EngineConfig.from_options("m", {}).speculative.enabled
    config = EngineConfig.from_options("m", {"speculative_config": NGRAM}).speculative
    assert config == SpeculativeConfig("ngram", 4, 1, 3) and config.enabled
    only_max = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5}
    assert SpeculativeConfig.from_option(only_max).prompt_lookup_min == 5
    assert SpeculativeConfig.from_option(None) == SpeculativeConfig()
    as_json = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    assert SpeculativeConfig.from_option(as_json) == SpeculativeConfig("ngram", 4, 3, 3)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        ({"num_speculative_tokens": 2}, "speculative_config.method is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "'draft'"),
        ("ngram", "speculative_config must be a mapping or its JSON text"),
        ("[1, 2]", "speculative_config must be a mapping or its JSON text"),
    ],
)
def test_bad_speculative_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options("m", {"speculative_config": value})


# ---- engines: speculative outputs equal non-speculative ones ---------------------------------
def make_engine(folder, speculative: bool, **options) -> LLMEngine:
    options = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 2**22, **options}
    if speculative:
        options["speculative_config"] = NGRAM
    return LLMEngine(EngineConfig.from_options(str(folder), options))


def run(engine: LLMEngine, requests, adapters=None) -> dict[str, object]:
    """Adds (id, prompt, params) requests and steps to the end, checking the KV
    invariants after every step (no block past a running request's tokens is held:
    rejected drafts' blocks went back); returns id -> finished output."""
    for index, (request_id, prompt, params) in enumerate(requests):
        adapter = adapters[index] if adapters else None
        engine.add_request(request_id, prompt, params, adapter=adapter)
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        kv = engine.kv_cache
        kv.check_invariants()
        for req in engine.scheduler.running:
            assert len(kv.block_ids(req.request_id)) <= kv.blocks_needed(req.num_tokens)
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
    if engine.scheduler.proposer is not None:
        assert engine.scheduler.proposer.num_indexed == 0
    return finished


def same_outputs(base: dict, spec: dict) -> None:
    assert base.keys() == spec.keys()
    for request_id, want in base.items():
        got = spec[request_id]
        for w, g in zip(want.outputs, got.outputs, strict=True):
            assert g.token_ids == w.token_ids, request_id
            assert (g.text, g.finish_reason, g.stop_reason) == (
                w.text,
                w.finish_reason,
                w.stop_reason,
            ), request_id


def counters(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.spec_stats
    return stats.num_draft_tokens, stats.num_accepted_tokens


def assert_speculated(engine: LLMEngine, before=(0, 0)) -> None:
    drafted, accepted = counters(engine)
    assert drafted > before[0], "no drafts were proposed: the test proves nothing"
    assert accepted > before[1], "no draft was accepted: the test proves nothing"


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engines(folder):
    return make_engine(folder, False), make_engine(folder, True)


@pytest.fixture(scope="module")
def quoting_prompts(engines) -> list[list[int]]:
    """Prompts quoting the base engine's own greedy continuation: p + c + p."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(rng.choice([5, 9, 17, 30]))] for _ in range(6)]
    first = run(engines[0], [(f"q{i}", p, GREEDY) for i, p in enumerate(prompts)])
    return [p + first[f"q{i}"].token_ids + p for i, p in enumerate(prompts)]


def test_plain_batch_equals_non_speculative(engines, quoting_prompts):
    base, spec = engines
    before = counters(spec)
    requests = [(f"plain{i}", p, GREEDY) for i, p in enumerate(quoting_prompts)]
    same_outputs(run(base, requests), run(spec, requests))
    assert_speculated(spec, before)
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] == sum(
        stats[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(4)
    )


def test_torch_kernel_path_equals_non_speculative(folder, quoting_prompts, monkeypatch):
    """The plain torch backend's attention for a chunk with context (SDPA over the
    gathered cache) verifies drafts as the native path does."""
    monkeypatch.setenv("LORAPLEX_KERNEL_BACKEND", "torch")
    base, spec = make_engine(folder, False), make_engine(folder, True)
    assert spec.kernel_backend == "torch"
    requests = [(f"torch{i}", p, GREEDY) for i, p in enumerate(quoting_prompts[:3])]
    same_outputs(run(base, requests), run(spec, requests))
    assert_speculated(spec)


def test_sampled_and_logprob_requests_in_the_same_steps(engines, quoting_prompts):
    """Seeded sampled requests (which never speculate) keep their outputs next to
    speculating greedy ones; greedy logprob requests speculate and keep their tokens."""
    base, spec = engines
    before = counters(spec)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16)
    logprobs = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    requests = []
    for i, prompt in enumerate(quoting_prompts[:4]):
        requests.append((f"greedy{i}", prompt, GREEDY))
        requests.append((f"sampled{i}", prompt, sampled))
    requests.append(("logprobs", quoting_prompts[4], logprobs))
    want, got = run(base, requests), run(spec, requests)
    same_outputs(want, got)
    assert_speculated(spec, before)
    for w, g in zip(
        want["logprobs"].outputs[0].logprobs, got["logprobs"].outputs[0].logprobs, strict=True
    ):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)


def test_prefix_cache_hits(engines, quoting_prompts):
    base, spec = engines
    requests = [(f"prefix-a{i}", p, GREEDY) for i, p in enumerate(quoting_prompts[:3])]
    again = [(f"prefix-b{i}", p, GREEDY) for i, p in enumerate(quoting_prompts[:3])]
    same_outputs(run(base, requests), run(spec, requests))
    hits = spec.kv_cache.prefix_hits
    before = counters(spec)
    same_outputs(run(base, again), run(spec, again))
    assert spec.kv_cache.prefix_hits > hits
    assert_speculated(spec, before)


def test_n_greater_than_one_and_abort_with_speculation_on(engines, quoting_prompts):
    base, spec = engines
    params = SamplingParams(temperature=0.0, n=2, max_tokens=8, ignore_eos=True)
    requests = [("group", quoting_prompts[0], params)]
    same_outputs(run(base, requests), run(spec, requests))
    spec.add_request("aborted", quoting_prompts[1], GREEDY)
    for _ in range(3):
        spec.step()
    spec.abort_request("aborted")
    assert spec.kv_cache.pool.num_free == spec.kv_cache.pool.num_blocks
    assert spec.scheduler.proposer.num_indexed == 0


def step_runs(engine: LLMEngine, request_id: str, prompt, params) -> list[list[int]]:
    """The new tokens of one request step by step."""
    engine.add_request(request_id, prompt, params)
    runs, seen = [], 0
    while engine.has_unfinished():
        for output in engine.step():
            ids = output.token_ids
            runs.append(ids[seen:])
            seen = len(ids)
    return runs


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids", "stop_string", "max_tokens"])
def test_stop_inside_an_accepted_run_of_drafts(engines, quoting_prompts, stop_kind):
    """A token that stops a request inside a run of accepted drafts ends it there:
    same tokens, text and finish reason as without speculation."""
    base, spec = engines
    prompt = next(
        p for p in quoting_prompts if any(len(r) > 2 for r in step_runs(spec, "probe", p, GREEDY))
    )
    runs = step_runs(spec, "probe", prompt, GREEDY)
    tokens = [t for r in runs for t in r]
    # A token whose first occurrence is inside a multi-token step, not its last token.
    offset, stop_at = 0, None
    for r in runs:
        for i, token in enumerate(r[:-1]):
            if stop_at is None and len(r) > 1 and token not in tokens[: offset + i]:
                stop_at = offset + i
        offset += len(r)
    assert stop_at is not None
    token = tokens[stop_at]
    params = {
        "eos": SamplingParams(temperature=0.0, max_tokens=24),
        "stop_token_ids": SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[token]),
        "stop_string": SamplingParams(temperature=0.0, max_tokens=24, stop=[f"w{token} "]),
        "max_tokens": SamplingParams(temperature=0.0, max_tokens=stop_at + 1, ignore_eos=True),
    }[stop_kind]
    saved = base.eos_token_ids, spec.eos_token_ids
    if stop_kind == "eos":
        base.eos_token_ids = spec.eos_token_ids = frozenset({token})
    try:
        requests = [(f"stop-{stop_kind}", prompt, params)]
        want, got = run(base, requests), run(spec, requests)
    finally:
        base.eos_token_ids, spec.eos_token_ids = saved
    same_outputs(want, got)
    if stop_kind != "stop_string":
        assert got[f"stop-{stop_kind}"].token_ids == tokens[: stop_at + 1]


def test_chunked_prefill_mixes_chunks_with_speculating_decodes(folder, quoting_prompts):
    options = {"max_num_batched_tokens": 24}
    base, spec = make_engine(folder, False, **options), make_engine(folder, True, **options)
    requests = [(f"chunk{i}", p, GREEDY) for i, p in enumerate(quoting_prompts)]
    same_outputs(run(base, requests), run(spec, requests))
    assert_speculated(spec)


def test_preemption_under_a_tiny_kv_cache(folder, quoting_prompts):
    options = {"num_blocks_override": 24, "block_size": 8, "max_model_len": 128}
    base, spec = make_engine(folder, False, **options), make_engine(folder, True, **options)
    requests = [(f"preempt{i}", p, GREEDY) for i, p in enumerate(quoting_prompts)]
    same_outputs(run(base, requests), run(spec, requests))
    assert spec.scheduler.num_preemptions > 0
    assert_speculated(spec)


def test_lora_adapters_mixed_with_base_requests(
    folder, quoting_prompts, tmp_path, peft_adapter_factory
):
    adapters = {
        "qv": peft_adapter_factory(folder, tmp_path / "qv", seed=1),
        "mlp": peft_adapter_factory(
            folder, tmp_path / "mlp", rank=8, target_modules=("gate_proj", "down_proj"), seed=2
        ),
    }
    base, spec = make_engine(folder, False), make_engine(folder, True)
    for engine in (base, spec):
        for name, path in adapters.items():
            engine.register_adapter(name, str(path))
    names = [None, "qv", "mlp"]
    # Each adapter's own continuation, quoted, so its drafts get accepted too.
    firsts = run(
        base,
        [(f"first{i}", p[:12], GREEDY) for i, p in enumerate(quoting_prompts)],
        adapters=[names[i % 3] for i in range(len(quoting_prompts))],
    )
    prompts = [
        p[:12] + firsts[f"first{i}"].token_ids + p[:12] for i, p in enumerate(quoting_prompts)
    ]
    requests = [(f"lora{i}", p, GREEDY) for i, p in enumerate(prompts)]
    which = [names[i % 3] for i in range(len(prompts))]
    want, got = run(base, requests, which), run(spec, requests, which)
    same_outputs(want, got)
    assert_speculated(spec)
    assert want["lora1"].token_ids != want["lora0"].token_ids
