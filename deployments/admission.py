"""Admission by estimated wait: a model replica refuses a request (503 + Retry-After)
that it could not start within `max_wait_s` of the request's arrival at the ingress.

Without it, under sustained overload requests queue in front of a full batch (in
Serve's router queue and in the engine's waiting queue) and are answered long after a
client has given up: a late answer costs the same compute as a timely one and helps
nobody. Refusing at once is what lets the admitted ones finish in time.

The estimate, per replica, from what it has seen (nothing tuned to a machine):
- `in_flight`: sequences the replica holds (each of a request's `n` completions is one);
  past `max_num_seqs` of them, the rest wait for a place in the batch;
- `departure_rate`: sequences that left the batch per second while it was full (the
  replica's service rate at full batch, whatever the model, machine or answer lengths);
- a new sequence with `ahead = in_flight - max_num_seqs` sequences queued before it
  starts after about `(ahead + 1) / departure_rate` seconds (Little's law).
- under the engine's `fair` policy (platform/fair_share.py) a tenant's new sequences
  queue behind its own and, of every other tenant's, only as many as that tenant's
  share allows in the same time: with `own` = the tenant's sequences in flight plus the
  new ones, tenant t (weight w_t) counts `min(in_flight_t, own * w_t / w)` ahead. A light
  tenant is then not refused for a heavy tenant's queue, which the engine lets it pass.
The time the request already spent between the ingress and this replica (Serve's queue)
counts toward `max_wait_s`, but a request that can start at once is never refused
(however long it waited for the replica to come up). Until a full batch has been
watched long enough to measure its departure rate, nothing is refused.

The ingress runs the same estimate over the whole deployment (`FleetAdmission`: one
batch of `max_num_seqs` per running replica, fed with the requests the ingress itself
sent) and refuses there first, so that under overload a refusal costs no call to a
model replica: no Serve routing, no actor call, no Python time on the replica the
engine computes in. Its view holds every request it sent, those still in Serve's queue
included, so it refuses no later than the replicas would; with several ingress replicas
each sees only its own share and the model replicas refuse the rest.

Everything runs on one event loop (the replica's or the ingress's): no locks.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 2.0
"""Full-batch time over which one departure-rate sample is taken ..."""
MIN_DEPARTURES = 4
"""... once at least this many sequences left the batch in it."""
SMOOTHING = 0.3
"""Weight of the newest sample in the departure rate."""


@dataclass(frozen=True)
class Refusal:
    wait_s: float
    """Estimated wait before the request could start, the time already waited included."""
    max_wait_s: float

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.wait_s - self.max_wait_s))

    @property
    def message(self) -> str:
        return (
            f"the model is at capacity: this request would wait about {self.wait_s:.0f} s "
            f"to start (limit {self.max_wait_s:g} s), retry later"
        )


@dataclass
class _Entry:
    sequences: int
    tenant: str = ""
    started: bool = False


class AdmissionControl:
    """Semantics: `admit(request_id, n, waited_s, tenant, weight)` returns None
    (admitted: its `n` sequences count until `finish`) or a Refusal; `started(request_id)` marks that the
    request produced output (it held a place in the batch); `finish(request_id)`
    removes it, and its sequences count as departures when it had started while the
    batch was full."""

    def __init__(
        self,
        max_wait_s: float | None,
        max_num_seqs: int,
        clock: Callable[[], float] = time.monotonic,
        fair: bool = False,
    ) -> None:
        self.max_wait_s = max_wait_s
        self.max_num_seqs = max_num_seqs
        self.fair = fair
        """The engine admits by tenant fair share (module docstring)."""
        self._tenant_sequences: Counter[str] = Counter()
        self._tenant_weights: dict[str, float] = {}
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self.in_flight = 0
        self.departure_rate: float | None = None
        """Sequences leaving a full batch per second (None until measured)."""
        self.refused = 0
        self._full_since: float | None = None
        self._window_s = 0.0
        self._window_departures = 0

    def estimated_wait_s(self, sequences: int = 1, tenant: str = "", weight: float = 1.0) -> float:
        """Seconds before `sequences` new sequences of `tenant` would all have started
        (0: now)."""
        ahead = self._sequences_before(sequences, tenant, weight) - self.max_num_seqs
        if ahead <= 0 or not self.departure_rate:
            return 0.0
        return ahead / self.departure_rate

    def _sequences_before(self, sequences: int, tenant: str, weight: float) -> float:
        """In-flight sequences that start before the new ones, the new ones included."""
        if not self.fair:
            return self.in_flight + sequences
        own = self._tenant_sequences[tenant] + sequences
        others = sum(
            min(count, own * self._tenant_weights[other] / weight)
            for other, count in self._tenant_sequences.items()
            if other != tenant
        )
        return own + others

    def admit(
        self,
        request_id: str,
        sequences: int,
        waited_s: float = 0.0,
        tenant: str = "",
        weight: float = 1.0,
        enforce: bool = True,
    ) -> Refusal | None:
        """`enforce=False` admits without an estimate (the request is counted all the
        same)."""
        estimate = self.estimated_wait_s(sequences, tenant, weight) if enforce else 0.0
        if self.max_wait_s is not None and estimate > 0:
            wait = max(waited_s, 0.0) + estimate
            if wait > self.max_wait_s:
                self.refused += 1
                return Refusal(wait, self.max_wait_s)
        self._entries[request_id] = _Entry(sequences, tenant)
        self._tenant_sequences[tenant] += sequences
        self._tenant_weights[tenant] = weight
        self._set_in_flight(self.in_flight + sequences)
        return None

    def refusing_for_s(self, tenant: str = "", weight: float = 1.0) -> float:
        """How long a one-sequence request of `tenant` would keep being refused if nothing
        else were admitted and the batch drained at the measured rate (0: not now)."""
        if self.max_wait_s is None:
            return 0.0
        return max(0.0, self.estimated_wait_s(1, tenant, weight) - self.max_wait_s)

    def started(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.started = True

    def finish(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if entry.started and self._full_since is not None:
            self._window_departures += entry.sequences
        self._tenant_sequences[entry.tenant] -= entry.sequences
        if self._tenant_sequences[entry.tenant] <= 0:
            del self._tenant_sequences[entry.tenant]
            del self._tenant_weights[entry.tenant]
        self._set_in_flight(self.in_flight - entry.sequences)

    def _set_in_flight(self, in_flight: int) -> None:
        """Follows whether the batch is full and samples the departure rate."""
        now = self._clock()
        if self._full_since is not None:
            self._window_s += now - self._full_since
            self._full_since = None
        self.in_flight = in_flight
        if in_flight >= self.max_num_seqs:
            self._full_since = now
        if self._window_s >= WINDOW_S and self._window_departures >= MIN_DEPARTURES:
            sample = self._window_departures / self._window_s
            if self.departure_rate is None:
                self.departure_rate = sample
            else:
                self.departure_rate += SMOOTHING * (sample - self.departure_rate)
            self._window_s = 0.0
            self._window_departures = 0


class FleetAdmission:
    """Semantics: the ingress's `AdmissionControl` over one model deployment (module
    docstring): its batch is `max_num_seqs` sequences per running replica.
    `set_replicas(n)` follows the running replicas (at least 1), scaling the measured
    departure rate with them; `admit(..., serving=False)` (no running replica: a cold
    start, which the ingress waits out) counts the request but refuses nothing."""

    def __init__(
        self,
        max_wait_s: float | None,
        max_num_seqs: int,
        fair: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_replica = max_num_seqs
        self.replicas = 1
        self.control = AdmissionControl(max_wait_s, max_num_seqs, clock, fair)

    def set_replicas(self, running: int) -> None:
        replicas = max(running, 1)
        if replicas == self.replicas:
            return
        control = self.control
        if control.departure_rate is not None:
            control.departure_rate *= replicas / self.replicas
        self.replicas = replicas
        control.max_num_seqs = replicas * self.per_replica

    def admit(
        self, request_id: str, sequences: int, tenant: str, weight: float, serving: bool
    ) -> Refusal | None:
        return self.control.admit(request_id, sequences, 0.0, tenant, weight, enforce=serving)

    def refusing_for_s(self, tenant: str, weight: float) -> float:
        return self.control.refusing_for_s(tenant, weight)

    def started(self, request_id: str) -> None:
        self.control.started(request_id)

    def finish(self, request_id: str) -> None:
        self.control.finish(request_id)
