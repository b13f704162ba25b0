"""ModelServer: one Ray Serve deployment per base model; each replica owns one AsyncEngine.

Its jobs:
- build the engine from a validated `ModelDeploymentConfig` (model, engine options);
- turn a `GenerateCall` (prompt text, token ids or chat messages + sampling params)
  into a stream of `StreamDelta`s: per completion, only what is new since the last one;
- report bad input as a `GenerateError` (the ingress maps it to a 4xx) instead of
  raising, so nothing a client sends fails the replica;
- fail `check_health` when the engine loop is dead, so Serve replaces the replica;
- drain in-flight requests on shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplex.deployments.config import ModelDeploymentConfig
from loraplex.platform.async_engine import AsyncEngine
from loraplex.platform.engine import LLMEngine
from loraplex.platform.request import Logprob, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateCall:
    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class StreamDelta:
    """What one completion gained since the previous delta."""

    index: int
    text: str
    num_new_tokens: int
    finish_reason: str | None
    logprobs: list[Logprob] = field(default_factory=list)


@dataclass(frozen=True)
class StreamStep:
    prompt_tokens: int
    deltas: list[StreamDelta]


@dataclass(frozen=True)
class GenerateError:
    status: int
    message: str
    param: str | None = None


class ModelServer:
    def __init__(self, config: ModelDeploymentConfig) -> None:
        self.config = config
        self.engine = AsyncEngine(LLMEngine(config.engine_config()))
        logger.info("model server for %s ready", config.name)

    def _prompt_ids(self, call: GenerateCall) -> list[int] | str:
        if call.messages is None:
            return call.prompt
        tokenizer = self.engine.engine.tokenizer
        encoded = tokenizer.apply_chat_template(
            call.messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamStep | GenerateError]:
        """Streams StreamSteps; a GenerateError is the only item when the input is bad."""
        try:
            prompt = self._prompt_ids(call)
            stream = self.engine.generate(prompt, call.params, request_id=call.request_id)
            tracker = DeltaTracker(call.params.n)
            async for output in stream:
                yield tracker.step(output)
        except ValueError as exc:
            logger.info("request %s rejected: %s", call.request_id, exc)
            yield GenerateError(400, str(exc))

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(drain_timeout_s=self.config.drain_timeout_s)


class DeltaTracker:
    """Turns cumulative RequestOutputs into per-completion deltas."""

    def __init__(self, n: int) -> None:
        self._text = [0] * n
        self._tokens = [0] * n
        self._logprobs = [0] * n
        self._finished = [False] * n

    def step(self, output: RequestOutput) -> StreamStep:
        deltas = []
        for completion in output.outputs:
            i = completion.index
            if self._finished[i]:
                continue
            text = completion.text[self._text[i] :]
            new_tokens = len(completion.token_ids) - self._tokens[i]
            logprobs = (completion.logprobs or [])[self._logprobs[i] :]
            if not text and not new_tokens and completion.finish_reason is None:
                continue
            self._text[i] = len(completion.text)
            self._tokens[i] = len(completion.token_ids)
            self._logprobs[i] += len(logprobs)
            self._finished[i] = completion.finish_reason is not None
            deltas.append(StreamDelta(i, text, new_tokens, completion.finish_reason, logprobs))
        return StreamStep(len(output.prompt_token_ids), deltas)
