"""Loads a model folder's tokenizer (local files only) and its end-of-sequence ids."""

from __future__ import annotations

import json
import logging
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
