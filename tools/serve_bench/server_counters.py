"""What a burst cost the server, from loraplex's own counters at `/metrics`: adapter loads
from disk and prefix-cache lookups and hits, summed over the model replicas.

Ray exports the replicas' counters every few seconds, so a reading taken right after a
burst can lag it: `settled_counters` reads until the figures have held still for
`SETTLE_S`.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

ADAPTER_LOADS = "loraplex_adapter_loads_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
SETTLE_S = 12.0
SETTLE_POLL_S = 2.0
SETTLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative counters of the whole app (or their change over a burst)."""

    adapter_loads: float = 0.0
    """Adapters read from disk into a replica's host memory (successful loads)."""
    prefix_queries: float = 0.0
    """Prompt tokens looked up in the replicas' prefix caches."""
    prefix_hits: float = 0.0
    """Prompt tokens found there."""

    def minus(self, before: ServerCounters) -> ServerCounters:
        return ServerCounters(
            self.adapter_loads - before.adapter_loads,
            self.prefix_queries - before.prefix_queries,
            self.prefix_hits - before.prefix_hits,
        )

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    def line(self, requests: int) -> str:
        per_1000 = 1000 * self.adapter_loads / requests if requests else float("nan")
        rate = self.prefix_hit_rate
        hit_rate = "n/a" if rate is None else f"{100 * rate:.1f}%"
        return (
            f"  server: {self.adapter_loads:.0f} adapter loads ({per_1000:.1f} per 1000 "
            f"requests); prefix cache {self.prefix_hits:.0f} of {self.prefix_queries:.0f} "
            f"prompt tokens hit ({hit_rate})"
        )


def parse_counters(text: str) -> ServerCounters:
    """The counters in Prometheus text as loraplex's /metrics serves it; absent ones are 0."""
    totals = {ADAPTER_LOADS: 0.0, PREFIX_QUERIES: 0.0, PREFIX_HITS: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in totals:
                continue
            if sample.name == ADAPTER_LOADS and sample.labels.get("result") != "ok":
                continue
            totals[sample.name] += sample.value
    return ServerCounters(totals[ADAPTER_LOADS], totals[PREFIX_QUERIES], totals[PREFIX_HITS])


def read_counters(url: str, metrics_key: str | None, timeout_s: float = 10.0) -> ServerCounters:
    headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
    request = urllib.request.Request(url.rstrip("/") + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return parse_counters(response.read().decode())


def settled_counters(
    url: str,
    metrics_key: str | None,
    settle_s: float = SETTLE_S,
    poll_s: float = SETTLE_POLL_S,
    timeout_s: float = SETTLE_TIMEOUT_S,
) -> ServerCounters:
    """The counters once they have not changed for `settle_s` (or the last reading after
    `timeout_s`, while the server still counts something)."""
    deadline = time.monotonic() + timeout_s
    last = read_counters(url, metrics_key)
    still_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - still_since < settle_s:
        time.sleep(poll_s)
        now = read_counters(url, metrics_key)
        if now != last:
            last, still_since = now, time.monotonic()
    return last
