"""The inter-token timeout's watchdog (deployments/step_deadline.py) on a real event
loop: a stalled step ends the stream with the caller's error and cancels the wait, time
spent by the consumer between steps does not count, and a cancellation from elsewhere
stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.deployments.step_deadline import within_step_timeout


class Stalled(Exception):
    pass


async def _steps(delays: list[float], cancelled: list[int]):
    for i, delay in enumerate(delays):
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        yield i


def test_steps_within_the_timeout_all_arrive():
    async def run():
        cancelled: list[int] = []
        got = [s async for s in within_step_timeout(_steps([0.05] * 6, cancelled), 0.2, Stalled)]
        return got, cancelled

    assert asyncio.run(run()) == ([0, 1, 2, 3, 4, 5], [])


def test_a_stalled_step_raises_the_callers_error_and_cancels_the_wait():
    async def run():
        cancelled: list[int] = []
        got = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(Stalled):
            async for step in within_step_timeout(
                _steps([0.01, 0.01, 5.0], cancelled), 0.3, Stalled
            ):
                got.append(step)
        return got, cancelled, loop.time() - started

    got, cancelled, elapsed = asyncio.run(run())
    assert got == [0, 1]
    assert cancelled == [2], "the stalled step's await was cancelled"
    assert 0.3 <= elapsed < 1.0, elapsed


def test_the_consumers_own_time_between_steps_does_not_count():
    async def run():
        cancelled: list[int] = []
        got = []
        async for step in within_step_timeout(_steps([0.01] * 3, cancelled), 0.2, Stalled):
            got.append(step)
            await asyncio.sleep(0.5)  # a slow client, longer than the timeout
        return got, cancelled

    assert asyncio.run(run()) == ([0, 1, 2], [])


def test_waits_that_add_up_past_the_timeout_do_not_time_out():
    """Each step comes within the timeout; the watchdog wakes at most once a period and
    must measure the wait in progress, not the time since it was armed."""

    async def run():
        cancelled: list[int] = []
        return [s async for s in within_step_timeout(_steps([0.15] * 5, cancelled), 0.2, Stalled)]

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_a_cancellation_from_elsewhere_is_not_turned_into_a_timeout():
    async def consume(cancelled: list[int]) -> None:
        async for _ in within_step_timeout(_steps([5.0], cancelled), 0.2, Stalled):
            pass

    async def run():
        cancelled: list[int] = []
        task = asyncio.create_task(consume(cancelled))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cancelled

    assert asyncio.run(run()) == [0]
