"""OpenAI-compatible HTTP surface: authenticates the tenant, resolves `model` to a base
model and adapter (routing.py), enforces the tenant's limits, calls the base model's
deployment with the adapter as Serve's multiplexed model id, and streams SSE back.

Every failure leaves as OpenAI's error JSON with its status (errors.py): request bodies
are parsed here, not by FastAPI, so malformed JSON, non-UTF-8 bytes, wrong types and
unknown fields all get a 400 with a message, never a 500. A client that disconnects
cancels its call, which aborts the engine request and frees its KV blocks. A request
that fails after its stream started ends with an OpenAI error event.

/v1/embeddings runs one call per input through the same limits, admission and routing
as a completion: each call pools its prompt on the replica and its one step carries the
embedding (platform/pooling.py).

Token budgets charge up front: a request reserves its worst case (prompt estimate +
n x max_tokens) at admission, the exact worst case once the model server counted the
prompt (first step), and books what it used when it ends. Each tenant's prompts get
their own prefix-cache namespace (`cache_salt`). /metrics needs an operator key when
one is configured; without one (and with tenants) it hides tenant and adapter names.

Admin API (a tenant manages its own adapters, nobody else's):
    GET    /v1/adapters                         list
    POST   /v1/adapters                         register {model, name, path | uri}; path
                                                is relative to <adapter_root>/<tenant>/,
                                                uri under one of the tenant's sources
    PUT    /v1/adapters/{model}/{name}          new files for an adapter {path | uri}
    POST   /v1/adapters/{model}/{name}/unload   drop every replica's copy
    DELETE /v1/adapters/{model}/{name}          unregister
"""

import asyncio
import dataclasses
import json
import logging
import time
import types
import urllib.request
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapters.fetch import store_files
from loraplex.deployments.adapter_fetching import AdapterFetching
from loraplex.deployments.adapter_validation import AdapterValidator
from loraplex.deployments.admission import FleetAdmission
from loraplex.deployments.body_limit import BodyLimit
from loraplex.deployments.call_handles import GenerateHandles
from loraplex.deployments.catalog import AdapterCatalog, AdapterEntry, CatalogError
from loraplex.deployments.config import (
    ModelDeploymentConfig,
    PlatformConfig,
    model_deployment_name,
)
from loraplex.deployments.direct_http import DirectHTTP
from loraplex.deployments.errors import OpenAIError, error_response
from loraplex.deployments.frame_channels import FrameChannels
from loraplex.deployments.ingress_gate import InFlightGate, set_gate_limit
from loraplex.deployments.logs import PER_REQUEST, send_platform_logs_to_serve
from loraplex.deployments.metrics import (
    TENANT_LABELS,
    IngressMetrics,
    ProcessMemory,
    render_prometheus,
)
from loraplex.deployments.openapi import openapi_document
from loraplex.deployments.protocol import (
    AdapterCard,
    AdapterFiles,
    AdapterList,
    ArmFailpointRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    RegisterAdapterRequest,
    SamplingFields,
    TokenizeRequest,
    new_id,
)
from loraplex.deployments.readiness import ModelReadiness
from loraplex.deployments.responses import (
    ChoiceAccumulator,
    batch_body,
    embedding_list,
    sse,
    usage_chunk,
)
from loraplex.deployments.routing import Route, resolve_model, visible_adapters
from loraplex.deployments.step_deadline import within_step_timeout
from loraplex.deployments.tenants import (
    AuthError,
    RateLimited,
    RateLimiter,
    Tenant,
    Tenants,
    bearer_digest,
)
from loraplex.deployments.tool_calls import ToolCalling
from loraplex.deployments.trainer import PUSHED_SOURCE, AdapterPushRefused, adapter_files
from loraplex.deployments.wire import ADAPTER_REPLACED, GenerateCall, GenerateError, StreamStep
from loraplex.platform.request_limits import EMBEDDING_PARAMS

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
OVERLOAD_RETRY_AFTER_S = 2
SERVE_REFUSALS = (BackPressureError, DeploymentUnavailableError)
"""What Serve raises for a call it would not send: the model's queue is full, or its
deployment failed (`serve_refusal` turns either into a 503)."""
OPERATOR_CALL_FAILURES = (RayError, *SERVE_REFUSALS, TimeoutError)
"""What ends an operator call to a deployment (failpoints, residency) with a 503."""
ADMIN_CALL_S = 30.0
"""How long an operator call (failpoints, residency) waits for the replicas' answers."""
FIRST_STEP_POLL_S = 1.0
"""How often a request waiting for its first step re-reads its model's readiness."""
Body = TypeVar("Body", bound=BaseModel)
REPLACED_RESENDS = 3
"""How many times a call whose adapter version was replaced in flight is sent again."""

app = FastAPI(title="loraplex", description="OpenAI-compatible multi-LoRA serving")
app.add_middleware(BodyLimit)
app.add_middleware(InFlightGate)
REQUEST_BODIES = {
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/embeddings", "post"): EmbeddingRequest,
    ("/v1/tokenize", "post"): TokenizeRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/v1/detokenize", "post"): DetokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
    ("/v1/adapters", "post"): RegisterAdapterRequest,
    ("/v1/adapters/{model}/{name}", "put"): AdapterFiles,
    ("/v1/admin/failpoints", "post"): ArmFailpointRequest,
}
"""The bodies the POST handlers parse themselves (`parse_body`), for /openapi.json."""


def _openapi(served: FastAPI) -> dict:
    if served.openapi_schema is None:
        served.openapi_schema = openapi_document(served, REQUEST_BODIES)
    return served.openapi_schema


app.openapi = types.MethodType(_openapi, app)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own answers (no such route: 404, wrong method: 405) in OpenAI error
    JSON too, keeping their headers (a 405's `Allow`)."""
    response = error_response(OpenAIError(exc.status_code, str(exc.detail)))
    response.headers.update(exc.headers or {})
    return response


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything no handler expected: logged with its traceback, answered as an OpenAI
    500 (never Starlette's plain-text one)."""
    if isinstance(exc, TaskCancelledError):  # the client went away; nobody reads this
        return error_response(OpenAIError(499, "client closed the request"))
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(OpenAIError(500, "internal error; the server logged it"))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in first["loc"]) or None
    return error_response(OpenAIError(400, f"{param}: {first['msg']}", param=param))


async def parse_body(request: Request, schema: type[Body]) -> Body:
    """The body validated against `schema`; a 4xx OpenAIError for anything else: not
    UTF-8 JSON, nested past the parser's depth, strings that are not Unicode text (a
    lone UTF-16 surrogate escape such as "\\ud800"), or schema violations. A body past
    MAX_BODY_BYTES never gets here: body_limit.py answers it 413 unread."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"request body is not valid UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "request body nests JSON arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    surrogate = first_lone_surrogate(data)
    if surrogate is not None:
        raise OpenAIError(
            400,
            f"request body has a string with a lone UTF-16 surrogate ({surrogate!a}), "
            "which is not Unicode text",
        )
    try:
        return schema.model_validate(data)
    except RecursionError:
        raise OpenAIError(400, "request body nests JSON arrays or objects too deeply") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise OpenAIError(400, f"{param}: {first['msg']}", param=param) from None


def first_lone_surrogate(data: object) -> str | None:
    """The first lone surrogate code point in any string (key or value) of parsed JSON,
    or None. JSON's \\u escapes (such as \\ud800) can spell them; no UTF-8 text can, so a tokenizer
    may fail on them. Walks iteratively (the depth json.loads allows)."""
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return item[exc.start]
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


async def _awaited(response: DeploymentResponse) -> Any:
    """A Serve call's result, as a coroutine (for gather and wait_for)."""
    return await response


def _catalog_error(exc: CatalogError) -> OpenAIError:
    retry = exc.status in (503, 507)
    return OpenAIError(
        exc.status, str(exc), retry_after_s=OVERLOAD_RETRY_AFTER_S if retry else None
    )


def serve_refusal(base: str, exc: Exception) -> OpenAIError:
    """A 503 for a call Serve refused: the model's queue is full (back-pressure) or its
    deployment has no replica it could ever start (it failed to deploy)."""
    if isinstance(exc, DeploymentUnavailableError):
        logger.error("model %s is unavailable: %s", base, exc)
        return OpenAIError(
            503,
            f"model {base!r} is unavailable: its deployment failed; retry later",
            code="model_unavailable",
            retry_after_s=OVERLOAD_RETRY_AFTER_S,
        )
    return OpenAIError(
        503,
        f"model {base!r} is overloaded, retry later",
        code="overloaded",
        retry_after_s=OVERLOAD_RETRY_AFTER_S,
    )


def replica_failed(base: str, request_id: str, exc: BaseException) -> OpenAIError:
    """A 503 for a model replica that failed mid-request (its engine or a tensor-parallel
    worker died); Serve replaces the replica, so a retry can succeed."""
    logger.error("request %s: model %s replica failed: %r", request_id, base, exc)
    return OpenAIError(
        503,
        f"model {base!r} failed while serving this request; retry later",
        retry_after_s=OVERLOAD_RETRY_AFTER_S,
    )


def _error_event(error: OpenAIError) -> str:
    """An OpenAI error as a server-sent event (once a stream's headers are gone)."""
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    return sse({"error": {"message": error.message, "type": kind, "code": error.status}})


def _card(entry: AdapterEntry) -> AdapterCard:
    return AdapterCard(
        id=entry.public_id,
        parent=entry.base,
        name=entry.name,
        version=entry.version,
        source=entry.source,
    )


def _node_metrics_text() -> str:
    """This node's Ray metrics agent's Prometheus text (blocking). The node is found by
    id: nodes may share an address (several on one machine)."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


CHAT_TEMPLATE_TOKENS = 128
"""Tokens a chat template may add around the messages (its own, not the caller's)."""


def prompt_tokens_estimate(call: GenerateCall) -> int:
    """An estimate of the prompt's tokens before the model server tokenizes it: exact
    for token ids; for text, one token per UTF-8 byte (a byte-level tokenizer's worst
    case) plus room for special and template tokens."""
    if isinstance(call.prompt, list):
        return len(call.prompt)
    if call.prompt is not None:
        return len(call.prompt.encode("utf-8", "replace")) + 8
    messages = call.messages or []
    content = sum(len(json.dumps(m).encode("utf-8", "replace")) + 8 for m in messages)
    return content + CHAT_TEMPLATE_TOKENS


def _within_inter_token_timeout(steps, timeout_s: float, model: str):
    """A call's remaining steps; 504 (`inter_token_timeout`) when the model sends
    nothing for `timeout_s` (a stalled or hung replica: the caller then cancels the
    call, which aborts the request in the engine)."""

    def timed_out() -> OpenAIError:
        return OpenAIError(
            504,
            f"model {model!r} sent no token for {timeout_s:g} s (inter-token timeout); "
            "the request was ended",
            code="inter_token_timeout",
        )

    return within_step_timeout(steps, timeout_s, timed_out)


async def _collect(
    accumulator: ChoiceAccumulator, first: StreamStep, steps, timeout_s: float
) -> None:
    """Adds a call's steps to its accumulator until it ends; raises its error."""
    accumulator.add(first)
    async for step in _within_inter_token_timeout(steps, timeout_s, accumulator.model):
        if isinstance(step, GenerateError):
            raise _generate_error(step)
        accumulator.add(step)


async def _collect_all(
    streams: list[tuple[ChoiceAccumulator, StreamStep, Any]], timeout_s: float
) -> None:
    """`_collect` for every call at once; when one fails (or the caller is cancelled),
    the other calls are cancelled and the failure is raised."""
    if len(streams) == 1:
        await _collect(*streams[0], timeout_s)
        return
    tasks = [asyncio.create_task(_collect(*stream, timeout_s)) for stream in streams]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for _, _, steps in streams:
            steps.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _interleaved(streams: list[tuple[ChoiceAccumulator, StreamStep, Any]], timeout_s: float):
    """(accumulator, step) from every call's remaining steps, in arrival order; one call
    reads its own stream directly. Each call has the inter-token timeout."""
    if len(streams) == 1:
        accumulator, _, steps = streams[0]
        async for step in _within_inter_token_timeout(steps, timeout_s, accumulator.model):
            yield accumulator, step
        return
    arrived: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(accumulator: ChoiceAccumulator, steps) -> None:
        try:
            async for step in _within_inter_token_timeout(steps, timeout_s, accumulator.model):
                await arrived.put((accumulator, step))
        except BaseException as exc:
            await arrived.put((accumulator, exc))
            return
        await arrived.put((accumulator, done))

    pumps = [asyncio.create_task(pump(a, steps)) for a, _, steps in streams]
    try:
        remaining = len(pumps)
        while remaining:
            accumulator, item = await arrived.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield accumulator, item
    finally:
        for task in pumps:
            task.cancel()


async def _settle_prefetch(response: DeploymentResponse, model_id: str) -> None:
    try:
        await response
    except Exception as exc:
        logger.warning("prefetch of adapter %s failed: %r", model_id, exc)


def _generate_error(error: GenerateError) -> OpenAIError:
    return OpenAIError(
        error.status,
        error.message,
        param=error.param,
        code=error.code,
        retry_after_s=error.retry_after_s,
    )


class _StreamEnd:
    """What ends a streamed response, exactly once: cancel the model calls (unless they
    completed) and release the tenant's slot and reservation. The stream's generator
    runs it when it ends; `ClosingStreamingResponse` runs it when the response ends
    without the generator ever starting (a client gone before the first chunk)."""

    def __init__(self, release: Any) -> None:
        self._release = release
        self._calls: list[Any] = []
        self._done = False

    def cancels(self, steps: Any) -> None:
        self._calls.append(steps)

    def run(self, cancel: bool) -> None:
        if self._done:
            return
        self._done = True
        if cancel:
            for steps in self._calls:
                steps.cancel()
        self._release()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs its `_StreamEnd` however the response ends."""

    def __init__(self, content: AsyncIterator[str], end: _StreamEnd, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._end = end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end.run(cancel=True)


@dataclasses.dataclass(frozen=True)
class StartedCalls:
    """A request's calls once started (`OpenAIIngress._start_calls`)."""

    route: Route
    calls: list[GenerateCall]
    """The calls as sent: with the tenant, its adapter and its cache namespace."""
    started: list[tuple[Any, StreamStep]]
    """(the call's remaining steps, its first step), per call."""
    reserved: int
    """Tokens held against the tenant's budget until the request ends."""
    admission: FleetAdmission


def batch_call_id(response_id: str, index: int, count: int) -> str:
    """The request id of entry `index` of a batch of `count` prompts or inputs."""
    return response_id if count == 1 else f"{response_id}-{index}"


def fleet_admission(model: ModelDeploymentConfig) -> FleetAdmission:
    """The ingress's admission estimate over `model`'s replicas, with the limits their
    own admission uses."""
    scheduler = model.engine_config().scheduler
    return FleetAdmission(
        model.admission_max_wait_s, scheduler.max_num_seqs, fair=scheduler.policy == "fair"
    )


def _check_fits_tenant(tenant: Tenant, calls: list[GenerateCall], n: int) -> None:
    """400 for a request that could never pass the tenant's limits: more sequences
    (prompts x n) than its concurrency limit, or more tokens than its tokens-per-minute
    budget in its output tokens (prompts x n x max_tokens) and token-id prompts. A text
    prompt's own size is checked once the model server counted it
    (`_check_worst_case_fits_budget`)."""
    budget = tenant.tokens_per_minute
    outputs = sum(n * call.params.max_tokens for call in calls if call.max_tokens_given)
    if budget is not None and outputs > budget:
        raise OpenAIError(
            400,
            f"this request may generate up to {outputs} tokens ({len(calls)} prompt(s) x n "
            f"{n} x max_tokens), more than your tokens_per_minute budget of {budget}; lower "
            "n, max_tokens or the number of prompts",
        )
    known = outputs + sum(len(call.prompt) for call in calls if isinstance(call.prompt, list))
    if budget is not None and known > budget:
        raise OpenAIError(
            400,
            f"this request's token-id prompts and outputs come to {known} tokens, more than "
            f"your tokens_per_minute budget of {budget}; send shorter or fewer prompts",
        )
    sequences = len(calls) * n
    limit = tenant.max_concurrent_requests
    if limit is not None and sequences > limit:
        raise OpenAIError(
            400,
            f"this request runs {sequences} sequences ({len(calls)} prompt(s) x n {n}), more "
            f"than your limit of {limit} concurrent requests; lower n or send fewer prompts",
        )


def _check_worst_case_fits_budget(tenant: Tenant, worst: int, started: list) -> None:
    """400 when every prompt fit alone but the batch's worst case (the sum over its
    prompts of prompt + n x max_tokens, as the model servers fitted them) exceeds the
    tenant's budget; the started calls are cancelled."""
    budget = tenant.tokens_per_minute
    if budget is None or worst <= budget:
        return
    for steps, _ in started:
        steps.cancel()
    raise OpenAIError(
        400,
        f"this request may use up to {worst} tokens over its prompts, more than your "
        f"tokens_per_minute budget of {budget}; lower n, max_tokens or the number of prompts",
    )


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    """Authenticates, routes by model name, applies tenant limits, streams responses."""

    def __init__(
        self,
        config: PlatformConfig,
        servers: list[DeploymentHandle],
        registry: DeploymentHandle | None = None,
    ) -> None:
        send_platform_logs_to_serve()
        self.registry = registry
        self.bases = [model.name for model in config.models]
        self.servers = dict(zip(self.bases, servers, strict=True))
        self.generate_handles = GenerateHandles(self.servers)
        self.tenants = Tenants(config.tenants, tuple(config.adapter_sources))
        self.catalog = AdapterCatalog(config.adapter_root, config.shared_adapters())
        self.fetching = AdapterFetching(config.adapter_fetch, self.catalog)
        set_gate_limit(config.ingress.max_ongoing_requests)
        self.limits = RateLimiter()
        self.operator_digests = frozenset(config.operator.key_digests())
        self.log_prompts = config.log_prompts
        self.first_token_timeout_s = config.ingress.first_token_timeout_s
        self.inter_token_timeout_s = config.ingress.inter_token_timeout_s
        self.cold_start_wait_s = {m.name: m.cold_start_wait_s for m in config.models}
        self.admission = {m.name: fleet_admission(m) for m in config.models}
        self.metrics = IngressMetrics()
        context = serve.get_replica_context()
        self.memory = ProcessMemory("ingress", context.replica_id.unique_id)
        self.readiness = ModelReadiness(
            context.app_name, {base: model_deployment_name(base) for base in self.bases}
        )
        self.validator = AdapterValidator(self.servers)
        self.direct_http = None
        if config.ingress.direct_http_port is not None:
            self.direct_http = DirectHTTP(
                app,
                config.ingress.direct_http_host,
                config.ingress.direct_http_port,
                config.ingress.graceful_shutdown_timeout_s,
            )
        self.frames = (
            FrameChannels(
                ray.util.get_node_ip_address(),
                self.metrics.record_frame,
                ray.get_runtime_context().get_node_id(),
            )
            if config.ingress.frame_channel
            else None
        )
        self._background: set[asyncio.Future] = set()
        """Fire-and-forget calls (adapter prefetches), held so they are not collected."""
        logger.info(
            "ingress ready: models=%s tenants=%d auth=%s adapter_root=%s",
            self.bases,
            len(config.tenants),
            "on" if self.tenants.auth_enabled else "off",
            config.adapter_root,
        )
        self.metrics_public = config.metrics_public
        if not self.tenants.auth_enabled:
            logger.warning(
                "AUTHENTICATION IS OFF (auth: none): anyone who reaches this port may use "
                "every model and register, unload and delete adapters"
            )

    async def __del__(self) -> None:
        """Serve's shutdown: the replica's own listener (if any) drains its streams."""
        direct_http = getattr(self, "direct_http", None)
        if direct_http is not None:
            await direct_http.aclose()

    def _tenant(self, request: Request) -> Tenant:
        try:
            return self.tenants.authenticate(request.headers.get("authorization"))
        except AuthError as exc:
            raise OpenAIError(401, str(exc), code="invalid_api_key") from None

    # ---- read-only endpoints -----------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        """Readiness: 200 while every base model can take a request now (a warm replica
        running, or scaled to zero on purpose), else 503 naming the models that cannot.
        Read from Serve's controller (deployments/readiness.py, at most 1 s old), never
        through a model's request queue, and never remembered: a model whose replicas
        all died is not ready until a replacement is warm."""
        states = await self.readiness.states()
        waiting = [base for base in self.bases if not states[base].ready]
        if waiting:
            return JSONResponse(
                {"status": "starting", "waiting_for": waiting},
                status_code=503,
                headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)},
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics(self, request: Request) -> PlainTextResponse:
        """This node's platform metrics (from Ray's metrics agent), Prometheus text."""
        hidden = self._hidden_metric_labels(request.headers.get("authorization"))
        # GCS and metrics-agent calls block: off the event loop that serves requests.
        try:
            text = await asyncio.to_thread(_node_metrics_text)
        except Exception as exc:
            logger.warning("reading this node's metrics agent failed: %r", exc)
            raise OpenAIError(
                503,
                "this node's metrics agent did not answer; retry later",
                code="metrics_unavailable",
                retry_after_s=OVERLOAD_RETRY_AFTER_S,
            ) from None
        return PlainTextResponse(
            render_prometheus(text, hidden), media_type="text/plain; version=0.0.4"
        )

    def _hidden_metric_labels(self, authorization: str | None) -> frozenset[str]:
        """401 without the operator key when one is configured; 403 when none is and
        the config does not say `metrics_public: true`; else the labels this caller may
        not see (tenant and adapter names, when tenants are configured)."""
        if self.operator_digests:
            self._require_operator(authorization, "/metrics")
            return frozenset()
        if not self.metrics_public:
            raise OpenAIError(
                403,
                "/metrics is private: configure an operator key (operator.api_key_sha256) "
                "or set metrics_public: true",
                code="metrics_private",
            )
        return TENANT_LABELS if self.tenants.auth_enabled else frozenset()

    def _require_operator(self, authorization: str | None, what: str) -> None:
        if bearer_digest(authorization) not in self.operator_digests:
            raise OpenAIError(401, f"{what} needs the operator's API key", code="invalid_api_key")

    # ---- operator API: chaos drills --------------------------------------------------------
    @app.post("/v1/admin/failpoints")
    async def arm_failpoint(self, request: Request) -> dict:
        """Arms a failpoint in every running replica of a model whose config sets
        `fault_injection: true` (403 otherwise); operator key only (none configured:
        401). Answers with the replicas armed."""
        self._require_operator(request.headers.get("authorization"), "/v1/admin/failpoints")
        body = await parse_body(request, ArmFailpointRequest)
        if body.model not in self.servers:
            raise OpenAIError(404, f"model {body.model!r} does not exist", code="model_not_found")
        armed = await self._on_every_replica(
            body.model, "arm_failpoint", body.name, body.prompt, body.times, body.delay_s
        )
        logger.warning("operator armed failpoint %s on %s: %s", body.name, body.model, armed)
        return {
            "object": "failpoint",
            "model": body.model,
            "name": body.name,
            "armed": True,
            "replicas": armed,
        }

    @app.delete("/v1/admin/failpoints/{model}")
    async def disarm_failpoints(self, model: str, request: Request) -> dict:
        """Disarms every failpoint in every running replica of `model`; operator key
        only."""
        self._require_operator(request.headers.get("authorization"), "/v1/admin/failpoints")
        if model not in self.servers:
            raise OpenAIError(404, f"model {model!r} does not exist", code="model_not_found")
        disarmed = await self._on_every_replica(model, "disarm_failpoints")
        return {"object": "failpoint", "model": model, "armed": False, "replicas": disarmed}

    # ---- operator API: sleep and wake --------------------------------------------------
    @app.post("/v1/admin/models/{model}/sleep")
    async def sleep_model(self, model: str, request: Request) -> dict:
        """Every running replica of `model` lets its open requests finish, then releases
        its KV cache and, on a GPU, moves its weights to host memory, until `wake`;
        meanwhile its requests get 503 `model_asleep`. Operator key only. 409 when a
        replica still had requests running after its drain."""
        self._require_operator(request.headers.get("authorization"), "sleep")
        return await self._sleep_or_wake(model, "sleep", asleep=True)

    @app.post("/v1/admin/models/{model}/wake")
    async def wake_model(self, model: str, request: Request) -> dict:
        """Undoes `sleep` on every running replica of `model`. Operator key only."""
        self._require_operator(request.headers.get("authorization"), "wake")
        return await self._sleep_or_wake(model, "wake_up", asleep=False)

    async def _sleep_or_wake(self, model: str, method: str, asleep: bool) -> dict:
        if model not in self.servers:
            raise OpenAIError(404, f"model {model!r} does not exist", code="model_not_found")
        try:
            replicas = await self._on_every_replica(model, method)
        except ValueError as exc:
            raise OpenAIError(409, f"model {model!r}: {exc}", code="sleep_refused") from None
        logger.warning("operator: model %s %s: %s", model, method, replicas)
        return {"object": "model_sleep", "model": model, "asleep": asleep, "replicas": replicas}

    async def _on_every_replica(self, model: str, method: str, *args: object) -> list[Any]:
        """Calls `method` on each RUNNING replica of `model` (the router pins each call
        by its `replica` keyword, deployments/request_router.py); the ids it reached.
        403 when the model refuses fault injection; 503 when it has no running replica
        or one did not answer within ADMIN_CALL_S."""
        replicas = (await self.readiness.state(model)).running_replicas
        if not replicas:
            raise OpenAIError(
                503,
                f"model {model!r} has no running replica",
                code="model_loading",
                retry_after_s=self.readiness.retry_after_s(model),
            )
        handle = getattr(self.servers[model], method)
        calls = [handle.remote(*args, replica=replica) for replica in replicas]
        try:
            reached = await asyncio.wait_for(
                asyncio.gather(*(_awaited(call) for call in calls)), ADMIN_CALL_S
            )
        except PermissionError:
            raise OpenAIError(403, f"fault injection is off for model {model!r}") from None
        except ValueError:
            raise  # a replica's refusal, for the caller to answer
        except OPERATOR_CALL_FAILURES as exc:
            logger.warning("%s on %s failed: %r", method, model, exc)
            raise OpenAIError(
                503,
                f"not every replica of model {model!r} answered; retry later",
                retry_after_s=OVERLOAD_RETRY_AFTER_S,
            ) from None
        missed = [r for r, got in zip(replicas, reached, strict=True) if got is None]
        if missed:
            raise OpenAIError(
                503,
                f"replicas {missed} of model {model!r} were not reached (replaced meanwhile?); "
                "retry",
                retry_after_s=1,
            )
        return list(reached)

    @app.get("/v1/admin/residency")
    async def residency(self, request: Request, model: str | None = None) -> dict:
        """Which replica holds which adapter in which tier (deployments/residency.py),
        per base model: each live replica's device and host tiers, its requests per
        adapter (since start, and over the demand window), and the disk tier (every
        adapter the catalog holds). Operator key only."""
        self._require_operator(request.headers.get("authorization"), "/v1/admin/residency")
        if model is not None and model not in self.servers:
            raise OpenAIError(404, f"model {model!r} does not exist", code="model_not_found")
        if self.registry is None:
            raise OpenAIError(503, "this app has no residency registry")
        try:
            replicas = await asyncio.wait_for(
                _awaited(self.registry.view.remote(model)), ADMIN_CALL_S
            )
        except OPERATOR_CALL_FAILURES as exc:
            logger.warning("residency view failed: %r", exc)
            raise OpenAIError(
                503,
                "the residency registry did not answer; retry later",
                code="registry_unavailable",
                retry_after_s=OVERLOAD_RETRY_AFTER_S,
            ) from None
        return {
            "object": "residency",
            "data": [
                {
                    "model": base,
                    "disk": self.catalog.model_ids(base),
                    "replicas": [r for r in replicas if r["model"] == base],
                }
                for base in self.bases
                if model is None or base == model
            ],
        }

    @app.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        tenant = self._tenant(request)
        cards = [ModelCard(id=b, root=b) for b in self.bases if tenant.may_use_base(b)]
        cards += [
            ModelCard(id=e.public_id, parent=e.base, root=e.base)
            for e in visible_adapters(tenant, self.bases, self.catalog)
        ]
        return ModelList(data=cards)

    # ---- tokenizer ---------------------------------------------------------------------
    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> dict:
        """A prompt's (or chat messages') token ids under the model's tokenizer; an
        adapter name tokenizes as its base model. Counts against the tenant's
        `tokenize_requests_per_minute` and holds one of its concurrent slots."""
        tenant = self._tenant(request)
        body = await parse_body(request, TokenizeRequest)
        route = resolve_model(tenant, body.model, self.bases, self.catalog)
        messages = [m.for_template() for m in body.messages] if body.messages else None
        return await self._ask_model_for(
            tenant,
            route.base,
            "tokenize",
            body.prompt,
            messages,
            body.add_special_tokens,
            body.add_generation_prompt,
        )

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict:
        """The text of token ids under the model's tokenizer; limited as tokenize."""
        tenant = self._tenant(request)
        body = await parse_body(request, DetokenizeRequest)
        route = resolve_model(tenant, body.model, self.bases, self.catalog)
        return await self._ask_model_for(tenant, route.base, "detokenize", body.tokens)

    async def _ask_model_for(self, tenant: Tenant, base: str, method: str, *args: object) -> dict:
        """`_ask_model` within the tenant's tokenize rate and concurrency."""
        try:
            self.limits.admit_call(tenant, "tokenize", tenant.tokenize_requests_per_minute)
        except RateLimited as exc:
            self.metrics.record(tenant.name, 429)
            raise OpenAIError(429, str(exc), retry_after_s=exc.retry_after_s) from None
        try:
            return await self._ask_model(base, method, *args)
        finally:
            self.limits.release_call(tenant)

    def _count_admin_call(self, tenant: Tenant) -> None:
        try:
            self.limits.count_call(tenant, "adapter admin", tenant.admin_requests_per_minute)
        except RateLimited as exc:
            self.metrics.record(tenant.name, 429)
            raise OpenAIError(429, str(exc), retry_after_s=exc.retry_after_s) from None

    async def _ask_model(self, base: str, method: str, *args: object) -> dict:
        """One call of a model deployment's plain (non-streaming) `method`; its
        GenerateError as an OpenAI error, an overloaded or failed replica as a 503."""
        request_id = new_id(method)
        try:
            result = await getattr(self.servers[base], method).remote(*args)
        except SERVE_REFUSALS as exc:
            raise serve_refusal(base, exc) from None
        except RayError as exc:
            raise replica_failed(base, request_id, exc) from None
        if isinstance(result, GenerateError):
            raise _generate_error(result)
        return result

    # ---- generation ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        received_at = time.time()
        tenant = self._tenant(request)
        body = await parse_body(request, CompletionRequest)
        params = self._params(body, body.max_tokens, body.logprobs)
        response_id = new_id("cmpl")
        prompts = body.prompts
        calls = [
            GenerateCall(
                request_id=batch_call_id(response_id, index, len(prompts)),
                params=params,
                prompt=prompt,
                max_tokens_given=body.max_tokens is not None,
                received_at=received_at,
                echo=body.echo,
            )
            for index, prompt in enumerate(prompts)
        ]
        return await self._respond(tenant, body, response_id, calls, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        received_at = time.time()
        tenant = self._tenant(request)
        body = await parse_body(request, ChatCompletionRequest)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        response_id = new_id("chatcmpl")
        tools = body.tool_calling()
        call = GenerateCall(
            request_id=response_id,
            params=self._params(body, body.requested_max_tokens, top if body.logprobs else None),
            messages=[m.for_template() for m in body.messages],
            max_tokens_given=body.requested_max_tokens is not None,
            received_at=received_at,
            tools=list(tools.tools) if tools is not None else None,
        )
        return await self._respond(tenant, body, response_id, [call], chat=True, tools=tools)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> JSONResponse:
        """One embedding per input, of the base model or of `base:adapter`, under the
        same tenant limits, admission and routing as a completion with one token."""
        received_at = time.time()
        tenant = self._tenant(request)
        body = await parse_body(request, EmbeddingRequest)
        response_id = new_id("embd")
        inputs = body.inputs
        calls = [
            GenerateCall(
                request_id=batch_call_id(response_id, index, len(inputs)),
                params=EMBEDDING_PARAMS,
                prompt=text,
                received_at=received_at,
                embed=True,
            )
            for index, text in enumerate(inputs)
        ]
        run = await self._start_calls(tenant, body.model, response_id, calls, 1)
        logger.info(
            "request %s tenant=%s model=%s embeddings=%d",
            response_id,
            tenant.name,
            body.model,
            len(calls),
            extra=PER_REQUEST,
        )
        steps = [first for _, first in run.started]
        prompt_tokens = sum(step.prompt_tokens for step in steps)
        try:
            for remaining, _ in run.started:
                async for extra in _within_inter_token_timeout(
                    remaining, self.inter_token_timeout_s, body.model
                ):
                    if isinstance(extra, GenerateError):
                        raise _generate_error(extra)
        except RayError as exc:
            raise replica_failed(run.route.base, response_id, exc) from None
        finally:
            run.admission.finish(response_id)
            self.limits.release(tenant, prompt_tokens, run.reserved, len(calls))
            self._record_usage(tenant)
            self.metrics.record(tenant.name, 200, prompt_tokens, 0)
        return JSONResponse(embedding_list(body.model, steps, body.encoding_format).model_dump())

    @staticmethod
    def _params(body: SamplingFields, max_tokens: int | None, logprobs: int | None):
        try:
            return body.sampling_params(max_tokens or DEFAULT_MAX_TOKENS, logprobs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from None

    async def _respond(
        self,
        tenant: Tenant,
        body: SamplingFields,
        response_id: str,
        calls: list[GenerateCall],
        chat: bool,
        tools: ToolCalling | None = None,
    ) -> Response:
        """Runs `calls` (one per prompt of the request) on the model `body.model` names;
        answers with their choices in one body or one stream, prompt i's completions at
        indices i*n .. i*n+n-1 (a chat's tool calls read back as `tools` asks)."""
        n = body.n
        sequences = len(calls) * n
        run = await self._start_calls(tenant, body.model, response_id, calls, n)
        accumulators = [
            ChoiceAccumulator(
                response_id,
                body.model,
                chat,
                n,
                first_index=i * n,
                tools=tools,
                echo_logprobs=body.echo_logprobs,
            )
            for i in range(len(calls))
        ]
        reserved, admission, started = run.reserved, run.admission, run.started
        logger.info(
            "request %s tenant=%s model=%s stream=%s prompts=%d",
            response_id,
            tenant.name,
            body.model,
            body.stream,
            len(calls),
            extra=PER_REQUEST,
        )
        if self.log_prompts:
            for call in run.calls:
                logger.info(
                    "request %s prompt: %r",
                    call.request_id,
                    call.messages or call.prompt,
                    extra=PER_REQUEST,
                )
        streams = [
            (accumulator, first, steps)
            for accumulator, (steps, first) in zip(accumulators, started, strict=True)
        ]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            end = _StreamEnd(
                lambda: self._finish(tenant, accumulators, reserved, sequences, admission)
            )
            for _, _, steps in streams:
                end.cancels(steps)
            return ClosingStreamingResponse(
                self._stream(streams, include_usage, end),
                end,
                media_type="text/event-stream",
            )
        try:
            await _collect_all(streams, self.inter_token_timeout_s)
        except RayError as exc:
            raise replica_failed(run.route.base, response_id, exc) from None
        finally:
            self._finish(tenant, accumulators, reserved, sequences, admission)
        return JSONResponse(batch_body(accumulators))

    async def _start_calls(
        self, tenant: Tenant, model: str, response_id: str, calls: list[GenerateCall], n: int
    ) -> StartedCalls:
        """Everything before a request's calls stream: the route `model` names, the
        calls carrying the tenant, the tenant's limits (400 for what can never pass, 429
        over its rate), the fleet's admission (503), then every call started and the
        tenant's reservation settled to the batch's worst case; undone on failure."""
        route = resolve_model(tenant, model, self.bases, self.catalog)
        calls = [
            dataclasses.replace(
                call,
                tenant=tenant.name,
                tenant_weight=tenant.weight,
                adapter=route.adapter.public_id if route.adapter else None,
                max_request_tokens=tenant.tokens_per_minute,
                cache_salt=tenant.name if self.tenants.auth_enabled else None,
            )
            for call in calls
        ]
        sequences = len(calls) * n
        _check_fits_tenant(tenant, calls, n)
        estimate = sum(prompt_tokens_estimate(c) + n * c.params.max_tokens for c in calls)
        try:
            reserved = self.limits.admit(tenant, estimate, sequences)
        except RateLimited as exc:
            self.metrics.record(tenant.name, 429)
            raise OpenAIError(429, str(exc), retry_after_s=exc.retry_after_s) from None
        try:
            await self._admit(route.base, tenant, response_id, sequences)
        except BaseException:
            self.limits.release(tenant, 0, reserved, sequences)
            raise
        self._record_usage(tenant)
        admission = self.admission[route.base]
        try:
            started = await self._start_all(route, calls)
            worst = sum(first.worst_case_tokens for _, first in started)
            _check_worst_case_fits_budget(tenant, worst, started)
        except BaseException:
            admission.finish(response_id)
            self.limits.release(tenant, 0, reserved, sequences)
            self._record_usage(tenant)
            raise
        admission.started(response_id)
        reserved = self.limits.settle(tenant, reserved, worst)
        self._record_usage(tenant)
        return StartedCalls(route, calls, started, reserved, admission)

    async def _admit(self, base: str, tenant: Tenant, response_id: str, sequences: int) -> None:
        """The ingress's own admission estimate over `base`'s running replicas
        (admission.FleetAdmission): 503 `overloaded` at once, before any call to the
        model, for a request they could not start within `admission_max_wait_s`. During
        a cold start (no running replica) nothing is refused here."""
        state = await self.readiness.latest(base)
        admission = self.admission[base]
        admission.set_replicas(state.running)
        refusal = admission.admit(
            response_id, sequences, tenant.name, tenant.weight, serving=state.running > 0
        )
        if refusal is None:
            return
        self.metrics.record(tenant.name, 503)
        raise OpenAIError(
            503,
            refusal.message,
            code="overloaded",
            retry_after_s=refusal.retry_after_s,
            refusing_for_s=admission.refusing_for_s(tenant.name, tenant.weight),
        )

    async def _start_all(self, route: Route, calls: list[GenerateCall]):
        """`_start` for every call at once; when one fails, the others are cancelled and
        its error is raised."""
        if len(calls) == 1:
            return [await self._start(route, calls[0])]
        results = await asyncio.gather(
            *(self._start(route, call) for call in calls), return_exceptions=True
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return results
        for result in results:
            if not isinstance(result, BaseException):
                result[0].cancel()
        raise failure

    async def _start(self, route: Route, call: GenerateCall, resends: int = REPLACED_RESENDS):
        """Calls the model deployment; returns (response stream, its first step). A call
        whose adapter version was replaced between its routing and its replica (an
        update, an unload) is sent again with the catalog's current version, up to
        `resends` times."""
        generate = self.generate_handles(route.base, route.model_id)
        if self.frames is None:
            steps = generate.remote(call)
        else:
            key = self.frames.new_key()
            framed = dataclasses.replace(call, frames_to=await self.frames.address(), frame_key=key)
            steps = self.frames.steps(key, generate.remote(framed))
        try:
            first = await self._first_step(route.base, call.request_id, steps)
        except SERVE_REFUSALS as exc:
            raise serve_refusal(route.base, exc) from None
        except RayError as exc:
            raise replica_failed(route.base, call.request_id, exc) from None
        if isinstance(first, GenerateError):
            replaced = first.code == ADAPTER_REPLACED and resends > 0
            current = self._current_version(route) if replaced else None
            if current is None:
                raise _generate_error(first)
            logger.info(
                "request %s: adapter %s replaced meanwhile; sent again as %s",
                call.request_id,
                route.model_id,
                current.model_id,
            )
            return await self._start(current, call, resends - 1)
        return steps, first

    def _current_version(self, route: Route) -> Route | None:
        """`route` with its adapter's current catalog version, None when the adapter
        is gone or still at the same version."""
        entry = route.adapter
        if entry is None:
            return None
        try:
            self.catalog.reread()
            current = self.catalog.find(entry.owner, entry.base, entry.name)
        except CatalogError:
            return None
        if current is None or current.model_id == entry.model_id:
            return None
        return dataclasses.replace(route, adapter=current)

    async def _first_step(self, base: str, request_id: str, steps) -> StreamStep | GenerateError:
        """The call's first step. While the model has no running replica but one is
        starting (a cold start), the request waits for it up to the model's
        `cold_start_wait_s`, then gets 503 `model_loading` with the replica's measured
        start time as Retry-After. Once a replica runs, it has `first_token_timeout_s`
        (from when the model became ready) before a 503 `overloaded`."""
        pending = asyncio.ensure_future(anext(aiter(steps)))
        started = time.monotonic()
        ready_since = started
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=FIRST_STEP_POLL_S)
                if done:
                    return pending.result()
                now = time.monotonic()
                state = await self.readiness.state(base)
                if state.loading:
                    ready_since = now
                    if now - started < self.cold_start_wait_s[base]:
                        continue
                    retry = self.readiness.retry_after_s(base)
                    logger.warning(
                        "request %s: model %s still loading after %.0f s, answered 503",
                        request_id,
                        base,
                        now - started,
                    )
                    raise OpenAIError(
                        503,
                        f"model {base!r} is loading (a replica is starting); retry in about "
                        f"{retry} s",
                        code="model_loading",
                        retry_after_s=retry,
                    )
                if now - ready_since < self.first_token_timeout_s:
                    continue
                logger.warning(
                    "request %s: no first token from %s within %.0f s, answered 503",
                    request_id,
                    base,
                    self.first_token_timeout_s,
                )
                raise OpenAIError(
                    503,
                    f"model {base!r} is overloaded: no capacity within "
                    f"{self.first_token_timeout_s:g} s, retry later",
                    code="overloaded",
                    retry_after_s=OVERLOAD_RETRY_AFTER_S,
                )
        except BaseException:
            if not pending.done():
                pending.cancel()
            steps.cancel()
            raise

    def _finish(
        self,
        tenant: Tenant,
        accumulators: list[ChoiceAccumulator],
        reserved: int,
        sequences: int,
        admission: FleetAdmission,
    ) -> None:
        admission.finish(accumulators[0].request_id)
        prompt_tokens = sum(a.prompt_tokens for a in accumulators)
        output_tokens = sum(sum(a.completion_tokens) for a in accumulators)
        self.limits.release(tenant, prompt_tokens + output_tokens, reserved, sequences)
        self._record_usage(tenant)
        self.metrics.record(tenant.name, 200, prompt_tokens, output_tokens)

    def _record_usage(self, tenant: Tenant) -> None:
        in_flight, reserved = self.limits.in_use(tenant)
        self.metrics.record_usage(tenant.name, in_flight, reserved)

    async def _stream(
        self,
        streams: list[tuple[ChoiceAccumulator, StreamStep, Any]],
        include_usage: bool,
        end: _StreamEnd,
    ) -> AsyncIterator[str]:
        started = time.monotonic()
        accumulators = [accumulator for accumulator, _, _ in streams]
        head = accumulators[0]
        finished = False
        completed = False
        try:
            for accumulator, first, _ in streams:
                for chunk in accumulator.chunks(first):
                    yield sse(chunk)
            async for accumulator, step in _interleaved(streams, self.inter_token_timeout_s):
                if isinstance(step, GenerateError):
                    yield _error_event(_generate_error(step))
                    finished = True
                    return
                for chunk in accumulator.chunks(step):
                    yield sse(chunk)
            if include_usage:
                yield sse(usage_chunk(accumulators))
            yield "data: [DONE]\n\n"
            finished = completed = True
        except RayError as exc:
            # Headers are gone: the failure becomes an OpenAI error event, which the SDK
            # raises as an APIError, and the stream ends.
            yield _error_event(replica_failed(head.model, head.request_id, exc))
            finished = True
        except OpenAIError as exc:
            logger.warning("request %s: %s", head.request_id, exc.message)
            yield _error_event(exc)
            finished = True
        finally:
            if not finished:
                logger.info(
                    "request %s: client went away, aborted", head.request_id, extra=PER_REQUEST
                )
            end.run(cancel=not completed)
        logger.info(
            "request %s streamed in %.2fs",
            head.request_id,
            time.monotonic() - started,
            extra=PER_REQUEST,
        )

    # ---- admin API: a tenant's own adapters -----------------------------------------------
    @app.get("/v1/adapters")
    async def list_adapters(self, request: Request) -> AdapterList:
        tenant = self._tenant(request)
        return AdapterList(data=[_card(e) for e in self.catalog.tenant_entries(tenant.name)])

    @app.post("/v1/adapters", status_code=201)
    async def register_adapter(self, request: Request) -> AdapterCard:
        """Fetches the adapter when it is named by URI (adapter_fetching.py), validates
        its folder in this process (adapter_validation.py, off the model's request
        path), records it in the catalog and warms it on one replica. Counts against
        the tenant's `admin_requests_per_minute`."""
        tenant = self._tenant(request)
        body = await parse_body(request, RegisterAdapterRequest)
        self._check_base(tenant, body.model)
        self._count_admin_call(tenant)
        return await self._record_adapter(tenant, body.model, body.name, body, replace=False)

    @app.put("/v1/adapters/{model}/{name}")
    async def update_adapter(self, model: str, name: str, request: Request) -> AdapterCard:
        """New files for an existing adapter: a new version under the same name. Requests
        already running finish on the old version; later ones get the new one."""
        tenant = self._tenant(request)
        body = await parse_body(request, AdapterFiles)
        self._check_base(tenant, model)
        self._count_admin_call(tenant)
        return await self._record_adapter(tenant, model, name, body, replace=True)

    async def push_adapter(
        self,
        tenant_name: str,
        base: str,
        name: str,
        weights: dict[str, Any],
        config: dict[str, Any],
    ) -> dict[str, Any]:
        """A trainer's push (deployments/trainer.py, through a Serve handle, no HTTP):
        the tensors as numpy arrays from Ray's object store and the PEFT config, written
        into the tenant's content-addressed folders and registered as `base:name` (a new
        version when the name exists) after the usual validation. Returns the card;
        AdapterPushRefused with the status a registration would have got."""
        tenant = self.tenants.named(tenant_name)
        try:
            if tenant is None:
                raise OpenAIError(404, f"no tenant {tenant_name!r}")
            self._check_base(tenant, base)
            files = adapter_files(weights, config, self.fetching.fetcher.limits.max_bytes)
            root = self.catalog.tenant_root(tenant.name)
            stored = await asyncio.to_thread(store_files, root, files)
            card = await self._record_adapter(
                tenant, base, name, AdapterFiles(path=stored.relative), False, PUSHED_SOURCE
            )
        except OpenAIError as exc:
            raise AdapterPushRefused(exc.status, exc.message) from None
        logger.info("tenant %s pushed adapter %s:%s (v%d)", tenant_name, base, name, card.version)
        return card.model_dump()

    async def _record_adapter(
        self,
        tenant: Tenant,
        base: str,
        name: str,
        files: AdapterFiles,
        replace: bool,
        source: str | None = None,
    ) -> AdapterCard:
        relative = files.path
        if files.uri is not None:
            fetched, source = await self.fetching.fetch(tenant, files.uri)
            relative = fetched.relative
        try:
            folder = self.catalog.checked_folder(tenant.name, relative)
        except CatalogError as exc:
            raise _catalog_error(exc) from None
        await self.validator.check(base, folder, self.catalog.tenant_root(tenant.name))
        try:
            entry = await asyncio.to_thread(
                self.catalog.register,
                tenant.name,
                base,
                name,
                relative,
                tenant.max_adapters,
                source,
                replace,
            )
        except CatalogError as exc:
            raise _catalog_error(exc) from None
        self._prefetch(base, entry.model_id)
        if source is not None:
            self._in_background(self.fetching.evict())
        return _card(entry)

    def _prefetch(self, base: str, model_id: str) -> None:
        """Warms a newly registered adapter on one replica in the background (host
        memory; the router then sends its first request there). Fire and forget: a
        failed prefetch only means the first request loads it."""
        handle = self.servers[base].options(multiplexed_model_id=model_id)
        response = handle.prefetch_adapter.remote()
        self._in_background(_settle_prefetch(response, model_id))

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @app.post("/v1/adapters/{model}/{name}/unload")
    async def unload_adapter(self, model: str, name: str, request: Request) -> AdapterCard:
        tenant = self._tenant(request)
        self._check_base(tenant, model)
        self._count_admin_call(tenant)
        try:
            return _card(await asyncio.to_thread(self.catalog.unload, tenant.name, model, name))
        except CatalogError as exc:
            raise _catalog_error(exc) from None

    @app.delete("/v1/adapters/{model}/{name}")
    async def delete_adapter(self, model: str, name: str, request: Request) -> dict:
        tenant = self._tenant(request)
        self._check_base(tenant, model)
        self._count_admin_call(tenant)
        try:
            await asyncio.to_thread(self.catalog.delete, tenant.name, model, name)
        except CatalogError as exc:
            raise _catalog_error(exc) from None
        return {"id": f"{model}:{name}", "object": "adapter", "deleted": True}

    def _check_base(self, tenant: Tenant, base: str) -> None:
        if base not in self.servers:
            raise OpenAIError(404, f"model {base!r} does not exist", code="model_not_found")
        if not tenant.may_use_base(base):
            raise OpenAIError(403, f"you may not use model {base!r}", code="model_not_allowed")
