"""OpenAI-compatible HTTP surface: validates requests, routes them to the base model's
deployment by name, and streams Server-Sent Events back.

Every failure leaves as OpenAI's error JSON with a 4xx/5xx status; request bodies are
parsed here (not by FastAPI) so malformed JSON, non-UTF-8 bytes, wrong types and
unknown fields all get a 400 with a message, never a 500.
"""

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from loraplex.deployments.errors import OpenAIError, error_response
from loraplex.deployments.model_server import GenerateCall, GenerateError, StreamStep
from loraplex.deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    new_id,
)
from loraplex.deployments.responses import ChoiceAccumulator, sse

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 256
Body = TypeVar("Body", bound=BaseModel)

app = FastAPI(title="loraplex", description="OpenAI-compatible multi-LoRA serving")


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


async def parse_body(request: Request, schema: type[Body]) -> Body:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise OpenAIError(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"request body is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise OpenAIError(400, f"{param}: {first['msg']}", param=param) from None


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    """Routes `model` = base model name to that model's ModelServer deployment."""

    def __init__(self, model_names: list[str], servers: list[DeploymentHandle]) -> None:
        self.servers = dict(zip(model_names, servers, strict=True))

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=name) for name in self.servers])

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        logprobs = body.logprobs
        call = GenerateCall(
            request_id=new_id("cmpl"),
            params=self._params(body, body.max_tokens, logprobs),
            prompt=body.prompt,
        )
        return await self._respond(body, call, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        call = GenerateCall(
            request_id=new_id("chatcmpl"),
            params=self._params(body, body.requested_max_tokens, top if body.logprobs else None),
            messages=[m.model_dump(exclude_none=True) for m in body.messages],
        )
        return await self._respond(body, call, chat=True)

    @staticmethod
    def _params(body: SamplingFields, max_tokens: int | None, logprobs: int | None):
        try:
            return body.sampling_params(max_tokens or DEFAULT_MAX_TOKENS, logprobs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from None

    def _server(self, model: str) -> DeploymentHandle:
        base, _, adapter = model.partition(":")
        server = self.servers.get(base)
        if server is None or adapter:
            raise OpenAIError(404, f"model {model!r} does not exist", code="model_not_found")
        return server

    async def _respond(self, body: SamplingFields, call: GenerateCall, chat: bool) -> Response:
        server = self._server(body.model)
        logger.info("request %s -> %s (stream=%s)", call.request_id, body.model, body.stream)
        steps = server.options(stream=True).generate.remote(call)
        first = await anext(aiter(steps))
        if isinstance(first, GenerateError):
            raise OpenAIError(first.status, first.message, param=first.param)
        accumulator = ChoiceAccumulator(call.request_id, body.model, chat, call.params.n)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(accumulator, first, steps, include_usage),
                media_type="text/event-stream",
            )
        accumulator.add(first)
        async for step in steps:
            accumulator.add(step)
        return JSONResponse(accumulator.final())

    @staticmethod
    async def _stream(
        accumulator: ChoiceAccumulator,
        first: StreamStep,
        steps: AsyncIterator[StreamStep],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        started = time.monotonic()
        for chunk in accumulator.chunks(first):
            yield sse(chunk)
        async for step in steps:
            for chunk in accumulator.chunks(step):
                yield sse(chunk)
        if include_usage:
            yield sse(accumulator.usage_chunk())
        yield "data: [DONE]\n\n"
        logger.info(
            "request %s streamed in %.2fs", accumulator.request_id, time.monotonic() - started
        )
