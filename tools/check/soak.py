"""The soak suite: thousands of mixed requests against a running app with random client
aborts, shared prompt prefixes (prefix-cache hits) and adapter churn (a tenant
registering, calling, unloading and deleting adapters during the traffic); then, once
the app is idle, its invariants through `/metrics` (operator key): nothing running or
waiting, no KV block in use, every tenant's in-flight count and token reservation back
to zero.

Every answer is judged by verdict.py; a stream that ends without `[DONE]` or an error
event, unless the client aborted it, is torn and counts as unexpected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from loraplex.tools.check.probes import metric_sums
from loraplex.tools.check.verdict import judge

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0
IDLE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "loraplex_tenant_requests_in_flight",
    "loraplex_tenant_tokens_reserved",
)
"""What must read 0 (summed over replicas and tenants) once the app is idle."""
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class SoakPlan:
    num_requests: int
    concurrency: int
    models: tuple[str, ...]
    """Model ids the key may call (`base`, `base:adapter`)."""
    abort_fraction: float = 0.15
    churn_base: str | None = None
    """Base model of the churned adapters (None: no churn)."""
    churn_path: str | None = None
    """An adapter folder under the tenant's root that churn registers under new names."""
    seed: int = 0


@dataclass
class SoakReport:
    sent: int = 0
    aborted: int = 0
    statuses: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    churn: Counter = field(default_factory=Counter)
    """Adapter churn calls by 'verb status'."""
    idle_gauges: dict[str, float] = field(default_factory=dict)
    preemptions: float = 0.0
    """`vllm:num_preemptions_total` over the app's replicas once idle (KV pressure)."""
    elapsed_s: float = 0.0

    def summary(self) -> str:
        statuses = ", ".join(
            f"{s}: {n}" for s, n in sorted(self.statuses.items(), key=lambda item: str(item[0]))
        )
        churn = ", ".join(f"{k}: {n}" for k, n in sorted(self.churn.items()))
        gauges = ", ".join(f"{k} = {v:g}" for k, v in self.idle_gauges.items())
        return (
            f"{self.sent} requests in {self.elapsed_s:.0f} s, {self.aborted} aborted by the "
            f"client ({self.aborted / max(self.sent, 1):.0%}); statuses {statuses}; "
            f"unexpected {len(self.unexpected)}\nadapter churn: {churn}\n"
            f"preemptions (whole app, since start): {self.preemptions:g}\nidle: {gauges}"
        )


def request_body(rng: random.Random, model: str, prefixes: list[str]) -> tuple[str, dict]:
    """(path, body) of one random request over one of the shared `prefixes`: completion
    or chat, streamed or not, greedy or seeded, 1-11 tokens, now and then n=2."""
    prompt = f"{rng.choice(prefixes)} " + " ".join(
        f"w{rng.randrange(1, 50)}" for _ in range(rng.randrange(1, 20))
    )
    fields = {
        "model": model,
        "max_tokens": rng.randrange(1, 12),
        "stream": rng.random() < 0.6,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1000),
        "n": 2 if rng.random() < 0.05 else 1,
    }
    if rng.random() < 0.6:
        return "/v1/completions", {**fields, "prompt": prompt}
    return "/v1/chat/completions", {**fields, "messages": [{"role": "user", "content": prompt}]}


class Soak:
    def __init__(self, url: str, api_key: str, plan: SoakPlan, report: SoakReport) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.plan = plan
        self.report = report
        self.rng = random.Random(plan.seed)
        self.churn_names: list[str] = []
        self.done = asyncio.Event()

    async def one(self, session: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(self.plan.seed * 1_000_003 + index)
        models = list(self.plan.models) + self.churn_names[-2:]
        prefixes = [" ".join(f"w{(7 * p + i) % 50}" for i in range(40)) for p in range(4)]
        path, body = request_body(rng, rng.choice(models), prefixes)
        abort = rng.random() < self.plan.abort_fraction
        what = f"{path} {json.dumps(body)[:200]}"
        self.report.sent += 1
        try:
            if abort and not body["stream"]:
                timeout = aiohttp.ClientTimeout(total=rng.uniform(0.001, 0.05))
                try:
                    async with session.post(self.url + path, json=body, timeout=timeout) as r:
                        self._judge(r.status, r.headers, await r.read(), what)
                        return
                except asyncio.TimeoutError:
                    self.report.aborted += 1
                    return
            async with session.post(self.url + path, json=body) as response:
                if not body["stream"] or response.status != 200:
                    self._judge(response.status, response.headers, await response.read(), what)
                    return
                await self._read_stream(response, abort, what)
        except aiohttp.ClientError as exc:
            self.report.unexpected.append(f"no answer ({exc!r}) <- {what}")

    async def _read_stream(self, response: aiohttp.ClientResponse, abort: bool, what: str):
        self.report.statuses[200] += 1
        last = b""
        async for line in response.content:
            if line.strip():
                last = line.strip()
                if abort:
                    self.report.aborted += 1
                    response.close()
                    return
        if last != b"data: [DONE]" and b'"error"' not in last:
            self.report.unexpected.append(f"torn stream (last {last[:80]!r}) <- {what}")

    def _judge(self, status: int, headers, body: bytes, what: str) -> None:
        self.report.statuses[status] += 1
        lowered = {k.lower(): v for k, v in headers.items()}
        verdict = judge(status, lowered, body)
        if not verdict.allowed:
            self.report.unexpected.append(f"{verdict.reason} <- {what}")

    async def churn(self, session: aiohttp.ClientSession) -> None:
        """Registers, unloads and deletes adapters (new names each cycle) until the
        traffic ends, then deletes the last one; requests meanwhile call the two newest
        names."""
        plan, cycle = self.plan, 0
        while not self.done.is_set():
            name = f"churn{cycle}"
            base = plan.churn_base
            register = {"model": base, "name": name, "path": plan.churn_path}
            await self._admin(session, "register", "POST", "/v1/adapters", register)
            self.churn_names.append(f"{base}:{name}")
            await asyncio.sleep(0.3)
            await self._admin(session, "unload", "POST", f"/v1/adapters/{base}/{name}/unload")
            await asyncio.sleep(0.3)
            if cycle >= 1:
                old = f"churn{cycle - 1}"
                await self._admin(session, "delete", "DELETE", f"/v1/adapters/{base}/{old}")
            cycle += 1
        if cycle:  # leave the tenant's catalog as it was
            last = f"churn{cycle - 1}"
            await self._admin(session, "delete", "DELETE", f"/v1/adapters/{plan.churn_base}/{last}")

    async def _admin(self, session, verb: str, method: str, path: str, body=None) -> None:
        """One admin call; a 429 (the tenant's admin rate) is retried after its
        Retry-After, as a client should."""
        while True:
            async with session.request(method, self.url + path, json=body) as response:
                payload = await response.read()
                self.report.churn[f"{verb} {response.status}"] += 1
                self._judge(response.status, response.headers, payload, f"churn {verb} {path}")
                if response.status != 429:
                    return
                wait_s = float(response.headers.get("Retry-After", "1"))
            await asyncio.sleep(wait_s)


async def _run(url: str, api_key: str, plan: SoakPlan, report: SoakReport, progress) -> None:
    soak = Soak(url, api_key, plan, report)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    limit = aiohttp.TCPConnector(limit=plan.concurrency + 4)
    async with aiohttp.ClientSession(headers=soak.headers, timeout=timeout, connector=limit) as s:
        churn = asyncio.create_task(soak.churn(s)) if plan.churn_base else None
        gate = asyncio.Semaphore(plan.concurrency)

        async def gated(index: int) -> None:
            async with gate:
                await soak.one(s, index)
                progress(index)

        await asyncio.gather(*(gated(i) for i in range(plan.num_requests)))
        soak.done.set()
        if churn is not None:
            await churn


def read_gauges(url: str, operator_key: str) -> dict[str, float]:
    """IDLE_GAUGES from /metrics, each summed over its series."""
    return metric_sums(url, operator_key, IDLE_GAUGES)


def wait_idle(url: str, operator_key: str, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, float]:
    """The gauges once all read 0, or their last values after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = read_gauges(url, operator_key)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(1.0)


def run_soak(
    url: str,
    api_key: str,
    operator_key: str,
    plan: SoakPlan,
    progress: Callable[[int], None] = lambda _: None,
) -> SoakReport:
    report = SoakReport()
    started = time.monotonic()
    asyncio.run(_run(url, api_key, plan, report, progress))
    report.elapsed_s = time.monotonic() - started
    report.idle_gauges = wait_idle(url, operator_key)
    report.preemptions = metric_sums(url, operator_key, (PREEMPTIONS,))[PREEMPTIONS]
    return report
