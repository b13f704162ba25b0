"""Structured output in the engine (platform/guided.py): on a tiny random model with a
byte-level tokenizer, whatever the weights prefer, guided outputs spell what their spec
describes (checked with jsonschema and re.fullmatch), in batches mixed with unguided
and LoRA requests, and the unguided ones are unchanged by their neighbours."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from loraplex.platform import guided as guided_module
from loraplex.platform.async_engine import AsyncEngine
from loraplex.platform.guided import GuidedSpec
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(
        str(tiny_model_factory("llama", tokenizer="bytes")),
        max_model_len=256,
        dtype="float32",
        max_loras=2,
        max_lora_rank=8,
    )


@pytest.fixture(scope="module")
def adapter(tiny_model_factory, peft_adapter_factory, tmp_path_factory):
    base = tiny_model_factory("llama", tokenizer="bytes")
    return peft_adapter_factory(
        base, tmp_path_factory.mktemp("guided-adapter") / "a", rank=4, seed=3
    )


def guided(spec: GuidedSpec, **options) -> SamplingParams:
    """Greedy, MAX_TOKENS, unless `options` say otherwise."""
    return SamplingParams(guided=spec, **{"temperature": 0.0, "max_tokens": MAX_TOKENS, **options})


PROMPTS = [[5, 6, 7], [100, 200], [300, 301, 302, 303], [42]]


def test_a_json_schema_output_validates(llm):
    for output in llm.generate(PROMPTS, guided(GuidedSpec("json_schema", json.dumps(SCHEMA)))):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_seeded_samples_validate_too(llm):
    params = guided(GuidedSpec("json_schema", json.dumps(SCHEMA)), temperature=1.0, seed=7, n=3)
    for output in llm.generate(PROMPTS, params):
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), SCHEMA)
            else:
                assert completion.finish_reason == "length"


@pytest.mark.parametrize(
    "spec, check",
    [
        (
            GuidedSpec("regex", r"[0-9]{3}-[a-c]{2}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t),
        ),
        (GuidedSpec.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (
            GuidedSpec("grammar", 'root ::= "A" [0-9] [0-9]? "!"'),
            lambda t: re.fullmatch(r"A\d\d?!", t),
        ),
    ],
)
def test_regex_choice_and_grammar_outputs_match(llm, spec, check):
    for output in llm.generate(PROMPTS, guided(spec)):
        assert output.outputs[0].finish_reason == "stop"
        assert check(output.outputs[0].text), output.outputs[0].text


def test_json_object_outputs_parse_or_run_out_of_tokens(llm):
    for output in llm.generate(PROMPTS, guided(GuidedSpec("json_object"), max_tokens=48)):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_guided_unguided_and_lora_requests_share_batches(llm, adapter):
    """Unguided greedy outputs are the same alone and beside guided ones; guided ones
    validate with and without an adapter."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    engine = llm.engine
    lora = engine.load_adapter(str(adapter))
    for index, prompt in enumerate(PROMPTS):
        engine.add_group(engine.make_request_group(f"plain-{index}", prompt, plain))
        engine.add_group(engine.make_request_group(f"guided-{index}", prompt, guided(spec)))
        engine.add_group(
            engine.make_request_group(f"lora-{index}", prompt, guided(spec), lora=lora)
        )
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    for index in range(len(PROMPTS)):
        assert finished[f"plain-{index}"].token_ids == alone[index]
        for kind in ("guided", "lora"):
            jsonschema.validate(json.loads(finished[f"{kind}-{index}"].text), SCHEMA)
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


def test_max_tokens_cuts_a_guided_output_with_length(llm):
    (output,) = llm.generate(
        [PROMPTS[0]], guided(GuidedSpec("json_schema", json.dumps(SCHEMA)), max_tokens=3)
    )
    assert output.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "spec",
    [
        GuidedSpec("regex", "(unclosed"),
        GuidedSpec("grammar", "root ::= missing_rule"),
        GuidedSpec("json_schema", "{not json"),
        GuidedSpec("choice", "[]"),
    ],
)
def test_a_spec_that_does_not_compile_is_a_value_error(llm, spec):
    with pytest.raises(ValueError, match="does not compile"):
        llm.engine.compile_grammar(spec)


def test_compiled_grammars_are_cached_by_content(llm):
    first = llm.engine.compile_grammar(GuidedSpec("regex", "[a-z]+"))
    assert llm.engine.compile_grammar(GuidedSpec("regex", "[a-z]+")) is first
    assert llm.engine.compile_grammar(GuidedSpec("regex", "[a-y]+")) is not first


def counted_compiles(grammars, monkeypatch) -> list[GuidedSpec]:
    """The specs `grammars` compiles from now on (cache hits are not compiles)."""
    compiles = []
    compile_spec = grammars._compile

    def counting(spec):
        compiles.append(spec)
        return compile_spec(spec)

    monkeypatch.setattr(grammars, "_compile", counting)
    return compiles


def test_compiled_grammars_are_cached_per_tenant(llm, monkeypatch):
    """A tenant's request never reuses a grammar another tenant's request compiled (its
    first-token latency would tell that the other used that schema); the same tenant's
    next request does."""
    compiles = counted_compiles(llm.engine.grammars, monkeypatch)
    params = guided(GuidedSpec("regex", "per-tenant [a-c]+"))
    for index, tenant in enumerate(["a", "a", "b"]):
        llm.engine.make_request_group(f"tenant-{index}", PROMPTS[0], params, tenant=tenant)
    assert len(compiles) == 2


def test_the_async_engine_compiles_per_tenant(llm, monkeypatch):
    """The served path: AsyncEngine compiles before it builds the request, under the
    request's tenant."""
    compiles = counted_compiles(llm.engine.grammars, monkeypatch)
    params = guided(GuidedSpec("regex", "async per-tenant [a-c]+"), max_tokens=2)
    engine = AsyncEngine(llm.engine)

    async def scenario():
        for tenant in ["a", "a", "b"]:
            async for _ in engine.generate(PROMPTS[0], params, tenant=tenant):
                pass

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        engine.shutdown()
    assert len(compiles) == 2


def test_the_grammar_cache_bound_counts_every_tenant(llm, monkeypatch):
    monkeypatch.setattr(guided_module, "CACHE_SIZE", 2)
    grammars = llm.engine.grammars
    spec = GuidedSpec("regex", "bounded [a-c]+")
    for tenant in ["a", "b", "c"]:
        grammars.compile(spec, tenant)
    assert len(grammars._cache) == 2


def test_a_grammar_the_vocabulary_cannot_spell_fails_that_request_alone(tiny_model_factory):
    """The word-level test tokenizer ('w0' ... ) has no digits: a digits regex can never
    continue. That request ends with a client-fault error (any temperature, logprobs
    too); the request beside it completes."""
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128, dtype="float32", max_loras=0)
    engine = llm.engine
    digits = GuidedSpec("regex", "[0-9]+")
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "logprobs": 2}):
        engine.add_group(engine.make_request_group("guided", [5, 6], guided(digits, **options)))
        plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.add_group(engine.make_request_group("plain", [5, 6], plain))
        finished = {}
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        assert finished["guided"].error is not None and finished["guided"].error.client_fault
        assert "vocabulary" in finished["guided"].error.message
        assert finished["plain"].error is None and len(finished["plain"].outputs[0].token_ids) == 4


def test_banned_bits_clear_exactly_the_banned_tokens():
    """xgrammar's packing (bit t % 32 of word t // 32), high bits included."""
    from loraplex.platform.guided import _bits_without

    banned = [0, 5, 31, 32, 63, 511]
    words = _bits_without(banned, 512)
    allowed = [(int(words[t // 32]) >> (t % 32)) & 1 for t in range(512)]
    assert [t for t in range(512) if not allowed[t]] == banned
