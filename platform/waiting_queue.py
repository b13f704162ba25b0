"""The scheduler's waiting requests, ordered by (priority, arrival)."""

from __future__ import annotations

import bisect
import itertools

from loraplex.platform.request import Request


class WaitingQueue:
    """Requests ordered by (priority, arrival); FCFS when priorities are equal. A sorted
    list: arrivals append at the tail, admission iterates from the head."""

    def __init__(self, use_priority: bool) -> None:
        self._use_priority = use_priority
        self._entries: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def push(self, request: Request) -> None:
        priority = request.priority if self._use_priority else 0
        entry = (priority, request.arrival_time, next(self._order), request)
        bisect.insort(self._entries, entry, key=lambda e: e[:3])

    def remove(self, request: Request) -> None:
        self.remove_all({id(request)})

    def remove_all(self, request_ids: set[int]) -> None:
        """Drops the requests whose `id()` is in `request_ids`."""
        self._entries = [e for e in self._entries if id(e[3]) not in request_ids]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter([entry[3] for entry in self._entries])
