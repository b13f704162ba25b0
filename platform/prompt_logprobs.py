"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

Semantics: the logits the model computes at position p of a sequence score token p + 1.
A request with `prompt_logprobs=k` has `booked = len(request.prompt_logprobs)` prompt
tokens scored so far (tokens 1..booked); a chunk of it computing positions
[start, start + n) scores the positions p in [max(start, booked), min(start + n,
num_prompt - 1)): every prompt token after the first exactly once, across chunks and
whatever a preemption recomputes. The last prompt position scores the first generated
token, which sampling handles.

Per scored row: the raw log-softmax of the logits (vLLM's default, as for sampled
tokens), the target token's logprob, its rank (1 + how many tokens score higher) and
the top k. The step's rows are scored in slices of `LOGITS_ROWS_PER_SLICE`, so a long
prompt never holds its full [P, vocab] logits at once; every tensor-parallel rank runs
the same slices (the logits gather is a collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.platform.request import Logprob, Request

LOGITS_ROWS_PER_SLICE = 256
"""Prompt rows whose logits exist at once: 256 x a 50k vocabulary is 50 MB of fp32."""


@dataclass(frozen=True)
class PromptRows:
    """Which of a step's tokens score which prompt tokens (rank 0 builds it; every
    rank runs it)."""

    rows: torch.Tensor
    """[P] int64 index into the step's tokens of each scored position."""
    targets: torch.Tensor
    """[P] int64 the prompt token each row scores (the one after its position)."""
    top_k: int
    """Alternatives to keep per row: the most any of the step's requests asked for."""

    @property
    def empty(self) -> bool:
        return not self.rows.numel()


@dataclass(frozen=True)
class PromptScores:
    """Scores of P rows: logprob [P], rank [P] int64, top_values [P, K], top_ids [P, K]
    (K = max(top_k, 1)), finite [P] bool (False: the row's logits had a NaN or +Inf,
    or no finite value)."""

    logprob: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    finite: torch.Tensor


def positions_to_score(request: Request, start: int, num_tokens: int) -> range:
    """The positions of a chunk [start, start + num_tokens) whose logits score one of the
    request's prompt tokens not scored yet (empty unless it still needs them)."""
    if not request.needs_prompt_logprobs:
        return range(0)
    first = max(start, len(request.prompt_logprobs))
    return range(first, max(first, min(start + num_tokens, request.num_prompt_tokens - 1)))


def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    rows: PromptRows,
) -> PromptScores:
    """Scores `rows` of the step's tokens slice by slice; `compute_logits` maps an index
    [S] into the step's tokens to their float32 logits [S, vocab]."""
    parts = []
    width = max(rows.top_k, 1)
    for begin in range(0, rows.rows.numel(), LOGITS_ROWS_PER_SLICE):
        index = rows.rows[begin : begin + LOGITS_ROWS_PER_SLICE]
        targets = rows.targets[begin : begin + LOGITS_ROWS_PER_SLICE]
        logits = compute_logits(index).float()
        finite = torch.isfinite(logits.amax(dim=-1))
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        rank = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
        top_values, top_ids = logprobs.topk(width, dim=-1)
        parts.append((chosen, rank, top_values, top_ids, finite))
    return PromptScores(*(torch.cat(column) for column in zip(*parts, strict=True)))


def book_scores(
    scores: PromptScores, owners: list[tuple[Request, range]]
) -> tuple[dict[str, list[Logprob]], list[Request]]:
    """Splits the step's scores among their `owners` ((request, the positions it
    scored), in row order): each request's new prompt Logprobs, and the requests with
    a row whose logits were not finite (they get none)."""
    logprob = scores.logprob.tolist()
    rank = scores.rank.tolist()
    top_values = scores.top_values.tolist()
    top_ids = scores.top_ids.tolist()
    finite = scores.finite.tolist()
    booked: dict[str, list[Logprob]] = {}
    broken: list[Request] = []
    row = 0
    for request, positions in owners:
        rows = range(row, row + len(positions))
        row += len(positions)
        if not all(finite[r] for r in rows):
            broken.append(request)
            continue
        k = request.sampling_params.prompt_logprobs or 0
        prompt = request.prompt_token_ids
        booked[request.request_id] = [
            Logprob(
                prompt[p + 1],
                logprob[r],
                dict(zip(top_ids[r][:k], top_values[r][:k], strict=True)),
                rank[r],
            )
            for p, r in zip(positions, rows, strict=True)
        ]
    return booked, broken
