"""The client libraries applications use, unchanged, against the real app on a
`base:adapter` model (`tiny-bytes:sj`: a byte-level tokenizer that can spell JSON, a
Hermes-style chat template): LangChain's ChatOpenAI (invoke, stream, batch,
with_structured_output by JSON schema and by function calling), instructor with a
pydantic response model (tool and JSON-schema modes), the OpenAI Agents SDK running
one function tool, the `openai` SDK with list-of-parts content, and LangChain's
OpenAIEmbeddings."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

MODEL = "tiny-bytes:sj"
QUESTION = "What is the weather in Rome?"


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    celsius: int = Field(ge=-30, le=45)
    sunny: bool


@pytest.fixture(scope="module")
def chat_model(serve_url, tenant_keys):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=f"{serve_url}/v1",
        api_key=tenant_keys["acme"],
        temperature=0,
        max_tokens=64,
        max_retries=0,
        timeout=120,
    )


def test_langchain_invoke_stream_and_batch_agree(chat_model):
    from langchain_core.messages import AIMessage

    answer = chat_model.invoke(QUESTION)
    assert isinstance(answer, AIMessage) and answer.content
    assert answer.usage_metadata["output_tokens"] > 0
    chunks = list(chat_model.stream(QUESTION))
    assert len(chunks) > 1
    assert "".join(chunk.content for chunk in chunks) == answer.content
    batch = chat_model.batch([QUESTION, "Hello", QUESTION])
    assert [message.content for message in batch][0::2] == [answer.content] * 2


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(chat_model, method):
    if method == "json_mode":
        # Any JSON object: the model is told the schema only in words, so its object
        # need not follow it; that it parses is what json_mode promises.
        answer = chat_model.with_structured_output(method=method).invoke(QUESTION)
        assert isinstance(answer, dict)
        return
    weather = chat_model.with_structured_output(Weather, method=method).invoke(QUESTION)
    assert isinstance(weather, Weather)


def test_instructor_tool_and_json_schema_modes(serve_url, tenant_keys):
    import instructor
    import openai

    raw = openai.OpenAI(base_url=f"{serve_url}/v1", api_key=tenant_keys["acme"], max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(raw, mode=mode)
        weather = client.chat.completions.create(
            model=MODEL,
            response_model=Weather,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=64,
            max_retries=0,
        )
        assert isinstance(weather, Weather), mode


def test_openai_agents_sdk_runs_a_function_tool(serve_url, tenant_keys):
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(
        base_url=f"{serve_url}/v1", api_key=tenant_keys["acme"], max_retries=0
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=96, temperature=0),
    )
    result = Runner.run_sync(agent, QUESTION, max_turns=3)
    assert calls and set(calls) <= {"Paris", "Rome"}, "the tool ran with valid arguments"
    assert isinstance(result.final_output, str)
    tool_outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert tool_outputs and tool_outputs[0].output == f"sunny in {calls[0]}"


def test_openai_sdk_list_of_parts_equals_the_joined_text(client):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the weather?"}]
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0
    )
    as_text = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is\nthe weather?"}],
        max_tokens=12,
        temperature=0,
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_langchain_embeddings_equal_the_openai_sdks(serve_url, tenant_keys, client):
    """LangChain's OpenAIEmbeddings sending text (`check_embedding_ctx_length=False`:
    its default sends tiktoken's token ids, which are another vocabulary's)."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{serve_url}/v1",
        api_key=tenant_keys["acme"],
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    texts = [QUESTION, "Rome is sunny."]
    documents = embeddings.embed_documents(texts)
    query = embeddings.embed_query(QUESTION)
    direct = client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data
    assert len(documents) == len(direct) == 2
    for document, item in zip(documents, direct, strict=True):
        assert document == pytest.approx(item.embedding, abs=1e-6)
    assert query == pytest.approx(direct[0].embedding, abs=1e-6)
