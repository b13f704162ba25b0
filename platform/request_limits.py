"""A request's limits, decided here alone: its `max_tokens` against the model's context,
its worst case against the KV cache and the tenant's token budget, and that worst case.

    fit_request(num_prompt_tokens, params, limits, fit, token_budget) -> FittedRequest
    fit_embedding(num_prompt_tokens, limits, token_budget) -> FittedRequest

- The prompt must leave room for one generated token (`max_model_len`).
- `max_tokens` past the room the context leaves: `fit="requested"` (the caller chose
  it) refuses; `"default"` (a server's default) shortens it to that room;
  `"up_to_context"` (the offline engine) keeps it, and generation stops at the
  context's end.
- The KV cache must hold the request's worst case at once: the prompt's full blocks
  shared by its n completions, then each completion's blocks up to its full length.
- The worst case, prompt + n x max_tokens, must not exceed the tenant's token budget
  (a request that could never pass it).

An embedding request (`fit_embedding`) generates nothing: its input may fill the whole
context, its blocks must fit the cache, and its worst case is its input.

Each refusal is a ValueError whose message says what to lower. The ingress keeps only
its own estimate (it cannot count a text prompt's tokens); a model server fits each
request here, and the engine checks it here again when it builds the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from loraplex.platform.request import SamplingParams

MaxTokensFit = Literal["requested", "default", "up_to_context"]


@dataclass(frozen=True)
class EngineLimits:
    """What one engine can hold."""

    max_model_len: int
    num_blocks: int
    """KV cache blocks."""
    block_size: int


@dataclass(frozen=True)
class FittedRequest:
    params: SamplingParams
    """The request's params, `max_tokens` fitted."""
    worst_case_tokens: int
    """prompt + n x max_tokens: what a tenant's budget keeps reserved until it ends."""


def fit_request(
    num_prompt_tokens: int,
    params: SamplingParams,
    limits: EngineLimits,
    fit: MaxTokensFit = "up_to_context",
    token_budget: int | None = None,
) -> FittedRequest:
    """The request's fitted params and worst case, or ValueError (module docstring)."""
    limit = limits.max_model_len
    if num_prompt_tokens >= limit:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, but max_model_len is {limit} "
            "(prompt plus at least one generated token must fit)"
        )
    room = limit - num_prompt_tokens
    if params.max_tokens > room and fit == "requested":
        raise ValueError(
            f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens}"
            f" prompt tokens + max_tokens {params.max_tokens} were requested"
        )
    if params.max_tokens > room and fit == "default":
        params = dataclasses.replace(params, max_tokens=room)
    _check_kv_cache_holds(num_prompt_tokens, params, limits)
    worst = num_prompt_tokens + params.n * params.max_tokens
    if token_budget is not None and worst > token_budget:
        raise ValueError(
            f"this request may use up to {worst} tokens ({num_prompt_tokens} prompt + "
            f"{params.n} x max_tokens {params.max_tokens}), more than your "
            f"tokens_per_minute budget of {token_budget}; lower n or max_tokens"
        )
    return FittedRequest(params, worst)


def _check_kv_cache_holds(
    num_prompt_tokens: int, params: SamplingParams, limits: EngineLimits
) -> None:
    size = limits.block_size
    full_length = min(num_prompt_tokens + params.max_tokens, limits.max_model_len)
    shared_prompt_blocks = num_prompt_tokens // size
    per_child = -(-full_length // size) - shared_prompt_blocks
    needed = shared_prompt_blocks + params.n * per_child
    if needed > limits.num_blocks:
        raise ValueError(
            f"this request needs up to {needed} KV cache blocks ({params.n} completions of up "
            f"to {full_length} tokens, block size {size}), more than the "
            f"{limits.num_blocks} the cache holds; lower n or max_tokens"
        )


EMBEDDING_PARAMS = SamplingParams(max_tokens=1)
"""An embedding request's params: it samples nothing, they only satisfy the request."""


def fit_embedding(
    num_prompt_tokens: int, limits: EngineLimits, token_budget: int | None = None
) -> FittedRequest:
    """An embedding request's params and worst case (its input), or ValueError."""
    limit = limits.max_model_len
    if num_prompt_tokens > limit:
        raise ValueError(
            f"input has {num_prompt_tokens} tokens, but max_model_len is {limit}; "
            "send a shorter input"
        )
    needed = -(-num_prompt_tokens // limits.block_size)
    if needed > limits.num_blocks:
        raise ValueError(
            f"this input needs {needed} KV cache blocks, more than the {limits.num_blocks} "
            "the cache holds; send a shorter input"
        )
    if token_budget is not None and num_prompt_tokens > token_budget:
        raise ValueError(
            f"this input has {num_prompt_tokens} tokens, more than your tokens_per_minute "
            f"budget of {token_budget}; send a shorter input"
        )
    return FittedRequest(EMBEDDING_PARAMS, num_prompt_tokens)
