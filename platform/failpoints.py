"""Failpoints: named places in the engine where a test or a chaos drill makes it fail
on purpose, to prove that a failure stays where it belongs.

    sampler.row    raise while sampling the rows of matching requests (a failure that
                   belongs to one request: only that request may end)
    engine.step    raise inside a step, after scheduling (a failure of shared state:
                   the engine loop restarts in place)
    engine.delay   sleep `delay_s` at the start of every step (slows the engine so
                   concurrent requests overlap for sure)

Nothing is armed unless someone calls `arm`; the checks on the hot path cost one
attribute read. A Serve deployment exposes arming only when its config sets
`fault_injection: true` (deployments/config.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.platform.request import Request

logger = logging.getLogger(__name__)

NAMES = ("sampler.row", "engine.step", "engine.delay")


class InjectedFault(RuntimeError):
    """Raised by an armed failpoint."""


@dataclass
class _Armed:
    prompt: tuple[int, ...] | None
    remaining: int | None
    delay_s: float


class Failpoints:
    def __init__(self) -> None:
        self._armed: dict[str, _Armed] = {}
        self._lock = threading.Lock()
        self.active = False
        """True while any failpoint is armed (the only check on the hot path)."""

    def arm(
        self,
        name: str,
        prompt: Sequence[int] | None = None,
        times: int | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """Arms `name`: it fires for requests whose prompt token ids equal `prompt` (any
        request when None), `times` times (None: until disarmed)."""
        if name not in NAMES:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(NAMES)}")
        with self._lock:
            self._armed[name] = _Armed(tuple(prompt) if prompt else None, times, delay_s)
            self.active = True
        logger.warning("failpoint %s armed (prompt=%s, times=%s)", name, prompt, times)

    def disarm(self, name: str | None = None) -> None:
        """Disarms `name`, or every failpoint."""
        with self._lock:
            if name is None:
                self._armed.clear()
            else:
                self._armed.pop(name, None)
            self.active = bool(self._armed)

    def hit(self, name: str, request: Request | None = None) -> None:
        """Fires `name` if it is armed and matches `request`: sleeps or raises."""
        with self._lock:
            armed = self._armed.get(name)
            if armed is None:
                return
            if armed.prompt is not None and (
                request is None or tuple(request.prompt_token_ids) != armed.prompt
            ):
                return
            if armed.remaining is not None:
                armed.remaining -= 1
                if armed.remaining <= 0:
                    del self._armed[name]
                    self.active = bool(self._armed)
        if armed.delay_s > 0:
            time.sleep(armed.delay_s)
            return
        target = f" for request {request.request_id}" if request is not None else ""
        raise InjectedFault(f"failpoint {name} fired{target}")


FAILPOINTS = Failpoints()
"""The process's failpoints (engines in one process share them)."""
