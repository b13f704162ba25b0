"""Loads a model folder's tokenizer (local files only) and its end-of-sequence ids, and
turns chat messages into prompt ids through its chat template."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def load_tokenizer(folder: str | Path):
    """The folder's HF tokenizer; never reaches a model hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(folder), local_files_only=True)


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


def apply_chat_template(
    tokenizer, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True
) -> list[int]:
    """The prompt ids of chat `messages` (role / content dicts, tool calls as chat
    templates read them) through the tokenizer's chat template, with the assistant's
    turn opened unless `add_generation_prompt` is False. ValueError when the tokenizer
    has no chat template or the template or tokenizer cannot take the messages."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template")
    try:
        encoded = tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
        )
    except _input_errors() as exc:
        raise ValueError(f"the messages cannot be put through the chat template: {exc}") from None
    return list(encoded["input_ids"])
