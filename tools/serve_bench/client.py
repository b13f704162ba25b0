"""Sends a workload to an OpenAI-compatible `/v1/completions` over aiohttp and times it.

Each request records when it was sent, when each streamed chunk with text arrived,
when it ended, how many tokens it generated (the server's `usage`, asked for with
`stream_options.include_usage`; chunks counted when a server sends none) and how it
failed, if it did: the HTTP status, `Retry-After`, the error message, or a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from tqdm.auto import tqdm

from loraplex.tools.serve_bench.workload import BenchRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientOptions:
    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (the client adds /v1/completions)."""
    api_key: str | None = None
    max_concurrency: int = 64
    stream: bool = True
    ignore_eos: bool = True
    """Ask for exactly output_len tokens (the vLLM extension `ignore_eos`)."""
    timeout_s: float = 600.0
    """Per-request deadline; a request past it is a failure ('timeout')."""


@dataclass
class RequestRecord:
    """What happened to one request; times are seconds from the burst's start."""

    index: int
    model: str
    prompt_len: int | None
    sent_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)
    """Arrival of each chunk that carried text (or, without streaming, the body)."""
    end_s: float = 0.0
    output_tokens: int = 0
    status: int = 0
    error: str | None = None
    retry_after: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)


def request_body(request: BenchRequest, options: ClientOptions) -> dict:
    body = {
        "model": request.model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": options.stream,
    }
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord, t0: float) -> None:
    chunks = 0
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        payload = json.loads(data)
        if "error" in payload:
            record.error = str(payload["error"].get("message", payload["error"]))
            return
        if any(choice.get("text") for choice in payload.get("choices", ())):
            record.chunk_s.append(time.perf_counter() - t0)
            chunks += 1
        usage = payload.get("usage")
        if usage:
            record.output_tokens = int(usage["completion_tokens"])
    if not record.output_tokens:
        record.output_tokens = chunks


async def send_one(
    session: aiohttp.ClientSession,
    request: BenchRequest,
    options: ClientOptions,
    t0: float,
) -> RequestRecord:
    """Sends one request now; never raises (failures are recorded)."""
    record = RequestRecord(request.index, request.model, request.prompt_len)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    url = f"{options.base_url.rstrip('/')}/v1/completions"
    record.sent_s = time.perf_counter() - t0

    async def exchange() -> None:
        async with session.post(
            url, json=request_body(request, options), headers=headers
        ) as response:
            record.status = response.status
            record.retry_after = response.headers.get("Retry-After")
            if response.status != 200:
                record.error = _error_message(await response.text())
            elif options.stream:
                await _read_stream(response, record, t0)
            else:
                body = await response.json()
                record.chunk_s.append(time.perf_counter() - t0)
                record.output_tokens = int(body["usage"]["completion_tokens"])

    try:
        await asyncio.wait_for(exchange(), options.timeout_s)
    except asyncio.TimeoutError:
        record.error = "timeout"
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_s = time.perf_counter() - t0
    return record


async def run_burst(
    requests: Sequence[BenchRequest], options: ClientOptions, desc: str = "requests"
) -> list[RequestRecord]:
    """Sends every request at its `send_at_s`, at most `max_concurrency` in flight;
    returns the records in request order."""
    semaphore = asyncio.Semaphore(options.max_concurrency)
    connector = aiohttp.TCPConnector(limit=options.max_concurrency, force_close=False)
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        t0 = time.perf_counter()

        async def one(request: BenchRequest) -> RequestRecord:
            delay = request.send_at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:
                record = await send_one(session, request, options, t0)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(request) for request in requests))
    bar.close()
    failed = [r for r in records if not r.ok]
    if failed:
        logger.warning(
            "%d of %d requests failed; first: %s", len(failed), len(records), failed[0].error
        )
    return list(records)
