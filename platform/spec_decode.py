"""Speculative decoding by n-gram prompt lookup: which requests speculate, the drafts
they get, how the target model's tokens verify them, and the acceptance counters.

A speculating decode of request r with drafts x1..xd runs as one chunk of 1 + d query
tokens against r's paged KV cache (its newest token, then the drafts), like a chunked
prefill chunk, and samples at each of the 1 + d positions:

    query tokens   [ t   x1  x2  x3 ]          t: the newest (already verified) token
    target argmax  [ y0  y1  y2  y3 ]          yi: the greedy token after position i
    accepted       x1 == y0, x2 == y1, x3 != y2  -> a = 2
    new tokens     [ y0  y1  y2 ]               a accepted drafts, then one bonus token

Every new token is the target's own greedy choice given verified tokens only, so the
output is the non-speculative one token for token; K/V written for rejected drafts
(positions past the verified length) is overwritten by later steps, and the blocks
holding only such positions go back to the pool (`KVCacheManager.trim`).

Who speculates (`speculates`): greedy requests (temperature 0), n == 1, without
presence / frequency / repetition penalties (they depend on the tokens before each
draft position), without a guided grammar (its matcher would have to take drafts and
roll back), and only once `min_tokens` tokens were generated (before that, EOS and
stop_token_ids are masked per output length). logit_bias (the same at every position),
logprobs (each position's own row), stop strings, stop_token_ids and EOS (the engine
cuts the new tokens at the first that stops) are kept. Every other request in the same
step decodes as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.platform.config import SpeculativeConfig
from loraplex.platform.request import Request


def speculates(request: Request) -> bool:
    """Whether drafts can be verified for `request` with outputs kept identical (see
    the module docstring for why each kind of request is left out)."""
    params = request.sampling_params
    return (
        params.greedy
        and params.n == 1
        and not params.uses_penalties
        and request.grammar is None
        and request.num_output_tokens >= params.min_tokens
    )


@dataclass
class NgramIndex:
    """Where each n-gram of one request's tokens last ended, for prompt lookup.

    `last_end[g]` is the index of the last token of the latest occurrence of n-gram g
    (a tuple of min..max token ids) among the tokens indexed so far. Tokens are
    indexed up to, not including, the newest one, so the lookup of the request's own
    suffix finds an earlier occurrence, never itself. Tokens only ever get appended
    (preemption keeps them), so the index grows by the new tokens each step.
    """

    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    """Tokens whose n-grams ending there are indexed."""
    missed: bool = False
    """The request's last verification accepted none of its drafts."""

    def extend(self, tokens: Sequence[int], upto: int, sizes: range) -> None:
        """Indexes the n-grams (of each size in `sizes`) ending at positions
        `indexed` .. upto - 1."""
        last_end = self.last_end
        for end in range(self.indexed, upto):
            for size in sizes:
                start = end - size + 1
                if start >= 0:
                    last_end[tuple(tokens[start : end + 1])] = end
        self.indexed = max(self.indexed, upto)


class NgramProposer:
    """Prompt lookup: the longest suffix of a request's tokens, from `prompt_lookup_max`
    down to `prompt_lookup_min` tokens, that occurred earlier in its prompt + output
    proposes the (up to `num_speculative_tokens`) tokens that followed its latest
    earlier occurrence. Cost per call: the new tokens' n-grams go into the request's
    index, then at most one dict lookup per size (about 3 us on the dev VM).

    After a verification that accepted none of a request's drafts, its next proposal
    holds one draft only (a probe); any accepted draft restores the full length. A
    step's cost grows with its query tokens (on the 2-core dev VM, fp32: +5% for one
    draft, +22% for four), so text whose n-grams match but whose continuations do not
    pays about the one-draft cost instead of the full one."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer runs method 'ngram', not {config.method!r}")
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self._sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._indexes: dict[str, NgramIndex] = {}

    def max_drafts(self, request: Request) -> int:
        """How many drafts the request can use this step: k, less where max_tokens or
        max_model_len leave room for fewer new tokens (a step adds up to drafts + 1)."""
        params = request.sampling_params
        room = min(
            params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        return max(0, min(self.num_speculative_tokens, room - 1))

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` (and `max_drafts`) draft tokens to follow `request`'s tokens,
        or [] when it does not speculate or no n-gram matches."""
        limit = min(limit, self.max_drafts(request))
        if limit <= 0 or not speculates(request):
            return []
        return self.lookup(request.request_id, request.all_token_ids, limit)

    def lookup(self, key: str, tokens: Sequence[int], limit: int) -> list[int]:
        """The drafts for the token sequence `tokens` (indexed under `key` across calls;
        `tokens` must only grow between calls with one key)."""
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = NgramIndex()
        if index.missed:
            limit = 1
        length = len(tokens)
        index.extend(tokens, length - 1, self._sizes)
        last_end = index.last_end
        for size in self._sizes:
            if size >= length:
                continue
            end = last_end.get(tuple(tokens[length - size :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + limit])
        return []

    def observe(self, key: str, num_accepted_tokens: int) -> None:
        """Books how many of the request's drafts its last verification accepted."""
        index = self._indexes.get(key)
        if index is not None:
            index.missed = num_accepted_tokens == 0

    def forget(self, key: str) -> None:
        """Drops a finished request's index."""
        self._indexes.pop(key, None)

    @property
    def num_indexed(self) -> int:
        """Requests holding an index (tests: none once every request finished)."""
        return len(self._indexes)


def num_accepted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """Greedy verification of one request's drafts.

    Semantics: draft_token_ids x[d], target_token_ids y[d + 1] (y[i]: the target's
    greedy token after query position i, position 0 being the newest verified token)
    -> a = the largest a <= d with x[i] == y[i] for every i < a. The request's new
    tokens are then y[0 .. a] (a accepted drafts and one bonus token).
    """
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"{len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} target tokens, "
            f"got {len(target_token_ids)}"
        )
    accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted


@dataclass
class SpecDecodeStats:
    """Cumulative acceptance counters (vLLM's spec_decode metrics): verification steps
    with drafts, draft tokens, accepted drafts, and accepted drafts per draft position
    (position i counts verifications that accepted at least i + 1 drafts)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_stats(self) -> dict[str, float]:
        """The counters under the engine's `stats()` keys."""
        stats = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for position, count in enumerate(self.accepted_per_pos):
            stats[f"{ACCEPTED_PER_POS_KEY}{position}"] = count
        return stats


ACCEPTED_PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos_"
"""`stats()` key prefix of the accepted count at draft position i (the key ends in i)."""
