"""Whether each base model can take a request now, read from Serve's controller.

The ingress's `/health` and its cold-start wait both ask this, never a model's request
queue: a probe through the queue waits behind real traffic (and reported "starting"
while the model was serving), and remembering that a model once answered kept `/health`
at 200 through the whole cold start of a dead replica's replacement.

A model is ready while one of its replicas is RUNNING (Serve marks a replica RUNNING
once its constructor returned, and the model server's constructor builds and warms the
engine), or while it is scaled to zero on purpose (its first request starts a replica).
It is loading while it has no running replica but one is starting. The view is one
controller call, cached for `TTL_S`, made off the event loop.

A replica's measured start time (from the actor's start to the first view that shows
it RUNNING) is kept per model: it is the `Retry-After` of a request that could not wait
for a cold start (`model_loading`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TTL_S = 1.0
"""How long one controller view is reused (readiness is at most this stale)."""
UNKNOWN_START_RETRY_S = 10
"""Retry-After of a cold start with no measured start time to go by."""
RUNNING, STARTING_STATES = "RUNNING", frozenset({"STARTING", "UPDATING", "RECOVERING"})


@dataclass(frozen=True)
class ModelState:
    """One model deployment as the controller last reported it."""

    running: int
    starting: int
    target: int
    starting_since: float | None = None
    """Wall time the oldest starting replica's actor started (None: none starting)."""
    status: str = ""
    running_replicas: tuple[str, ...] = ()
    """Unique ids of the RUNNING replicas."""

    @property
    def ready(self) -> bool:
        """Can take a request now: a running replica, or scaled to zero on purpose."""
        return self.running > 0 or (self.target == 0 and self.starting == 0)

    @property
    def loading(self) -> bool:
        """No running replica, but one is on its way (a request waits for it)."""
        return self.running == 0 and (self.starting > 0 or self.target > 0)


MISSING = ModelState(running=0, starting=0, target=1, status="missing")
"""A deployment the controller does not list (yet): not ready, loading."""


def model_states(details: dict, app: str, deployments: dict[str, str]) -> dict[str, ModelState]:
    """Model name -> its state, from `get_serve_instance_details`'s dict for `app`;
    `deployments` maps each model name to its deployment's name."""
    listed = details.get("applications", {}).get(app, {}).get("deployments", {})
    states = {}
    for model, deployment in deployments.items():
        entry = listed.get(deployment)
        if entry is None:
            states[model] = MISSING
            continue
        replicas = entry.get("replicas", [])
        starting = [r for r in replicas if r.get("state") in STARTING_STATES]
        running = tuple(str(r.get("replica_id")) for r in replicas if r.get("state") == RUNNING)
        states[model] = ModelState(
            running=len(running),
            running_replicas=running,
            starting=len(starting),
            target=int(entry.get("target_num_replicas", 1)),
            starting_since=min((r.get("start_time_s", 0.0) for r in starting), default=None),
            status=str(entry.get("status", "")),
        )
    return states


def _controller_details() -> dict:
    """The controller's view of every application (blocking: one actor call)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


class ModelReadiness:
    """Cached per-model readiness of one application (module docstring)."""

    def __init__(self, app: str, deployments: dict[str, str]) -> None:
        self.app = app
        self.deployments = dict(deployments)
        self._states: dict[str, ModelState] = {}
        self._read_at = -math.inf
        self._lock = asyncio.Lock()
        self._start_s: dict[str, float] = {}
        """Model -> the latest measured replica start (actor start to RUNNING)."""
        self._seen_starting: dict[str, float] = {}
        """Model -> `starting_since` of the cold start under way, while it lasts."""
        self._refreshing: set[asyncio.Future] = set()
        """Background refreshes (`latest`), held so they are not collected."""

    async def states(self) -> dict[str, ModelState]:
        """Every model's state, at most TTL_S old; a failed controller call keeps the
        last view (and marks every model not ready when there is none)."""
        async with self._lock:
            if time.monotonic() - self._read_at >= TTL_S:
                try:
                    details = await asyncio.to_thread(_controller_details)
                except Exception as exc:
                    logger.warning("reading Serve's deployment states failed: %r", exc)
                    if not self._states:
                        return {model: MISSING for model in self.deployments}
                    return dict(self._states)
                self._observe(model_states(details, self.app, self.deployments))
                self._read_at = time.monotonic()
            return dict(self._states)

    async def state(self, model: str) -> ModelState:
        return (await self.states())[model]

    async def latest(self, model: str) -> ModelState:
        """`model`'s last view without waiting for a stale one to be refreshed (the
        refresh runs in the background); waits only for the very first view."""
        if model not in self._states:
            return await self.state(model)
        if time.monotonic() - self._read_at >= TTL_S and not self._lock.locked():
            refresh = asyncio.ensure_future(self.states())
            self._refreshing.add(refresh)
            refresh.add_done_callback(self._refreshing.discard)
        return self._states[model]

    def _observe(self, states: dict[str, ModelState]) -> None:
        for model, state in states.items():
            before = self._states.get(model)
            if state.running == 0 and state.starting_since is not None:
                self._seen_starting.setdefault(model, state.starting_since)
            if state.running > 0 and model in self._seen_starting:
                started = self._seen_starting.pop(model)
                self._start_s[model] = max(time.time() - started, 0.0)
                logger.info("model %s: a replica started in %.1f s", model, self._start_s[model])
            if before is not None and before.ready != state.ready:
                logger.info(
                    "model %s is %s (running=%d starting=%d target=%d)",
                    model,
                    "ready" if state.ready else "not ready",
                    state.running,
                    state.starting,
                    state.target,
                )
        self._states = states

    def retry_after_s(self, model: str) -> int:
        """Seconds until a starting replica of `model` should be up: its measured start
        time less how long the current one has been starting (at least 1)."""
        measured = self._start_s.get(model)
        state = self._states.get(model)
        if measured is None:
            return UNKNOWN_START_RETRY_S
        since = state.starting_since if state is not None else None
        elapsed = time.time() - since if since is not None else 0.0
        return max(1, math.ceil(measured - elapsed))
