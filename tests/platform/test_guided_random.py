"""Structured output against 200 seeded random JSON schemas and 50 random regexes, all
in mixed batches (guided JSON, guided regex, unguided and LoRA requests together) on a
tiny random model with a byte-level tokenizer. Whatever the random weights prefer,
every guided output validates (jsonschema / re.fullmatch): the schemas bound their
strings, arrays and numbers, so every output ends within max_tokens."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from loraplex.platform.guided import GuidedSpec
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

NUM_SCHEMAS = 200
NUM_REGEXES = 50
MAX_TOKENS = 400


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum"]
    if depth < 2:
        kinds += ["array", "object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        return schema
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = rng.randint(-100, 100)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        pool = ["red", "green", "blue", 1, 2, 42, "a b", "Ü"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        low = rng.randint(0, 1)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    names = rng.sample(["id", "name", "tags", "size", "ok", "meta", "x", "y_z"], rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": sorted(rng.sample(names, rng.randint(0, len(names)))),
        "additionalProperties": False,
    }


def random_regex(rng: random.Random) -> str:
    atoms = ["[a-z]", "[0-9]", "[A-F0-9]", "x", "-", "_", r"\.", "(ab|cd)", "(yes|no)"]
    parts = []
    for _ in range(rng.randint(1, 5)):
        atom = rng.choice(atoms)
        low = rng.randint(0, 2)
        parts.append(rng.choice([atom, f"{atom}?", f"{atom}{{{low},{low + rng.randint(0, 3)}}}"]))
    return "".join(parts)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, peft_adapter_factory, tmp_path_factory):
    base = tiny_model_factory("llama", tokenizer="bytes")
    adapter = peft_adapter_factory(base, tmp_path_factory.mktemp("random-guided") / "a", rank=4)
    llm = LLM(
        str(base), max_model_len=512, dtype="float32", max_num_seqs=64, max_loras=1, max_lora_rank=8
    )
    return llm, llm.engine.load_adapter(str(adapter))


def test_random_schemas_and_regexes_always_validate_in_mixed_batches(setup):
    llm, lora = setup
    engine = llm.engine
    rng = random.Random(2026)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    regexes = [random_regex(rng) for _ in range(NUM_REGEXES)]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], plain)[0].outputs[0].token_ids
    expected = {}
    for index, schema in enumerate(schemas):
        spec = GuidedSpec("json_schema", json.dumps(schema))
        options = {"temperature": 0.8, "seed": index} if index % 3 == 0 else {"temperature": 0.0}
        params = SamplingParams(max_tokens=MAX_TOKENS, guided=spec, **options)
        adapter = lora if index % 2 else None
        engine.add_group(
            engine.make_request_group(f"json-{index}", [index % 500 + 1, 2], params, lora=adapter)
        )
        expected[f"json-{index}"] = ("json", schema)
        if index % 10 == 0:
            engine.add_group(engine.make_request_group(f"plain-{index}", [7, 8, 9], plain))
    for index, pattern in enumerate(regexes):
        params = SamplingParams(temperature=0.0, max_tokens=64, guided=GuidedSpec("regex", pattern))
        engine.add_group(
            engine.make_request_group(f"regex-{index}", [index + 3], params, lora=lora)
        )
        expected[f"regex-{index}"] = ("regex", pattern)
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    for request_id, (kind, rule) in expected.items():
        completion = finished[request_id]
        assert completion.finish_reason == "stop", (request_id, rule, completion)
        if kind == "json":
            jsonschema.validate(json.loads(completion.text), rule)
        else:
            assert re.fullmatch(rule, completion.text), (rule, completion.text)
    for request_id, completion in finished.items():
        if request_id.startswith("plain-"):
            assert completion.token_ids == alone
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
