"""Readiness views (deployments/readiness.py) against a stand-in for Serve's controller
details: `latest` answers from the last view at once and refreshes a stale one behind."""

from __future__ import annotations

import asyncio

from loraplex.deployments import readiness
from loraplex.deployments.readiness import ModelReadiness


def details(running: int) -> dict:
    replicas = [{"replica_id": f"r{i}", "state": "RUNNING"} for i in range(running)]
    deployment = {"replicas": replicas, "target_num_replicas": 1, "status": "HEALTHY"}
    return {"applications": {"app": {"deployments": {"model-m": deployment}}}}


def test_latest_answers_from_the_last_view_and_refreshes_a_stale_one_behind(monkeypatch):
    calls = []

    def controller() -> dict:
        calls.append(1)
        return details(running=len(calls))

    monkeypatch.setattr(readiness, "_controller_details", controller)
    view = ModelReadiness("app", {"m": "model-m"})

    async def scenario():
        first = await view.latest("m")  # no view yet: waits for one
        again = await view.latest("m")  # fresh: no controller call
        view._read_at -= readiness.TTL_S  # the view is now stale
        stale = await view.latest("m")  # answered from the old view ...
        for _ in range(100):
            await asyncio.sleep(0.01)
            if view._states["m"].running == 2:
                break
        refreshed = await view.latest("m")  # ... and refreshed behind it
        return first, again, stale, refreshed

    first, again, stale, refreshed = asyncio.run(scenario())
    assert (first.running, again.running, stale.running, refreshed.running) == (1, 1, 1, 2)
    assert len(calls) == 2
