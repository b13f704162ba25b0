"""Background traffic for fault drills: a closed loop of concurrent clients sending mixed
requests (completions and chat, streamed or not, over several models and adapters) in
their own thread, recording how each request ended.

How a request ends:
    ok        a complete 200 (a stream ends with `[DONE]`)
    error     a clean error: OpenAI error JSON (a status, or an error event in a stream;
              429/503 with Retry-After)
    dropped   ended without a clean error: the connection closed, a stream stopped
              without `[DONE]` or an error event, or an error body that is not OpenAI's
    hung      no end within the deadline
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from loraplex.tools.check.verdict import is_openai_error

KINDS = ("ok", "error", "dropped", "hung")


@dataclass(frozen=True)
class Outcome:
    model: str
    prompt: str
    started: float
    ended: float
    """time.monotonic() of the start and the end."""
    kind: str
    detail: str
    """Status and the start of the body (errors), or what broke."""

    def in_flight_at(self, moment: float) -> bool:
        return self.started <= moment < self.ended


def tally(outcomes: Sequence[Outcome]) -> Counter:
    return Counter(o.kind for o in outcomes)


def traffic_body(rng: random.Random, model: str) -> tuple[str, dict]:
    """(path, body) of one request: 8-24 tokens forced (`ignore_eos`), so requests stay
    in flight long enough for a fault to land among them."""
    words = " ".join(f"w{rng.randrange(1, 50)}" for _ in range(rng.randrange(4, 24)))
    fields = {
        "model": model,
        "max_tokens": rng.randrange(8, 25),
        "ignore_eos": True,
        "stream": rng.random() < 0.6,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1000),
    }
    if rng.random() < 0.5:
        return "/v1/completions", {**fields, "prompt": words}
    return "/v1/chat/completions", {**fields, "messages": [{"role": "user", "content": words}]}


async def send(
    session: aiohttp.ClientSession, url: str, path: str, body: dict, deadline_s: float
) -> tuple[str, str]:
    """Sends one request to its end: (kind, detail)."""
    try:
        timeout = aiohttp.ClientTimeout(total=deadline_s)
        async with session.post(url + path, json=body, timeout=timeout) as response:
            if response.status != 200:
                raw = await response.read()
                clean = is_openai_error(raw) and (
                    response.status not in (429, 503) or "Retry-After" in response.headers
                )
                return ("error" if clean else "dropped"), f"{response.status} {raw[:160]!r}"
            if not body.get("stream"):
                raw = await response.read()
                return "ok", "200"
            last = b""
            async for line in response.content:
                if line.strip():
                    last = line.strip()
            if last == b"data: [DONE]":
                return "ok", "200 stream"
            if last.startswith(b"data: ") and is_openai_error(last[6:]):
                return "error", f"stream error event {last[6:166]!r}"
            return "dropped", f"stream ended after {last[:80]!r}"
    except asyncio.TimeoutError:
        return "hung", f"no end within {deadline_s:.0f} s"
    except aiohttp.ClientError as exc:
        return "dropped", f"{type(exc).__name__}: {exc}"[:200]


class Traffic:
    """`with Traffic(url, key, models): ...` keeps `concurrency` requests in flight for
    the block; `outcomes` holds every finished request."""

    def __init__(
        self,
        url: str,
        api_key: str,
        models: Sequence[str],
        concurrency: int = 6,
        deadline_s: float = 60.0,
        seed: int = 0,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.models = list(models)
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[float, str]] = {}
        """Client index -> (start, model) of its request now in flight."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(self.deadline_s + 30)

    def between(self, start: float, end: float) -> list[Outcome]:
        """Requests that were in flight at any time in [start, end]."""
        with self._lock:
            return [o for o in self.outcomes if o.started <= end and o.ended >= start]

    def wait_for_ends(self, after: float) -> None:
        """Blocks until every request started before `after` has ended (the deadline
        bounds it: a hung request ends as 'hung')."""
        limit = time.monotonic() + self.deadline_s + 10
        while time.monotonic() < limit:
            with self._lock:
                pending = self._pending_started_before(after)
            if not pending:
                return
            time.sleep(0.2)

    def wait_in_flight(self, blast: Callable[[str], bool], timeout_s: float = 30.0) -> bool:
        """Blocks until a request to a model `blast` accepts has been in flight for 0.2 s
        (so a fault lands on it mid-request); False if none came within `timeout_s`."""
        limit = time.monotonic() + timeout_s
        while time.monotonic() < limit:
            now = time.monotonic()
            with self._lock:
                ready = any(
                    blast(model) and now - started > 0.2
                    for started, model in self._in_flight.values()
                )
            if ready:
                return True
            time.sleep(0.05)
        return False

    def _pending_started_before(self, moment: float) -> bool:
        return any(started < moment for started, _ in self._in_flight.values())

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        while not self._stop.is_set():
            model = self.rng.choice(self.models)
            path, body = traffic_body(self.rng, model)
            started = time.monotonic()
            with self._lock:
                self._in_flight[index] = (started, model)
            kind, detail = await send(session, self.url, path, body, self.deadline_s)
            outcome = Outcome(
                model, json.dumps(body)[:200], started, time.monotonic(), kind, detail
            )
            with self._lock:
                self.outcomes.append(outcome)
                del self._in_flight[index]
            if kind != "ok":
                await asyncio.sleep(0.1)
