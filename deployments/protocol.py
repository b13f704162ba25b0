"""OpenAI request/response schema (the subset we serve), validated once at the edge.

Unknown fields are rejected (400) rather than silently ignored, so a client relying on
a parameter we do not implement finds out at once. Every number has bounds the engine
can represent (NaN and Infinity are refused everywhere); what depends on the model
(top_k against its vocabulary, token ids, lengths against the context and the KV
cache) is checked by the model server before the request reaches the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraplex.deployments.catalog import ADAPTER_NAME
from loraplex.platform.failpoints import NAMES as FAILPOINT_NAMES
from loraplex.platform.request import SamplingParams

INT32_MAX = 2**31 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    # Extensions vLLM users know.
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _token_ids_non_negative(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loraplex"
    parent: str | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RegisterAdapterRequest(StrictModel):
    """Admin API: register one of the caller's adapter folders under a name."""

    model: str = Field(min_length=1, max_length=256, description="base model it adapts")
    name: str = Field(min_length=1, max_length=64, description="called as '<model>:<name>'")
    path: str = Field(
        min_length=1, max_length=1024, description="folder relative to the tenant's root"
    )

    @field_validator("name")
    @classmethod
    def _adapter_name(cls, name: str) -> str:
        if not ADAPTER_NAME.match(name):
            raise ValueError(f"adapter name {name!r} must be letters, digits, '.', '_' or '-'")
        return name


class ArmFailpointRequest(StrictModel):
    """Operator API: arm a failpoint (platform/failpoints.py) in one replica of a model
    whose config allows fault injection, for a chaos drill."""

    model: str = Field(min_length=1, max_length=256, description="base model to fault")
    name: str = Field(min_length=1, max_length=64, description="sampler.row, engine.step, ...")
    prompt: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        default=None, max_length=4096, description="fire only for requests with these token ids"
    )
    times: int | None = Field(default=None, ge=1, le=1_000_000, description="fire this often")
    delay_s: float = Field(default=0.0, ge=0.0, le=10.0, description="engine.delay's sleep")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in FAILPOINT_NAMES:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(FAILPOINT_NAMES)}")
        return name


class AdapterCard(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    parent: str
    name: str
    version: int


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
