"""The wire between the ingress and a model replica: what a call carries
(`GenerateCall`) and what streams back (`StreamStep`s of per-completion `StreamDelta`s,
or a `GenerateError`). Plain frozen dataclasses; both sides import them from here alone.

A call's first item comes back on the call's own Ray stream. A call that names an
ingress replica's frame channel (`frames_to`) gets everything after it through that
channel instead: a socket the model replica keeps open to the ingress replica, carrying
one frame per engine step for all of that ingress's calls (deployments/step_frames.py
encodes them, deployments/frame_outbox.py sends, deployments/frame_channels.py
receives). The call's own stream stays open, silent, until the request ends, so Serve
counts it as ongoing and cancelling it aborts the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.deployments.logprobs import TokenLogprob
from loraplex.platform.request import SamplingParams


@dataclass(frozen=True)
class FrameChannelAddress:
    """Where an ingress replica takes frames: a TCP listener, on Linux also a Unix
    socket for model replicas on its own node, and the secret a model replica proves it
    is one of the app's own with (its first line on the socket)."""

    host: str
    port: int
    token: str
    node_id: str = ""
    """The Ray node the ingress replica runs on ("" off Ray)."""
    unix_path: str = ""
    """Its Unix socket (an abstract name), "" when it has none."""


@dataclass(frozen=True)
class GenerateCall:
    """One request as the ingress forwards it; the adapter travels as the Serve
    multiplexed model id (`AdapterEntry.model_id`), "" for the base model."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages as the chat template reads them (`ChatMessage.for_template`)."""
    tenant: str = ""
    tenant_weight: float = 1.0
    """The tenant's fair-share weight (the engine's `fair` policy and admission)."""
    adapter: str | None = None
    """Public adapter id ('base:name') for logs and metrics."""
    max_tokens_given: bool = True
    """False: `params.max_tokens` is a default, shortened to what the context has room
    for. True: a request that cannot fit it is refused (400)."""
    max_request_tokens: int | None = None
    """The tenant's tokens-per-minute budget: a request whose worst case (prompt + n x
    max_tokens) exceeds it can never pass and is refused (400)."""
    cache_salt: str | None = None
    """Prefix-cache namespace (the tenant); None shares the cache with every caller."""
    received_at: float | None = None
    """`time.time()` when the ingress received the request: time spent queued before
    the replica counts toward its admission wait (None: not known)."""
    echo: bool = False
    """The first step carries the prompt's text (`StreamStep.echo_text`)."""
    tools: list[dict[str, Any]] | None = None
    """Function definitions the chat template gets (chat requests with `tools`); the
    first step then says how the model writes tool calls (`tool_call_format`)."""
    embed: bool = False
    """/v1/embeddings: the prompt is pooled into an embedding and nothing is generated;
    the call's one step carries it (`StreamStep.embedding`)."""
    frames_to: FrameChannelAddress | None = None
    """Steps after the first go to this ingress replica's frame channel; None (or a
    channel the model replica cannot reach): every step on the call's own stream."""
    frame_key: int = 0
    """The call's key in its channel's frames (unique per ingress replica)."""


@dataclass(frozen=True)
class StreamDelta:
    """What one completion gained since the previous delta."""

    index: int
    text: str
    num_new_tokens: int
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class StreamStep:
    prompt_tokens: int
    deltas: list[StreamDelta]
    worst_case_tokens: int = 0
    """prompt + n x max_tokens as the engine runs it: what the ingress keeps reserved
    against the tenant's token budget until the request ends."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (the caller's own namespace)."""
    echo_text: str | None = None
    """The prompt's text, on the first step of a call that asked for `echo`."""
    tool_call_format: str | None = None
    """On the first step of a call with tools: the tool-call format of the model's chat
    template ('hermes'), None when it has none."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """On the first step of a call whose params ask for prompt logprobs: every prompt
    token, the first unscored."""
    embedding: list[float] | None = None
    """The one step of an `embed` call: the prompt's embedding."""
    replica: str | None = None
    """On the first step of a call whose later steps travel in frames: the model replica
    that sends them (its channel failing fails the call)."""


ADAPTER_REPLACED = "adapter_replaced"
"""GenerateError code: the call's adapter version is gone from the catalog (updated,
unloaded or deleted) and this replica holds no copy of it; the ingress retries once
with the catalog's current version, if there is one."""


@dataclass(frozen=True)
class GenerateError:
    """A refused or failed request; the first item of a stream, or its last."""

    status: int
    message: str
    param: str | None = None
    retry_after_s: int | None = None
    code: str | None = None
    """`overloaded`: refused for load (admission); `adapter_replaced` (ADAPTER_REPLACED)."""
