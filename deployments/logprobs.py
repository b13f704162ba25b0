"""Logprobs as clients read them: token texts, and the OpenAI / vLLM response shapes.

The engine reports logprobs by token id (`platform/request.py Logprob`). The model
server turns them into `TokenLogprob`s, which carry each token's text (decoded alone,
special tokens kept; cached per replica), and the ingress writes them as:

- completions `logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}; with
  `echo`, the prompt's tokens lead, the first with null logprob and alternatives;
- chat `logprobs`: {content: [{token, logprob, bytes, top_logprobs: [...]}]};
- vLLM's `prompt_logprobs`: one entry per prompt token, null for the first, else
  {token id: {logprob, rank, decoded_token}} for the prompt token and its top k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.platform.request import Logprob

TOKEN_TEXT_CACHE = 1 << 16
"""Token texts a replica keeps decoded (ids beyond are decoded again when asked)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob with the texts a response shows."""

    token_id: int
    token: str
    logprob: float | None
    """None only for a prompt's first token, which nothing precedes to score it."""
    top: tuple[tuple[int, str, float], ...]
    """(token id, text, logprob) of the alternatives, best first."""
    rank: int | None = None
    """Prompt tokens: 1 + how many tokens the model found more likely."""


class TokenTexts:
    """Token id -> its text, decoded alone by `detokenize` (special tokens kept)."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str]) -> None:
        self.text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)(
            lambda token_id: detokenize([token_id])
        )

    def entry(self, logprob: Logprob) -> TokenLogprob:
        top = tuple((t, self.text(t), value) for t, value in logprob.top.items())
        return TokenLogprob(
            logprob.token_id, self.text(logprob.token_id), logprob.logprob, top, logprob.rank
        )

    def entries(self, logprobs: Sequence[Logprob]) -> list[TokenLogprob]:
        return [self.entry(lp) for lp in logprobs]

    def prompt_entries(
        self, prompt: Sequence[int], logprobs: Sequence[Logprob | None]
    ) -> list[TokenLogprob]:
        """The prompt's tokens with their logprobs (the engine's `prompt_logprobs`,
        None first): the first token unscored."""
        first = TokenLogprob(prompt[0], self.text(prompt[0]), None, ())
        return [first, *(self.entry(lp) for lp in logprobs[1:])]


def completion_logprobs(entries: Sequence[TokenLogprob], offsets: Sequence[int]) -> dict[str, Any]:
    """The completions shape (an unscored prompt token has null logprob and
    alternatives); `offsets`: where each entry's text starts in the choice's text."""
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            None if entry.logprob is None else {text: v for _, text, v in entry.top}
            for entry in entries
        ],
        "text_offset": list(offsets),
    }


def text_offsets(entries: Sequence[TokenLogprob], first: int) -> list[int]:
    """Where each entry's text starts when the first starts at `first` and each follows
    the one before."""
    offsets = []
    for entry in entries:
        offsets.append(first)
        first += len(entry.token)
    return offsets


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": _bytes(entry.token),
                "top_logprobs": [
                    {"token": text, "logprob": value, "bytes": _bytes(text)}
                    for _, text, value in entry.top
                ],
            }
            for entry in entries
        ]
    }


def prompt_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: the prompt token and its top k per position, by id."""
    shaped: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry.logprob is None:
            shaped.append(None)
            continue
        ranked = {
            str(token_id): {"logprob": value, "rank": rank, "decoded_token": text}
            for rank, (token_id, text, value) in enumerate(entry.top, start=1)
        }
        ranked.setdefault(
            str(entry.token_id),
            {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token},
        )
        shaped.append(ranked)
    return shaped


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
