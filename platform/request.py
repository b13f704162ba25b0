"""Requests as the engine sees them, their sampling parameters and their outputs."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.platform.guided import GuidedSpec, GuidedState
from loraplex.platform.pooling import PoolingSpec

if TYPE_CHECKING:
    import torch

    from loraplex.adapters.peft_format import LoRAAdapter


SEED_MIN = -(2**63)
SEED_LIMIT = 2**64
"""Seeds are 64-bit: OpenAI's signed range and the generator's unsigned one."""

MAX_LOGPROBS = 20
"""The most top alternatives `logprobs` and `prompt_logprobs` may ask for."""

CUMULATIVE, DELTA = "cumulative", "delta"
OUTPUT_KINDS = (CUMULATIVE, DELTA)
"""`SamplingParams.output_kind`: what a request's outputs hold (RequestOutput)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Validated on construction (ValueError).

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1 and min_p 0
    disable theirs. Penalties follow the OpenAI (presence, frequency: additive, over
    generated tokens) and HF (repetition: multiplicative, over prompt + generated)
    conventions. `seed` makes sampling reproducible per request. `logprobs=k` returns the
    sampled token's log-probability plus the top k alternatives at each step;
    `prompt_logprobs=k` returns, for every prompt token after the first, its
    log-probability given the tokens before it, its rank and the top k alternatives
    (raw model log-softmax, as vLLM; the prompt is then computed in full, without
    prefix-cache hits).
    `logit_bias` adds a bias in [-100, 100] to the raw logits of token ids (a mapping or
    (id, bias) pairs; kept as pairs sorted by id). `min_tokens`: until this many tokens
    were generated, EOS and `stop_token_ids` cannot be sampled and stop strings are not
    looked for (vLLM's rule). `guided`: the output must spell what the spec describes
    (platform/guided.py); the completion ends once it is complete. `output_kind`: what
    each of the request's outputs holds (`CUMULATIVE`: everything so far; `DELTA`: only
    what is new since the request's previous output, see RequestOutput).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    guided: GuidedSpec | None = None
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self._check_token_rules()
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_LIMIT}), got {self.seed}")

    def _check_token_rules(self) -> None:
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError("logit_bias token ids must be distinct and >= 0")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_FORK = "waiting_for_fork"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)
"""The statuses a request ends in (a tuple: members compare by identity, no hashing)."""


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine ended one request early while the rest of its batch ran on.

    `client_fault`: the request's own input caused it (its adapter produced NaN/Inf
    logits), so the server answers 4xx; otherwise it is an internal error of that
    request alone (5xx).
    """

    message: str
    client_fault: bool = False


def child_seed(seed: int, index: int) -> int:
    """The generator seed of child `index` of a seeded request: distinct per child and
    always inside the generator's unsigned 64-bit range, whatever the seed."""
    return (seed * 1_000_003 + index) % SEED_LIMIT


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token (sampled, or a prompt token given the ones before
    it) and the top alternatives at its position, best first. `rank`: 1 + how many
    tokens were more likely (prompt tokens only; None for sampled ones)."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None


@dataclass(eq=False)
class Request:
    """One sequence the engine generates. n > 1 sampling makes n Requests ("children")
    that share a `group_id`; child 0 computes the prompt, the others fork its KV blocks.

    `all_token_ids` is prompt + generated so far; `num_computed_tokens` counts the
    tokens whose K/V sit in the cache. After a preemption the request recomputes
    `all_token_ids` from scratch (prefix-cache hits make that cheap). `lora` is the
    loaded adapter the request runs with (None = base model). `cache_salt` keeps its
    prefix-cache entries apart from every request with another salt (one per tenant).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    lora: LoRAAdapter | None = None
    tenant: str = ""
    """Whose request it is, for the `fair` scheduling policy (platform/fair_share.py)."""
    tenant_weight: float = 1.0
    """The tenant's fair-share weight: its served tokens count 1 / weight each."""
    group_id: str = ""
    index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    cache_salt: bytes | None = None
    failure: RequestFailure | None = None
    grammar: GuidedState | None = None
    """The parse state of a guided request, its own per completion; None unguided."""
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    """With `prompt_logprobs`: entry i is prompt token i + 1's, booked as the chunks
    holding the positions before them are computed (each position once, whatever
    preemptions recompute)."""
    pooling: PoolingSpec | None = None
    """Set for an embedding request: its prompt is computed and pooled, nothing is
    generated (platform/pooling.py); the request ends once its prompt is computed."""
    pooled: torch.Tensor | None = None
    """The sum of the hidden states pooled so far ([hidden] float32); a preemption
    clears it (the prompt is computed again)."""
    embedding: list[float] | None = None
    """The embedding, once the whole prompt is pooled."""

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        seed = self.sampling_params.seed
        if seed is not None and self.generator is None:
            import torch  # the engine's processes only: the ingress reads this module too

            self.generator = torch.Generator().manual_seed(child_seed(seed, self.index))

    @property
    def adapter_key(self) -> bytes | None:
        """Identity of the adapter (a hash of its weights and config), or None for base."""
        return self.lora.key if self.lora is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some are not computed yet: its prompt must be
        computed by the model, not taken from the prefix cache. Child 0 of a group
        books them (its siblings fork its KV once its prompt is done)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed by the model (no prefix-cache
        hit): prompt logprobs still to score, or an embedding that pools them all."""
        if self.pooling is not None:
            return self.pooling.needs_every_position and self.embedding is None
        return self.needs_prompt_logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose K/V is not computed yet: 1 for a decode, more for a prompt
        (or a preempted request's recompute) under way."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        # Asked several times per request per step: one property, not two.
        return self.status in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int, logprob: Logprob | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)


@dataclass
class CompletionOutput:
    """One of a request's n completions: generated ids only, their text, why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a caller gets for one prompt. `.token_ids` / `.text` are the first
    completion's, for the common n == 1 case.

    Of a CUMULATIVE request (`SamplingParams.output_kind`), each output holds every
    completion whole so far. Of a DELTA request, each holds what is new since the
    request's previous output: a completion's new text, token ids and logprobs, listed
    only when it gained something or ended (once: an ended completion is not listed
    again), and the prompt's logprobs only in the first output that carries a token.
    `merge_outputs` joins consecutive outputs of either kind."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: RequestFailure | None = None
    """Set when the engine ended the request early (its completions finish with
    "error"); the other requests of the batch were not affected."""
    prompt_logprobs: list[Logprob | None] | None = None
    """With `prompt_logprobs`: one entry per prompt token, None for the first (nothing
    precedes it); complete from the first output that carries a generated token."""
    embedding: list[float] | None = None
    """An embedding request's embedding (its only output, finished)."""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text


def merge_outputs(older: RequestOutput, newer: RequestOutput, kind: str) -> RequestOutput:
    """Semantics: one output equal to `older` followed by `newer`, two consecutive
    outputs of the same request of `kind` (its `SamplingParams.output_kind`). CUMULATIVE:
    `newer` (it contains `older`). DELTA: each completion's text, token ids and logprobs
    concatenated in order, its finish from `newer` when that lists it; the request's
    state (finished, cached tokens, error, embedding) from `newer`, the prompt's
    logprobs from whichever carries them."""
    if kind == CUMULATIVE:
        return newer
    completions = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        before = completions.get(c.index)
        if before is None:
            completions[c.index] = c
            continue
        logprobs = None
        if before.logprobs is not None or c.logprobs is not None:
            logprobs = [*(before.logprobs or ()), *(c.logprobs or ())]
        completions[c.index] = CompletionOutput(
            c.index,
            before.text + c.text,
            before.token_ids + c.token_ids,
            c.finish_reason,
            c.stop_reason,
            logprobs,
        )
    return RequestOutput(
        request_id=newer.request_id,
        prompt_token_ids=newer.prompt_token_ids,
        outputs=sorted(completions.values(), key=lambda c: c.index),
        finished=newer.finished,
        num_cached_tokens=newer.num_cached_tokens,
        error=newer.error or older.error,
        prompt_logprobs=older.prompt_logprobs
        if older.prompt_logprobs is not None
        else newer.prompt_logprobs,
        embedding=newer.embedding,
    )
