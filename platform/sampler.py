"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, seeded draws.

One step's R sampling rows arrive as `logits[R, V]` with one `Request` per row (a
forked n > 1 child gets its own row, holding a copy of its parent's logits). Per row:

    guided rows: tokens their grammar does not allow next -> -inf (platform/guided.py)
    logits += logit_bias           (per token id)
    logits[EOS, stop_token_ids] = -inf   while fewer than min_tokens were generated
    logits  = repetition penalty   (HF: over prompt + output ids; >0 divide, else multiply)
    logits -= frequency * count + presence * (count > 0)   (OpenAI: over output ids only)
    greedy rows:  token = argmax(logits)
    sampled rows: logits /= temperature; keep top-k, then the top-p nucleus; w = exp(logits
                  - max); drop w < min_p; token = first id with cumsum(w) > u * sum(w)

A row whose raw logits are not all finite-or-minus-infinity (a NaN, a +Inf, or no
finite value at all: a broken adapter or numerics) gets no token: it is listed in
`invalid_rows` with INVALID_TOKEN, so it can never yield an out-of-range id, and the
other rows are sampled as if it were not there.

Each drawing row takes a single uniform u, from its own `torch.Generator` when it has
one (a seeded request), else from the global RNG. The weights stay unnormalised and are
summed in vocabulary order, so a seeded row's token depends only on its logits and its
generator, never on the other rows of the batch. Logprobs follow vLLM's default:
log_softmax of the raw logits, before penalties, temperature and filtering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.kernels.backends import KernelBackend, get_backend
from loraplex.platform.guided import GuidedState, mask_disallowed_tokens
from loraplex.platform.request import Logprob, Request

MIN_TEMPERATURE = 1e-5
"""Smaller temperatures are raised to this, so logits / temperature stays finite."""
MIN_REPETITION_PENALTY = 1e-5
"""Smaller repetition penalties are raised to this, so logits / penalty stays finite (a
double such as 5e-324 passes `> 0` and is 0 in float32)."""
INVALID_TOKEN = -1
"""The token id reported for a row whose logits are not finite."""


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _pad(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """[R, L] int64 with -1 past each row's end (L >= 1 so scatters stay well-formed)."""
    width = max(1, max((len(row) for row in rows), default=0))
    padded = [row + [-1] * (width - len(row)) for row in rows]
    return _column(padded, torch.int64, device)


@dataclass
class SamplingBatch:
    """One step's sampling parameters as device tensors; built once per step.

    Penalty and logprob fields cover all R rows; temperature and the filters cover only
    the S non-greedy rows listed in `sampled_rows`. A field is None when no row needs
    it; with `fast_greedy` (every row greedy, no penalties, no logprobs) all are None
    and the sampler only takes an argmax.
    """

    num_rows: int
    fast_greedy: bool
    sampled_rows: list[int] = field(default_factory=list)
    """Rows that draw (temperature > 0), ascending; the others take the argmax."""
    sampled_index: torch.Tensor | None = None
    """[S] int64 `sampled_rows` on the device; None when every row draws."""
    generators: list[torch.Generator | None] = field(default_factory=list)
    """[S] each drawing row's own generator, or None for the global RNG."""
    temperature: torch.Tensor | None = None
    """[S] float32, at least MIN_TEMPERATURE."""
    top_k: torch.Tensor | None = None
    """[S] int64; 0 means off."""
    max_top_k: int = 0
    """The largest top-k when every drawing row has one, else 0."""
    top_p: torch.Tensor | None = None
    """[S] float32."""
    min_p: torch.Tensor | None = None
    """[S] float32."""
    repetition_penalty: torch.Tensor | None = None
    """[R] float32."""
    seen_token_ids: torch.Tensor | None = None
    """[R, L] int64, -1 padded: prompt + output ids of rows with a repetition penalty."""
    frequency_penalty: torch.Tensor | None = None
    """[R] float32."""
    presence_penalty: torch.Tensor | None = None
    """[R] float32."""
    output_token_ids: torch.Tensor | None = None
    """[R, L] int64, -1 padded: output ids of rows with presence/frequency penalties."""
    num_logprobs: list[int | None] = field(default_factory=list)
    """[R] how many top alternatives each row returns; None: no logprobs. Empty when no
    row asks for logprobs."""
    bias_ids: torch.Tensor | None = None
    """[R, K] int64, -1 padded: token ids of each row's logit_bias."""
    bias_values: torch.Tensor | None = None
    """[R, K] float32: their biases (0 under the padding)."""
    suppressed_ids: torch.Tensor | None = None
    """[R, L] int64, -1 padded: ids a row may not sample yet (EOS and stop_token_ids
    before min_tokens)."""
    guided_rows: list[tuple[int, GuidedState]] = field(default_factory=list)
    """(row, parse state) of each guided row."""

    @classmethod
    def from_requests(cls, requests: list[Request], device: torch.device) -> SamplingBatch:
        params = [request.sampling_params for request in requests]
        wants_logprobs = any(p.logprobs is not None for p in params)
        suppressed = [_suppressed(request) for request in requests]
        guided = [(row, r.grammar) for row, r in enumerate(requests) if r.grammar is not None]
        plain = all(
            p.greedy and not p.uses_penalties and not p.logit_bias for p in params
        ) and not (any(suppressed) or guided)
        if not wants_logprobs and plain:
            return cls(num_rows=len(requests), fast_greedy=True)

        batch = cls(num_rows=len(requests), fast_greedy=False, guided_rows=guided)
        if wants_logprobs:
            batch.num_logprobs = [p.logprobs for p in params]
        if any(p.logit_bias for p in params):
            batch.bias_ids = _pad([[t for t, _ in p.logit_bias] for p in params], device)
            values = [[b for _, b in p.logit_bias] for p in params]
            width = batch.bias_ids.shape[1]
            batch.bias_values = _column(
                [row + [0.0] * (width - len(row)) for row in values], torch.float32, device
            )
        if any(suppressed):
            batch.suppressed_ids = _pad(suppressed, device)
        batch._add_penalties(requests, device)
        batch.sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
        drawing = [params[row] for row in batch.sampled_rows]
        if not drawing:
            return batch
        if len(drawing) < len(params):
            batch.sampled_index = _column(batch.sampled_rows, torch.int64, device)
        batch.generators = [requests[row].generator for row in batch.sampled_rows]
        batch.temperature = _column(
            [max(p.temperature, MIN_TEMPERATURE) for p in drawing], torch.float32, device
        )
        if any(p.top_k > 0 for p in drawing):
            batch.top_k = _column([max(p.top_k, 0) for p in drawing], torch.int64, device)
            if all(p.top_k > 0 for p in drawing):
                batch.max_top_k = max(p.top_k for p in drawing)
        if any(p.top_p < 1.0 for p in drawing):
            batch.top_p = _column([p.top_p for p in drawing], torch.float32, device)
        if any(p.min_p > 0.0 for p in drawing):
            batch.min_p = _column([p.min_p for p in drawing], torch.float32, device)
        return batch

    def _add_penalties(self, requests: list[Request], device: torch.device) -> None:
        params = [request.sampling_params for request in requests]
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalty = _column(
                [max(p.repetition_penalty, MIN_REPETITION_PENALTY) for p in params],
                torch.float32,
                device,
            )
            self.seen_token_ids = _pad(
                [
                    [*r.prompt_token_ids, *r.output_token_ids]
                    if p.repetition_penalty != 1.0
                    else []
                    for r, p in zip(requests, params, strict=True)
                ],
                device,
            )
        additive = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        if any(additive):
            self.frequency_penalty = _column(
                [p.frequency_penalty for p in params], torch.float32, device
            )
            self.presence_penalty = _column(
                [p.presence_penalty for p in params], torch.float32, device
            )
            self.output_token_ids = _pad(
                [
                    list(r.output_token_ids) if used else []
                    for r, used in zip(requests, additive, strict=True)
                ],
                device,
            )


def _suppressed(request: Request) -> list[int]:
    """Ids the request may not sample now: before `min_tokens`, its stop token ids and
    (unless it ignores EOS) its EOS ids."""
    params = request.sampling_params
    if len(request.output_token_ids) >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else list(request.eos_token_ids)
    return [*eos, *params.stop_token_ids]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its Logprob where the row asked for logprobs."""

    token_ids: list[int]
    logprobs: list[Logprob | None]
    invalid_rows: list[int] = field(default_factory=list)
    """Rows whose logits were not finite: INVALID_TOKEN and no logprob for them."""

    blocked_rows: list[int] = field(default_factory=list)
    """Guided rows whose grammar allowed no token of the vocabulary: INVALID_TOKEN."""

    def mark_invalid(self, rows: list[int]) -> SamplerOutput:
        for row in rows:
            self.token_ids[row] = INVALID_TOKEN
            self.logprobs[row] = None
        self.invalid_rows = rows
        return self

    def mark_blocked(self, rows: list[int]) -> None:
        for row in rows:
            self.token_ids[row] = INVALID_TOKEN
            self.logprobs[row] = None
        self.blocked_rows = rows


def _rows_without_a_token(
    logits: torch.Tensor, guided_rows: list[tuple[int, GuidedState]]
) -> list[int]:
    """Guided rows whose mask left no token (every logit -inf); their logits become 0
    in place, so drawing from them stays well-formed (their token is discarded)."""
    rows = [row for row, _ in guided_rows]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    empty = torch.isneginf(logits.index_select(0, index).amax(dim=-1)).tolist()
    blocked = [row for row, is_empty in zip(rows, empty, strict=True) if is_empty]
    if blocked:
        logits.index_fill_(0, torch.tensor(blocked, dtype=torch.int64, device=logits.device), 0.0)
    return blocked


def non_finite_rows(row_max: torch.Tensor) -> list[int]:
    """Rows whose largest logit is NaN or +-Inf (max propagates NaN; a -Inf max means
    no finite logit at all)."""
    finite = torch.isfinite(row_max)
    if bool(finite.all()):
        return []
    return (~finite).nonzero().flatten().tolist()


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 occurrences of each id in each row of the -1 padded `token_ids`.
    Pads and ids outside the vocabulary land in a spare column that is dropped."""
    ids = token_ids.masked_fill((token_ids < 0) | (token_ids >= vocab_size), vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _with_spare_column(
    logits: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` with one more column and `ids` with pads (and ids outside the
    vocabulary) pointing at it, for scatters that must skip the padding."""
    vocab_size = logits.shape[-1]
    spare = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
    return spare, ids.masked_fill((ids < 0) | (ids >= vocab_size), vocab_size)


def apply_token_rules(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Semantics: logits[R, V] -> [R, V]; adds each row's logit_bias (bias_ids[R, K],
    bias_values[R, K]) at its ids, then sets suppressed_ids[R, L] to -inf. -1 pads
    change nothing. A new tensor when any applies, `logits` itself otherwise."""
    vocab_size = logits.shape[-1]
    if batch.bias_ids is not None:
        spare, ids = _with_spare_column(logits, batch.bias_ids)
        logits = spare.scatter_add_(1, ids, batch.bias_values)[:, :vocab_size]
    if batch.suppressed_ids is not None:
        spare, ids = _with_spare_column(logits, batch.suppressed_ids)
        logits = spare.scatter_(1, ids, float("-inf"))[:, :vocab_size]
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF), then presence and frequency (OpenAI) penalties; a new tensor
    when any applies, `logits` itself otherwise."""
    vocab_size = logits.shape[-1]
    if batch.repetition_penalty is not None:
        seen = _token_counts(batch.seen_token_ids, vocab_size) > 0
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        counts = _token_counts(batch.output_token_ids, vocab_size)
        logits = (
            logits
            - batch.frequency_penalty.unsqueeze(1) * counts
            - batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
        )
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Masks to -inf what top-k (0: off) and then top-p (1: off) drop, per row.

    Top-k keeps exactly k tokens (ties at the k-th value broken by sort order). The
    nucleus is the smallest set of the most likely top-k survivors whose mass reaches
    top_p, so the most likely token always stays. `max_top_k > 0` promises that every
    row has a top-k of at most that: only that many logits per row get sorted (`topk`)
    instead of the whole row.
    """
    if max_top_k > 0:
        best, order = logits.topk(min(max_top_k, logits.shape[-1]), dim=-1)
    else:
        best, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(best.shape[-1], device=logits.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, best.shape[-1]).unsqueeze(1)
        best = best.masked_fill(rank >= k, float("-inf"))
    if top_p is not None:
        probs = best.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # The most likely token always stays, also for a top_p that rounds to 0 in
        # float32 (a double denormal such as 5e-324 passes `top_p > 0`).
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1) & (rank > 0)
        best = best.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, best)


def apply_min_p(weights: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes `weights` (probabilities scaled so each row's largest is 1) below min_p."""
    return weights.masked_fill(weights < min_p.unsqueeze(1), 0.0)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[S] uniforms in [0, 1); a row with a generator takes one draw from it."""
    seeded = [row for row, generator in enumerate(generators) if generator is not None]
    if len(seeded) == len(generators):
        uniforms = torch.empty(len(generators), dtype=torch.float32, device=device)
    else:
        uniforms = torch.rand(len(generators), dtype=torch.float32, device=device)
    if seeded:
        draws = [
            torch.rand((), generator=generators[row], device=generators[row].device).item()
            for row in seeded
        ]
        index = torch.tensor(seeded, dtype=torch.int64, device=device)
        uniforms[index] = torch.tensor(draws, dtype=torch.float32, device=device)
    return uniforms


def draw_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[S] token ids: per row the first id whose cumulative weight exceeds u * total.

    The target is kept strictly below the total, so a zero-weight id is never picked.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


class Sampler:
    """Picks one token per row; see the module docstring for the order of operations."""

    def __init__(self, kernels: KernelBackend | None = None) -> None:
        """`kernels`: the model's kernel backend, whose `greedy_tokens` takes the argmax of
        an all-greedy batch (default: the plain torch backend)."""
        self.kernels = kernels if kernels is not None else get_backend("torch")

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.fast_greedy:
            # One copy to the host for the tokens and the finite flags together.
            host = self.kernels.greedy_tokens(logits).tolist()
            output = SamplerOutput(host[0], [None] * batch.num_rows)
            invalid = [row for row, finite in enumerate(host[1]) if not finite]
            return output.mark_invalid(invalid)
        if logits.dtype != torch.float32:
            logits = logits.float()
        invalid = non_finite_rows(logits.amax(dim=-1))
        if invalid:
            rows = torch.tensor(invalid, dtype=torch.int64, device=logits.device)
            logits = logits.index_fill(0, rows, 0.0)

        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs else None
        blocked: list[int] = []
        if batch.guided_rows:
            logits = logits.clone()
            mask_disallowed_tokens(logits, batch.guided_rows)
            blocked = _rows_without_a_token(logits, batch.guided_rows)
        logits = apply_token_rules(logits, batch)
        logits = apply_penalties(logits, batch)
        tokens = logits.argmax(dim=-1)
        if batch.sampled_index is not None:
            tokens[batch.sampled_index] = self._draw(logits[batch.sampled_index], batch)
        elif batch.sampled_rows:
            tokens = self._draw(logits, batch)
        token_ids = tokens.tolist()
        logprobs = self._logprobs(raw_logprobs, tokens, token_ids, batch)
        output = SamplerOutput(token_ids, logprobs).mark_invalid(invalid)
        output.mark_blocked(blocked)
        return output

    @staticmethod
    def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row of the drawing rows' `logits[S, V]`."""
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
        if batch.min_p is not None:
            weights = apply_min_p(weights, batch.min_p)
        return draw_inverse_cdf(weights, _uniforms(batch.generators, logits.device))

    @staticmethod
    def _logprobs(
        raw_logprobs: torch.Tensor | None,
        tokens: torch.Tensor,
        token_ids: list[int],
        batch: SamplingBatch,
    ) -> list[Logprob | None]:
        if raw_logprobs is None:
            return [None] * batch.num_rows
        max_k = max(k for k in batch.num_logprobs if k is not None)
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top_values, top_ids = raw_logprobs.topk(max(max_k, 1), dim=-1)
        host = torch.cat([chosen.unsqueeze(1), top_values], dim=1).tolist()
        top_ids = top_ids.tolist()
        results: list[Logprob | None] = []
        for row, k in enumerate(batch.num_logprobs):
            if k is None:
                results.append(None)
                continue
            top = dict(zip(top_ids[row][:k], host[row][1 : k + 1], strict=True))
            results.append(Logprob(token_ids[row], host[row][0], top))
        return results
