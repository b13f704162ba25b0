"""Loads a model folder's tokenizer (local files only) and its end-of-sequence ids, and
turns chat messages (and the tools a chat offers) into prompt ids through its chat
template.

The tokenizer is the folder's tokenizer.json as saved when the folder declares the
generic class, else the class AutoTokenizer picks; one that encodes text to no tokens
fails the load, so a model never starts with every text prompt empty.

Tools reach the model through the template when it renders them (it reads `tools`, as
Qwen2.5's, Llama 3.1's and Hermes' do). A template that does not (SmolLM2's) gets them
as a system message listing each function's JSON definition, and past assistant tool
calls, which such a template would drop, as `<tool_call>` text in their message."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""The `tokenizer_class` values (tokenizer_config.json) saying that tokenizer.json is the
whole tokenizer, whatever the model."""
PROBE_TOKENS = 8
"""How many vocabulary tokens, spread over the vocabulary, spell the load's probe text."""


def load_tokenizer(folder: str | Path):
    """The folder's HF tokenizer; never reaches a model hub. ValueError naming the
    folder and the class when that tokenizer encodes text to no tokens."""
    folder = Path(folder)
    tokenizer = _load_declared_class(folder)
    _check_encodes_text(folder, tokenizer)
    return tokenizer


def text_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` with `clean_up_tokenization_spaces=False`: the
    Rust backend's decode, called directly, where the tokenizer is a fast one whose
    class keeps the library's own decode (which, with that setting, only converts its
    arguments and calls the backend: about half of a detokenization step's cost);
    else the tokenizer's decode."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    ):
        return lambda ids, skip_special: backend.decode(ids, skip_special_tokens=skip_special)
    return lambda ids, skip_special: tokenizer.decode(
        ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
    )


def _declared_class(folder: Path) -> str | None:
    """tokenizer_config.json's `tokenizer_class`; None when it has none or is unreadable."""
    path = folder / "tokenizer_config.json"
    try:
        declared = json.loads(path.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return declared if isinstance(declared, str) else None


def _load_declared_class(folder: Path):
    """A folder declaring the generic class over a tokenizer.json gets that file as
    saved. transformers 5 honours that declaration for most model types, but for those
    it distrusts the saved class of (qwen2 among them) builds the model type's own
    class, which keeps only the file's vocabulary and merges under its own
    pre-tokenizer: another kind of tokenizer saved there (word-level, say) then
    encodes every text to nothing. Any other folder gets AutoTokenizer's choice."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    generic = _declared_class(folder) in GENERIC_TOKENIZER_CLASSES
    if generic and (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _probe_text(tokenizer) -> str:
    """The text of PROBE_TOKENS tokens spread over the vocabulary, added and special
    tokens left out (they match whole, before the tokenizer's model is consulted; a
    tokenizer without `get_added_vocab`, mistral-common's, has none apart)."""
    added = set(getattr(tokenizer, "get_added_vocab", dict)().values())
    size = len(tokenizer)
    spread = range(0, size, max(1, size // PROBE_TOKENS))
    return tokenizer.decode([i for i in spread if i not in added][:PROBE_TOKENS])


def _check_encodes_text(folder: Path, tokenizer) -> None:
    """ValueError when text spelled by the tokenizer's own vocabulary encodes to no
    tokens: every text prompt would be empty (a class that does not fit the folder's
    tokenizer.json). A probe text that is blank decides nothing."""
    text = _probe_text(tokenizer)
    if text.strip() and not tokenizer.encode(text, add_special_tokens=False):
        raise ValueError(
            f"the tokenizer of {folder} ({type(tokenizer).__name__}) encodes text to no "
            f"tokens ({text!r} gives none): its tokenizer_config.json's tokenizer_class "
            "does not fit its tokenizer files"
        )


def _as_ids(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(folder: str | Path, tokenizer) -> frozenset[int]:
    """Union of generation_config.json's `eos_token_id` (an int or a list) and the
    tokenizer's `eos_token_id`; empty when neither defines one."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    path = Path(folder) / "generation_config.json"
    if path.is_file():
        try:
            ids |= _as_ids(json.loads(path.read_text()).get("eos_token_id"))
        except ValueError:
            logger.warning("ignoring unreadable %s", path)
    return frozenset(ids)


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _input_errors() -> tuple[type[Exception], ...]:
    """What a tokenizer or a chat template raises on text it cannot take (a lone
    surrogate, a role or message layout the template refuses): the input's fault."""
    from jinja2 import TemplateError

    return (TypeError, ValueError, UnicodeError, TemplateError)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`; ValueError when the tokenizer cannot take it."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except _input_errors() as exc:
        raise ValueError(f"the prompt cannot be tokenized: {exc}") from None


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def tool_call_format(tokenizer) -> str | None:
    """The tool-call format the chat template teaches: 'hermes' (`<tool_call>` JSON
    blocks) or None (no format this server reads)."""
    return "hermes" if "<tool_call>" in _template_text(tokenizer) else None


TOOLS_PREAMBLE = (
    "You may call these functions. To call one, answer with "
    '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.\n'
)


def _with_tools_described(
    messages: list[dict], tools: Sequence[Mapping[str, object]]
) -> list[dict]:
    """`messages` with the tools listed in a system message (merged into a leading one)."""
    listing = TOOLS_PREAMBLE + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    if messages and messages[0].get("role") == "system":
        head = dict(messages[0])
        head["content"] = f"{head.get('content') or ''}\n\n{listing}".lstrip()
        return [head, *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]


def _tool_calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        "<tool_call>"
        + json.dumps(
            {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
            ensure_ascii=False,
        )
        + "</tool_call>"
        for call in calls
    ]
    text = "\n".join([message.get("content") or "", *blocks]).lstrip("\n")
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def apply_chat_template(
    tokenizer,
    messages: Sequence[Mapping[str, object]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> list[int]:
    """The prompt ids of chat `messages` (role / content dicts, tool calls as chat
    templates read them) and the `tools` offered (OpenAI function definitions) through
    the tokenizer's chat template, with the assistant's turn opened unless
    `add_generation_prompt` is False. ValueError when the tokenizer has no chat template
    or the template or tokenizer cannot take the messages."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template")
    template = _template_text(tokenizer)
    conversation = [dict(message) for message in messages]
    rendered_tools = None
    if tools and "tools" in template:
        rendered_tools = [dict(tool) for tool in tools]
    elif tools:
        conversation = _with_tools_described(conversation, tools)
    if "tool_calls" not in template:
        conversation = [_tool_calls_as_text(message) for message in conversation]
    try:
        encoded = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            tools=rendered_tools,
        )
    except _input_errors() as exc:
        raise ValueError(f"the messages cannot be put through the chat template: {exc}") from None
    return list(encoded["input_ids"])
