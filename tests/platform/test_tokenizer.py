"""The tokenizer a model folder loads (one that encodes its tokenizer.json's text, or a
failed load) and the chat-template helper every prompt-from-messages path uses (CLI,
LLM.chat, the served chat endpoint through AsyncEngine.prompt_ids)."""

import copy
import json
import re
import shutil

import pytest

from loraplex.platform.llm import LLM
from loraplex.platform.tokenizer import (
    apply_chat_template,
    encode_text,
    has_chat_template,
    load_tokenizer,
    tool_call_format,
)

MESSAGES = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]


def test_messages_render_through_the_template_with_the_turn_opened(tiny_model_factory):
    tokenizer = load_tokenizer(tiny_model_factory("llama"))
    assert has_chat_template(tokenizer)
    # The tiny template joins the contents and opens the turn with 'w1'.
    assert apply_chat_template(tokenizer, MESSAGES) == tokenizer.encode("w5 w6 w7 w1")


def test_a_tokenizer_without_a_template_is_a_clear_value_error(tiny_model_factory):
    tokenizer = copy.deepcopy(load_tokenizer(tiny_model_factory("llama")))
    tokenizer.chat_template = None
    assert not has_chat_template(tokenizer)
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        apply_chat_template(tokenizer, MESSAGES)


def test_every_caller_builds_the_same_prompt(tiny_model_factory):
    from loraplex.platform.async_engine import AsyncEngine

    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64, dtype="float32")
    expected = apply_chat_template(llm.tokenizer, MESSAGES)
    assert llm.chat_prompt_ids(MESSAGES) == expected
    engine = AsyncEngine(llm.engine)
    try:
        assert engine.prompt_ids(None, MESSAGES) == expected
    finally:
        engine.shutdown()


def test_text_the_tokenizer_cannot_take_is_a_value_error(tiny_model_factory):
    """A lone UTF-16 surrogate (valid in JSON as "\\ud800") makes the fast tokenizer
    raise TypeError; callers must see the input's fault (ValueError -> 400), not a
    crash of the model replica."""
    tokenizer = load_tokenizer(tiny_model_factory("llama"))
    with pytest.raises(TypeError):
        tokenizer.encode("w1 \ud800")
    with pytest.raises(ValueError, match="cannot be tokenized"):
        encode_text(tokenizer, "w1 \ud800")
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "\ud800"}])
    assert encode_text(tokenizer, "w5 w6") == tokenizer.encode("w5 w6")


TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_time", "arguments": {"zone": "UTC"}},
}


def test_a_template_that_renders_tools_gets_them(tiny_model_factory):
    tokenizer = load_tokenizer(tiny_model_factory("llama", tokenizer="bytes"))
    assert tool_call_format(tokenizer) == "hermes"
    text = tokenizer.decode(
        apply_chat_template(
            tokenizer,
            [
                {"role": "user", "content": "time?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "noon", "tool_call_id": "call_1"},
            ],
            tools=[TOOL],
        )
    )
    assert text.startswith('{"type": "function", "function": {"name": "get_time"')
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in text
    assert text.endswith("noon\n")


def test_a_template_without_tools_gets_them_in_a_system_message(tiny_model_factory):
    """SmolLM2's kind of template: tools listed in a system message (merged into the
    first one), past calls as `<tool_call>` text; no tool-call format to read back."""
    tokenizer = copy.deepcopy(load_tokenizer(tiny_model_factory("llama", tokenizer="bytes")))
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert tool_call_format(tokenizer) is None
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
    ]
    text = tokenizer.decode(apply_chat_template(tokenizer, messages, tools=[TOOL]))
    system, user, assistant = text.splitlines()[0], *text.splitlines()[-2:]
    assert system == "system: Be brief."
    assert '"name": "get_time"' in text and "You may call these functions" in text
    assert user == "user: time?"
    assert assistant == (
        'assistant: <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    without_tools = tokenizer.decode(apply_chat_template(tokenizer, messages[1:2]))
    assert without_tools == "user: time?\n"


def test_a_tokenizer_saved_for_another_model_type_encodes_as_its_tokenizer_json(
    tiny_model_factory,
):
    """The qwen2 tiny model saves the word-level tokenizer under the generic class
    (tokenizer_config.json: TokenizersBackend). transformers 5 swaps in Qwen2Tokenizer
    for every qwen2 folder, which keeps only the vocabulary and encodes 'w3 w4' to
    nothing; the folder's tokenizer.json is what must encode."""
    from tokenizers import Tokenizer

    folder = tiny_model_factory("qwen2")
    backend_ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("w3 w4").ids
    assert backend_ids == [3, 4]
    tokenizer = load_tokenizer(folder)
    assert encode_text(tokenizer, "w3 w4", add_special_tokens=False) == backend_ids
    assert apply_chat_template(tokenizer, MESSAGES) == [5, 6, 7, 1]


def test_a_tokenizer_that_encodes_text_to_nothing_fails_the_model_start(
    tiny_model_factory, tmp_path
):
    """A folder declaring a model-specific class its tokenizer.json does not fit
    (Qwen2Tokenizer over a word-level vocabulary) gets a tokenizer that turns every
    text into no tokens: the load fails, naming the folder and the class, rather than
    every text prompt failing later as empty."""
    folder = tmp_path / "mismatched"
    shutil.copytree(tiny_model_factory("qwen2"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"tokenizer_class": "Qwen2Tokenizer"}))
    expected = f"{re.escape(str(folder))}.*Qwen2Tokenizer.*encodes text to no tokens"
    with pytest.raises(ValueError, match=expected):
        load_tokenizer(folder)
    with pytest.raises(ValueError, match=expected):
        LLM(str(folder), max_model_len=64, dtype="float32")
