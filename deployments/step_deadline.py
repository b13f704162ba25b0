"""The inter-token timeout of a call's steps, at the cost of two stores per step.

`asyncio.timeout` around each step's await arms and cancels a loop timer per token (a
timer-heap entry and, under uvloop, a timerfd update each time) and walks the
context-manager protocol twice. A stream waits on its model far less often than the
timeout, so one watchdog timer per call does the same job: it wakes once per
`timeout_s` at most, and cancels the reading task only when that task has been waiting
for one step for `timeout_s`. Time the consumer spends between steps (writing to a slow
client) does not count, as it did not with a timeout around each await.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


class _Watchdog:
    """Cancels `task` once it has waited `timeout_s` for one step."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.waiting_since: float | None = None
        self.fired = False
        self._handle = self.loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        waiting_since = self.waiting_since
        delay = self.timeout_s
        if waiting_since is not None:
            waited = self.loop.time() - waiting_since
            if waited >= self.timeout_s:
                self.fired = True
                self.task.cancel()
                return
            delay -= waited
        self._handle = self.loop.call_later(delay, self._check)

    def stop(self) -> None:
        self._handle.cancel()


async def within_step_timeout(
    steps: AsyncIterable[T], timeout_s: float, timed_out: Callable[[], Exception]
) -> AsyncIterator[T]:
    """Semantics: `steps`' items, in order; when one is awaited for `timeout_s` without
    arriving, the await is cancelled (so is the call behind `steps`, by its own
    cancellation) and `timed_out()` is raised instead. A cancellation from elsewhere
    propagates unchanged."""
    iterator = aiter(steps)
    watchdog = _Watchdog(timeout_s)
    loop = watchdog.loop
    try:
        while True:
            watchdog.waiting_since = loop.time()
            try:
                step = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if watchdog.fired and watchdog.task.uncancel() == 0:
                    raise timed_out() from None
                raise
            watchdog.waiting_since = None
            yield step
    finally:
        watchdog.stop()
