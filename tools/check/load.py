"""The load suite: open-loop (Poisson) arrivals at multiples of the app's measured
capacity, mixed models and adapters, streamed and not, while `/health` is probed.

Capacity is measured first: requests/s of a closed loop at the given concurrency. Each
phase then sends at `multiple x capacity` for its duration, whatever the app answers
(open loop: a slow app does not slow the arrivals). Under overload the only allowed
answers are 200, 429 and 503, each 429/503 with `Retry-After`; a request still without
an answer at its deadline has hung, and a stream ending without `[DONE]` or an error
event is torn, and a 429/503 whose body is not OpenAI error JSON (the HTTP proxy's own
plain-text refusal) is unexpected. `/health` latency percentiles show whether the
ingress stays responsive.

Goodput is what the app got done: complete answers (a 200 whose body or stream ended
in full, not in an error event) per second of the level, shown beside its ratio to the
first level's, with the median time a refusal took to come back (cheap refusals leave
the engine its CPU).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from loraplex.tools.check.probes import metric_sums
from loraplex.tools.check.soak import request_body

ALLOWED = (200, 429, 503)
HEALTH_PERIOD_S = 0.25
MEMORY_METRIC = "loraplex_process_resident_memory_bytes"
PROXY_REFUSALS_METRIC = "loraplex_proxy_refusals_total"
"""503s the HTTP proxy answered from the ingress's refusal window (proxy_middleware.py)."""
MEMORY_EXPORT_S = 6.0
"""Replicas refresh the gauge every 2 s and Ray exports it every few seconds."""


@dataclass(frozen=True)
class LoadPlan:
    models: tuple[str, ...]
    multiples: tuple[float, ...] = (1.0, 2.0, 4.0)
    phase_s: float = 60.0
    deadline_s: float = 60.0
    """A request without a complete answer after this long has hung."""
    calibration_requests: int = 128
    concurrency: int = 64
    """Of the calibration's closed loop: enough to fill the engine's batch, so the
    measured capacity is its throughput, not one client's latency."""
    output_tokens: tuple[int, int] = (16, 64)
    """Each request generates between these many tokens (`ignore_eos`): enough decode
    work that the engine, not the HTTP path, bounds capacity, as with real models. With
    a tiny model and a few tokens per request, capacity would be what the proxy and the
    ingress parse per second, and 4x that would overload the HTTP front itself, which
    no server behind it can shed."""
    seed: int = 0
    operator_key: str | None = None
    """Reads each component's resident memory from /metrics after every level (None:
    memory is not followed)."""
    drain_s: float = 10.0
    """Idle time after the last level before memory is read once more."""


@dataclass
class Phase:
    multiple: float
    rate: float
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    without_retry_after: int = 0
    hung: int = 0
    torn: int = 0
    unexpected: list[str] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    completed: int = 0
    """Complete answers (200 with the whole body, or a stream to `[DONE]`)."""
    refusal_ms: list[float] = field(default_factory=list)
    """How long each 429/503 took to come back."""
    phase_s: float = 0.0
    client_cpu_s: float = 0.0
    """CPU seconds this load generator used in the level (it shares the machine)."""
    memory_mib: dict[str, float] = field(default_factory=dict)
    """Resident memory per component (summed over its replicas) at the level's end."""
    proxy_refusals: float | None = None
    """Of the level's 503s, those the HTTP proxy answered (None: no operator key)."""

    def health_p(self, q: float) -> float:
        return _percentile(self.health_ms, q)

    @property
    def goodput_rps(self) -> float:
        return self.completed / self.phase_s if self.phase_s > 0 else 0.0

    def row(self, first_goodput_rps: float) -> str:
        statuses = ", ".join(
            f"{s}: {n}" for s, n in sorted(self.statuses.items(), key=lambda item: str(item[0]))
        )
        ratio = self.goodput_rps / first_goodput_rps if first_goodput_rps > 0 else float("nan")
        return (
            f"| {self.multiple:g}x | {self.rate:.1f} | {self.sent} | {statuses} | "
            f"{self.goodput_rps:.2f} ({ratio:.2f}x) | {_percentile(self.refusal_ms, 0.5):.0f} | "
            f"{self.client_cpu_s / self.phase_s if self.phase_s else 0.0:.2f} | "
            f"{self.without_retry_after} | {self.hung} | {self.torn} | "
            f"{self.health_p(0.5):.0f} / {self.health_p(0.99):.0f} | "
            f"{'-' if self.proxy_refusals is None else f'{self.proxy_refusals:.0f}'} | "
            f"{format_memory(self.memory_mib)} |"
        )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def format_memory(memory_mib: dict[str, float]) -> str:
    return ", ".join(f"{name} {mib:.0f}" for name, mib in sorted(memory_mib.items())) or "-"


@dataclass
class LoadReport:
    capacity_rps: float = 0.0
    phases: list[Phase] = field(default_factory=list)
    memory_before_mib: dict[str, float] = field(default_factory=dict)
    """After calibration, before the first level."""
    memory_idle_mib: dict[str, float] = field(default_factory=dict)
    """After the last level and `drain_s` of idle."""

    @property
    def failures(self) -> list[str]:
        return [f"{p.multiple:g}x: {u}" for p in self.phases for u in p.unexpected]

    def table(self) -> str:
        head = (
            "| load | req/s | sent | statuses | goodput req/s (of the first level's) | "
            "refusal p50 ms | client CPUs | 429/503 without Retry-After | hung | torn | "
            "/health p50 / p99 ms | 503s from the proxy | resident MiB at the end |\n"
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"
        )
        first = self.phases[0].goodput_rps if self.phases else 0.0
        rows = "\n".join(p.row(first) for p in self.phases)
        return (
            f"capacity {self.capacity_rps:.2f} req/s\n{head}\n{rows}\n"
            f"resident MiB before the first level: {format_memory(self.memory_before_mib)}; "
            f"idle after the last: {format_memory(self.memory_idle_mib)}"
        )


async def _send(session: aiohttp.ClientSession, url: str, body_of, phase: Phase | None) -> bool:
    """One request to completion; records it in `phase` (None: calibration). True when
    it got a complete 200."""
    path, body = body_of()
    what = f"{path} {json.dumps(body)[:300]}"
    started = time.monotonic()
    try:
        async with session.post(url + path, json=body) as response:
            status = response.status
            if status != 200:
                payload = await response.read()
                if phase is not None:
                    _judge_refusal(phase, status, response.headers, payload, what, started)
                return False
            if phase is not None:
                phase.statuses[status] += 1
            if not body["stream"]:
                await response.read()
                return _complete(phase)
            last = b""
            async for line in response.content:
                if line.strip():
                    last = line.strip()
            if last == b"data: [DONE]":
                return _complete(phase)
            if b'"error"' not in last and phase is not None:
                phase.torn += 1
                phase.unexpected.append(f"torn stream (last {last[:80]!r}) <- {what}")
            return False
    except asyncio.TimeoutError:
        if phase is not None:
            phase.hung += 1
            phase.unexpected.append(f"no answer within the deadline <- {what}")
        return False
    except aiohttp.ClientError as exc:
        if phase is not None:
            phase.statuses["no answer"] += 1
            phase.unexpected.append(f"no answer ({exc!r}) <- {what}")
        return False


def _complete(phase: Phase | None) -> bool:
    if phase is not None:
        phase.completed += 1
    return True


def _judge_refusal(
    phase: Phase, status: int, headers, payload: bytes, what: str, started: float
) -> None:
    """Books a non-200 answer: only 429 and 503 may come back, with Retry-After and an
    OpenAI error body."""
    phase.statuses[status] += 1
    if status not in ALLOWED:
        phase.unexpected.append(f"status {status} {payload[:200]!r} <- {what}")
        return
    phase.refusal_ms.append((time.monotonic() - started) * 1e3)
    if "Retry-After" not in headers:
        phase.without_retry_after += 1
        phase.unexpected.append(f"{status} without Retry-After <- {what}")
    if not _is_openai_error(payload):
        phase.unexpected.append(f"{status} not in OpenAI error JSON {payload[:120]!r} <- {what}")


def _is_openai_error(payload: bytes) -> bool:
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and "message" in error


async def _calibrate(session, url: str, plan: LoadPlan, body_of) -> float:
    """Complete answers per second of a closed loop (a refused request is not served
    capacity, however fast its 503 came back)."""
    gate = asyncio.Semaphore(plan.concurrency)

    async def one() -> bool:
        async with gate:
            return await _send(session, url, body_of, None)

    started = time.monotonic()
    answered = await asyncio.gather(*(one() for _ in range(plan.calibration_requests)))
    return sum(answered) / (time.monotonic() - started)


async def _probe_health(session, url: str, phase: Phase, stop: asyncio.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            async with session.get(url + "/health") as response:
                await response.read()
            phase.health_ms.append((time.monotonic() - started) * 1e3)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            phase.unexpected.append(f"/health gave no answer ({exc!r})")
        await asyncio.sleep(HEALTH_PERIOD_S)


async def _phase(session, url: str, plan: LoadPlan, phase: Phase, body_of, rng) -> None:
    stop = asyncio.Event()
    health = asyncio.create_task(_probe_health(session, url, phase, stop))
    tasks = []
    phase.phase_s = plan.phase_s
    cpu_at_start = time.process_time()
    end = time.monotonic() + plan.phase_s
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(_send(session, url, body_of, phase)))
        phase.sent += 1
        await asyncio.sleep(rng.expovariate(phase.rate))
    await asyncio.gather(*tasks)
    phase.client_cpu_s = time.process_time() - cpu_at_start
    stop.set()
    await health


async def _run(url: str, api_key: str, plan: LoadPlan, progress) -> LoadReport:
    rng = random.Random(plan.seed)
    prefixes = [" ".join(f"w{(7 * p + i) % 50}" for i in range(40)) for p in range(4)]

    def body_of() -> tuple[str, dict]:
        path, body = request_body(rng, rng.choice(plan.models), prefixes)
        low, high = plan.output_tokens
        return path, {**body, "max_tokens": rng.randint(low, high), "ignore_eos": True}

    report = LoadReport()
    timeout = aiohttp.ClientTimeout(total=plan.deadline_s)
    headers = {"Authorization": f"Bearer {api_key}"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as s:
        progress("calibrating")
        report.capacity_rps = await _calibrate(s, url, plan, body_of)
        report.memory_before_mib, proxy_refusals = await _sample(url, plan)
        for multiple in plan.multiples:
            phase = Phase(multiple, multiple * report.capacity_rps)
            progress(f"{multiple:g}x at {phase.rate:.1f} req/s for {plan.phase_s:.0f} s")
            await _phase(s, url, plan, phase, body_of, rng)
            phase.memory_mib, refusals_after = await _sample(url, plan)
            if proxy_refusals is not None and refusals_after is not None:
                phase.proxy_refusals = refusals_after - proxy_refusals
            proxy_refusals = refusals_after
            report.phases.append(phase)
            await asyncio.sleep(2.0)  # let the queue drain between phases
        await asyncio.sleep(plan.drain_s)
        report.memory_idle_mib, _ = await _sample(url, plan)
    return report


async def _sample(url: str, plan: LoadPlan) -> tuple[dict[str, float], float | None]:
    """Each component's resident MiB and the proxy's refusals so far, from /metrics
    (nothing without an operator key)."""
    if plan.operator_key is None:
        return {}, None
    await asyncio.sleep(MEMORY_EXPORT_S)
    by_component = await asyncio.to_thread(
        metric_sums, url, plan.operator_key, (MEMORY_METRIC,), "component"
    )
    refusals = await asyncio.to_thread(
        metric_sums, url, plan.operator_key, (PROXY_REFUSALS_METRIC,)
    )
    memory = {component: value / 2**20 for component, value in by_component.items()}
    return memory, refusals[PROXY_REFUSALS_METRIC]


def run_load(
    url: str, api_key: str, plan: LoadPlan, progress: Callable[[str], None] = lambda _: None
) -> LoadReport:
    return asyncio.run(_run(url, api_key, plan, progress))
