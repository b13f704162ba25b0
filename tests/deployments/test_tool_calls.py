"""Tool calls over the real app with the official `openai` SDK: `tool_choice` required,
a named function, auto (read back from the Hermes-style template of `tiny-bytes`) and
none, streamed and not, on a base model and its adapter; and every bad tools value a
400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now"},
}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "What is the weather in Rome?"}]
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}
FORCED_CALL = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
)


def check_call(call) -> dict:
    """A tool call in the OpenAI shape whose arguments follow its function's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index {id, name, arguments}, finish_reason) of a stream,
    merged as the SDK's accumulators do: id and name once, arguments concatenated."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id is not None:
                assert call["id"] is None, "a call's id comes once"
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("model", ["tiny-bytes", "tiny-bytes:sj"])
def test_required_returns_calls_that_follow_their_schemas(client, model):
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)


def test_required_without_parallel_calls_makes_exactly_one(client):
    answers = client.chat.completions.create(
        model="tiny-bytes:sj",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        n=3,
        temperature=1.0,
        seed=5,
    )
    for choice in answers.choices:
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_required_streams_its_calls(client):
    kwargs = dict(
        model="tiny-bytes:sj",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


@pytest.mark.parametrize("model", ["tiny-bytes", "tiny-bytes:sj"])
def test_named_function_streams_its_arguments(client, model):
    kwargs = dict(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop", "a forced call ends as OpenAI's do"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = check_call(call)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    argument_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(argument_chunks) > 1, "the arguments arrive as they are written"
    content, calls, finish = streamed(chunks)
    assert finish == "stop" and content == ""
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == arguments


def test_named_function_without_parameters_gets_empty_arguments(client):
    answer = client.chat.completions.create(
        model="tiny-bytes",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=20,
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_templates_tool_call_blocks(client, stream):
    """The output is forced (structured_outputs.regex) to text and a Hermes block, as a
    model trained on the template writes it; auto reads the block back as a call."""
    pattern = "Checking\\. " + FORCED_CALL.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(
        model="tiny-bytes:sj",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    if stream:
        content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
        names = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        names = [(c.function.name, check_call(c)) for c in choice.message.tool_calls]
    assert content == "Checking. "
    assert names == [("get_weather", {"city": "Rome", "days": 2})]
    assert finish == "tool_calls"


def test_tool_choice_none_reads_no_calls(client):
    pattern = FORCED_CALL.replace("{", "\\{").replace("}", "\\}")
    choice = client.chat.completions.create(
        model="tiny-bytes",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": pattern}},
    ).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == FORCED_CALL and choice.finish_reason == "stop"


def test_auto_on_a_template_without_a_tool_format_answers_text(client):
    """`tiny`'s template knows no tools: they reach the model in a system message, and
    its answer is content."""
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4
    )
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens


def test_a_conversation_with_calls_and_results_continues(client):
    first = (
        client.chat.completions.create(
            model="tiny-bytes:sj",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model="tiny-bytes:sj", messages=messages, tools=TOOLS, max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD_TOOLS = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "bogus"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    (
        {
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
]


@pytest.mark.parametrize(("fields", "named"), BAD_TOOLS)
def test_bad_tools_values_are_400s_naming_the_field(post, fields, named):
    body = {"model": "tiny-bytes", "messages": MESSAGES, "max_tokens": 4, **fields}
    status, answer = post("/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert named in answer["error"]["message"]


# ---- the parsers alone (deployments/tool_calls.py) -------------------------------------
def parse_in_pieces(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple], list]:
    """Feeds `text` cut at `cuts`; (content, chunks as tuples, final calls)."""
    content, chunks, start = "", [], 0
    for cut in [*cuts, len(text)]:
        released, parts = parser.feed(text[start:cut])
        content += released
        chunks += parts
        start = cut
    released, parts = parser.finish()
    content += released
    chunks += parts
    return content, [(c.index, c.name, c.arguments) for c in chunks], parser.calls


HERMES_TEXT = (
    'I will look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool'
)


@pytest.mark.parametrize("seed", range(20))
def test_hermes_parser_gives_the_same_calls_however_the_text_is_cut(seed):
    import random

    from loraplex.deployments.tool_calls import HermesParser

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(HERMES_TEXT)), rng.randint(0, 30)))
    content, chunks, calls = parse_in_pieces(HermesParser(), HERMES_TEXT, cuts)
    assert content == "I will look. \n done <tool"
    assert chunks == [(0, "get_weather", '{"city": "Rome"}'), (1, "get_time", "{}")]
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_hermes_blocks_that_are_not_calls_stay_content():
    from loraplex.deployments.tool_calls import HermesParser

    text = '<tool_call>{"name": 3}</tool_call> and <tool_call>{"name": "f", "arguments": {"a"'
    content, chunks, calls = parse_in_pieces(HermesParser(), text, [5, 40])
    assert content == text and chunks == [] and calls == []
    unterminated = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    content, chunks, _ = parse_in_pieces(HermesParser(), unterminated, [3])
    assert content == "" and chunks == [(0, "f", '{"a": 1}')]


def test_call_array_parser_releases_whole_calls_or_the_text():
    from loraplex.deployments.tool_calls import CallArrayParser

    text = '[{"name": "get_time", "arguments": {}}, {"name": "f", "arguments": {"x": [1]}}]'
    content, chunks, _ = parse_in_pieces(CallArrayParser(), text, [10, 30])
    assert content == "" and chunks == [(0, "get_time", "{}"), (1, "f", '{"x": [1]}')]
    truncated = text[:40]
    assert parse_in_pieces(CallArrayParser(), truncated, [7])[:2] == (truncated, [])


def test_named_parser_streams_arguments_under_one_id():
    from loraplex.deployments.tool_calls import NamedCallParser

    parser = NamedCallParser("f")
    first = parser.feed('{"a"')[1]
    rest = parser.feed(": 1}")[1]
    assert first[0].id and first[0].name == "f" and first[0].arguments == '{"a"'
    assert rest[0].id is None and rest[0].arguments == ": 1}"
    assert parser.finish() == ("", []) and parser.calls[0].arguments == '{"a": 1}'


def test_required_schema_accepts_exactly_the_calls_the_tools_allow():
    from loraplex.deployments.tool_calls import ToolCalling

    calling = ToolCalling(tools=tuple(TOOLS), choice="required", parallel=False)
    schema = json.loads(calling.guided_spec().value)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    good = {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}
    jsonschema.validate([good], schema)
    for bad in (
        [],
        [good, good],
        [{"name": "get_time", "arguments": {"x": 1}}],
        [{"name": "nope", "arguments": {}}],
        [{**good, "arguments": {"city": "Oslo"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
