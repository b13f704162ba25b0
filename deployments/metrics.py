"""Every metric the platform records, defined once, through `ray.util.metrics`.

Ray exports them from each node's metrics agent (so the Ray dashboard's Grafana and a
Prometheus scraping Ray see them, prefixed `ray_`); the ingress's `/metrics` re-serves
this node's families under their own names (`render_prometheus`). Names follow vLLM's
where the meaning is the same (`vllm:num_requests_running` ...; Ray forbids ':' so they
are recorded as `vllm_...` and renamed back on /metrics). Label values that come from
users (adapters, tenants) are capped per process (`BoundedLabel`), so a flood of
adapter names cannot blow up the series count.
"""

from __future__ import annotations

import os
import threading
import time

from prometheus_client.parser import text_string_to_metric_families
from ray.util import metrics

from loraplex.platform.spec_decode import ACCEPTED_PER_POS_KEY

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
LOAD_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0]
FRAME_FLUSH_S = 1.0
"""How often the ingress hands its frame counts to Ray's counters (IngressMetrics)."""
OUR_PREFIXES = {"ray_vllm_": "vllm:", "ray_loraplex_": "loraplex_"}
_RAY_LABELS = {"Component", "SessionName", "Version", "otel_scope_name", "otel_scope_schema_url"}
_RAY_LABELS |= {"otel_scope_version", "JobId", "NodeAddress", "WorkerId"}


class BoundedLabel:
    """Maps user-chosen label values to at most `limit` distinct ones; the rest -> 'other'."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return "other"


class EngineMetrics:
    """Recorded by a model-server replica: its engine's state and its requests."""

    def __init__(self, model: str, replica: str) -> None:
        self.tags = {"model_name": model, "replica": replica}
        keys = ("model_name", "replica")
        adapter_keys = (*keys, "adapter")
        self.running = metrics.Gauge(
            "vllm_num_requests_running", "Requests in the running batch", keys
        )
        self.waiting = metrics.Gauge("vllm_num_requests_waiting", "Requests waiting", keys)
        self.kv_usage = metrics.Gauge(
            "vllm_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", keys
        )
        self.prefix_queries = metrics.Counter(
            "vllm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", keys
        )
        self.prefix_hits = metrics.Counter(
            "vllm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", keys
        )
        self.ttft = metrics.Histogram(
            "vllm_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS, keys
        )
        self.tpot = metrics.Histogram(
            "vllm_time_per_output_token_seconds",
            "Mean time per output token after the first",
            TOKEN_LATENCY_BUCKETS,
            keys,
        )
        self.e2e = metrics.Histogram(
            "vllm_e2e_request_latency_seconds", "Request latency", LATENCY_BUCKETS, keys
        )
        self.prompt_tokens = metrics.Counter(
            "vllm_prompt_tokens_total", "Prompt tokens processed", keys
        )
        self.generation_tokens = metrics.Counter(
            "vllm_generation_tokens_total", "Tokens generated", keys
        )
        self.adapter_requests = metrics.Counter(
            "loraplex_adapter_requests_total", "Requests per adapter ('base': none)", adapter_keys
        )
        self.adapter_tokens = metrics.Counter(
            "loraplex_adapter_generation_tokens_total", "Tokens generated per adapter", adapter_keys
        )
        self.adapter_load = metrics.Histogram(
            "loraplex_adapter_load_seconds", "Adapter load from disk", LOAD_BUCKETS, keys
        )
        self.adapter_loads = metrics.Counter(
            "loraplex_adapter_loads_total",
            "Adapter loads into a replica, by result ('ok' or 'error')",
            (*keys, "result"),
        )
        self.preemptions = metrics.Counter(
            "vllm_num_preemptions_total",
            "Running requests preempted (their KV blocks freed, recomputed later)",
            keys,
        )
        self.refused = metrics.Counter(
            "loraplex_requests_refused_total",
            "Requests refused at admission: they could not start within admission_max_wait_s",
            keys,
        )
        self.restarts = metrics.Gauge(
            "loraplex_engine_restarts",
            "Times the replica's engine restarted in place after a failed step",
            keys,
        )
        self.resident = metrics.Gauge(
            "loraplex_resident_adapters",
            "Adapters held by the replica, per tier",
            (*keys, "tier"),
        )
        self.resident_bytes = metrics.Gauge(
            "loraplex_adapter_memory_bytes",
            "Memory of the adapters a replica holds, per tier: host copies, and device "
            "slots (LoRA stacks and saved embeddings / LM heads)",
            (*keys, "tier"),
        )
        self.spec = {
            f"spec_decode_{name}": metrics.Counter(
                f"vllm_spec_decode_{name}_total", description, keys
            )
            for name, description in (
                ("num_drafts", "Speculative verifications (one request's drafts, one step)"),
                ("num_draft_tokens", "Draft tokens proposed"),
                ("num_accepted_tokens", "Draft tokens accepted"),
            )
        }
        self.spec_per_pos = metrics.Counter(
            "vllm_spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted at each draft position",
            (*keys, "position"),
        )
        self._last_spec: dict[str, int] = {}
        self.adapter_label = BoundedLabel()
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        self._export_counters_at_zero()

    def _export_counters_at_zero(self) -> None:
        """Exports this replica's counters from the start, at 0, as Prometheus advises
        for known label sets: a counter that appears only at its first event hides that
        event from `rate()` and `increase()`, so an alert on it (a first refusal, a
        first failed adapter load) would not fire. Ray's `Counter.inc` refuses 0, so
        this records through the method `inc` itself records with (Ray is pinned)."""
        for counter, tags in (
            (self.prefix_queries, self.tags),
            (self.prefix_hits, self.tags),
            (self.prompt_tokens, self.tags),
            (self.generation_tokens, self.tags),
            (self.preemptions, self.tags),
            (self.refused, self.tags),
            (self.adapter_loads, {**self.tags, "result": "ok"}),
            (self.adapter_loads, {**self.tags, "result": "error"}),
        ):
            counter._record(0.0, tags=tags)

    def record_engine(self, stats: dict[str, float]) -> None:
        """Sets gauges from `LLMEngine.stats()` and advances the cumulative counters."""
        self.running.set(stats["num_running"], self.tags)
        self.waiting.set(stats["num_waiting"], self.tags)
        self.kv_usage.set(stats["kv_cache_usage"], self.tags)
        queries, hits = int(stats["prefix_cache_queries"]), int(stats["prefix_cache_hits"])
        if queries > self._last_prefix[0]:
            self.prefix_queries.inc(queries - self._last_prefix[0], self.tags)
        if hits > self._last_prefix[1]:
            self.prefix_hits.inc(hits - self._last_prefix[1], self.tags)
        self._last_prefix = (queries, hits)
        preemptions = int(stats.get("num_preemptions", 0))
        if preemptions > self._last_preemptions:
            self.preemptions.inc(preemptions - self._last_preemptions, self.tags)
        self._last_preemptions = preemptions
        self.restarts.set(stats.get("engine_restarts", 0), self.tags)
        for tier, key in (("device", "lora_resident"), ("host", "lora_host_cached")):
            if key in stats:
                self.resident.set(stats[key], {**self.tags, "tier": tier})
        for tier, key in (("device", "lora_device_bytes"), ("host", "lora_host_bytes")):
            if key in stats:
                self.resident_bytes.set(stats[key], {**self.tags, "tier": tier})
        for key, value in stats.items():
            if key.startswith("spec_decode_"):
                self._advance_spec(key, int(value))

    def _advance_spec(self, key: str, value: int) -> None:
        """Advances a speculative-decoding counter to the engine's cumulative `value`."""
        delta = value - self._last_spec.get(key, 0)
        self._last_spec[key] = value
        if delta <= 0:
            return
        if key.startswith(ACCEPTED_PER_POS_KEY):
            position = key.removeprefix(ACCEPTED_PER_POS_KEY)
            self.spec_per_pos.inc(delta, {**self.tags, "position": position})
        elif key in self.spec:
            self.spec[key].inc(delta, self.tags)

    def record_request(
        self,
        adapter: str | None,
        prompt_tokens: int,
        output_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        tags = self.tags
        adapter_tags = {**tags, "adapter": self.adapter_label(adapter or "base")}
        self.adapter_requests.inc(1, adapter_tags)
        self.prompt_tokens.inc(prompt_tokens, tags)
        self.e2e.observe(e2e_s, tags)
        if output_tokens:
            self.generation_tokens.inc(output_tokens, tags)
            self.adapter_tokens.inc(output_tokens, adapter_tags)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags)
            if output_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (output_tokens - 1), tags)


class IngressMetrics:
    """Recorded by the ingress: per-tenant requests (by HTTP status) and tokens."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "loraplex_tenant_requests_total", "Requests per tenant and status", ("tenant", "status")
        )
        self.tokens = metrics.Counter(
            "loraplex_tenant_tokens_total",
            "Tokens per tenant (prompt, generation)",
            ("tenant", "kind"),
        )
        self.in_flight = metrics.Gauge(
            "loraplex_tenant_requests_in_flight",
            "Requests a tenant has admitted and not yet finished (its concurrency limit's count)",
            ("tenant",),
        )
        self.reserved = metrics.Gauge(
            "loraplex_tenant_tokens_reserved",
            "Worst-case tokens reserved for a tenant's requests in flight",
            ("tenant",),
        )
        self.frames = metrics.Counter(
            "loraplex_ingress_frames_total",
            "Step frames received from model replicas (one per engine step per replica)",
        )
        self.frame_entries = metrics.Counter(
            "loraplex_ingress_frame_entries_total",
            "Call entries those frames carried (steps, errors, ends)",
        )
        self.tenant_label = BoundedLabel()
        self._frames = 0
        self._frame_entries = 0
        self._frames_flushed_at = time.monotonic()

    def record_frame(self, entries: int) -> None:
        """Counted here and handed to Ray's counters at most once a second (and at the
        end of every request, `record`): a frame comes every engine step, and two Ray
        counter calls a step took about a sixth of a one-stream ingress's busy samples in
        a py-spy profile."""
        self._frames += 1
        self._frame_entries += entries
        if time.monotonic() - self._frames_flushed_at >= FRAME_FLUSH_S:
            self._flush_frames()

    def _flush_frames(self) -> None:
        self._frames_flushed_at = time.monotonic()
        if self._frames:
            self.frames.inc(self._frames)
            self.frame_entries.inc(self._frame_entries)
            self._frames = self._frame_entries = 0

    def record_usage(self, tenant: str, in_flight: int, reserved: int) -> None:
        """A tenant's rate-limit counters after an admission, settlement or release."""
        name = self.tenant_label(tenant)
        self.in_flight.set(in_flight, {"tenant": name})
        self.reserved.set(reserved, {"tenant": name})

    def record(self, tenant: str, status: int, prompt_tokens: int = 0, output_tokens: int = 0):
        self._flush_frames()
        name = self.tenant_label(tenant)
        self.requests.inc(1, {"tenant": name, "status": str(status)})
        if prompt_tokens:
            self.tokens.inc(prompt_tokens, {"tenant": name, "kind": "prompt"})
        if output_tokens:
            self.tokens.inc(output_tokens, {"tenant": name, "kind": "generation"})


def resident_memory_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


class ProcessMemory:
    """A replica's resident memory as `loraplex_process_resident_memory_bytes`
    {component, replica}, refreshed every `period_s` by a daemon thread: what the load
    and soak suites read to show memory stays flat."""

    def __init__(self, component: str, replica: str, period_s: float = 2.0) -> None:
        self.gauge = metrics.Gauge(
            "loraplex_process_resident_memory_bytes",
            "Resident memory of a replica's process",
            ("component", "replica"),
        )
        self.tags = {"component": component, "replica": replica}
        self.period_s = period_s
        self._stop = threading.Event()
        self.gauge.set(resident_memory_bytes(), self.tags)
        threading.Thread(target=self._run, name="process-memory", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.gauge.set(resident_memory_bytes(), self.tags)

    def stop(self) -> None:
        self._stop.set()


TENANT_LABELS = frozenset({"tenant", "adapter"})
"""Labels whose values name tenants or their adapters."""


def render_prometheus(ray_text: str, hidden_labels: frozenset[str] = frozenset()) -> str:
    """The platform's families from a Ray metrics agent's Prometheus text, renamed to
    their own names (`ray_vllm_x` -> `vllm:x`), without Ray's per-process labels nor
    `hidden_labels` (TENANT_LABELS for callers who may not learn tenant names).
    Series that then coincide (a counter kept by two ingress processes, or by two
    tenants once their label is hidden) are summed; per-replica series stay apart
    through their own `replica` label."""
    lines: list[str] = []
    for family in text_string_to_metric_families(ray_text):
        prefix = next((p for p in OUR_PREFIXES if family.name.startswith(p)), None)
        if prefix is None:
            continue
        new_prefix = OUR_PREFIXES[prefix]
        name = new_prefix + family.name[len(prefix) :]
        kind = family.type if family.type != "unknown" else "untyped"
        lines.append(f"# HELP {name} {family.documentation}")
        lines.append(f"# TYPE {name} {kind}")
        series: dict[str, float] = {}
        for sample in family.samples:
            sample_name = new_prefix + sample.name[len(prefix) :]
            labels = ",".join(
                f'{key}="{_escape(value)}"'
                for key, value in sorted(sample.labels.items())
                if key not in _RAY_LABELS and key not in hidden_labels
            )
            key = f"{sample_name}{{{labels}}}"
            series[key] = series.get(key, 0.0) + sample.value
        lines.extend(f"{key} {value}" for key, value in series.items())
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
