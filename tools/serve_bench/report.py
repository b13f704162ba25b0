"""Turns a burst's request records into figures: output tok/s, TTFT / TPOT / ITL / e2e
percentiles, failures by kind; prints them, writes them as JSON and draws a PNG
(latency percentiles per burst, and output tokens per second over time)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loraplex.tools.engine_bench.offline import cpu_model, read_loadavg
from loraplex.tools.serve_bench.client import RequestRecord
from loraplex.tools.serve_bench.server_counters import ServerCounters

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution:
        ms = [s * 1000 for s in seconds]
        mean = sum(ms) / len(ms) if ms else math.nan
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(mean, p50, p90, p99, len(ms))

    def line(self, name: str) -> str:
        return (
            f"{name:>5} ms: mean {self.mean_ms:8.1f}  p50 {self.p50_ms:8.1f}  "
            f"p90 {self.p90_ms:8.1f}  p99 {self.p99_ms:8.1f}  (n={self.count})"
        )


@dataclass(frozen=True)
class BurstSummary:
    """One burst's figures."""

    name: str
    num_requests: int
    completed: int
    failures: dict[str, int]
    """'status 503' / 'timeout' / ... -> count."""
    missing_retry_after: int
    """429 and 503 answers that carried no Retry-After header."""
    duration_s: float
    output_tokens: int
    output_tok_s: float
    requests_per_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    server: ServerCounters | None = None
    """What the burst cost the server (bench serve --metrics-key)."""

    def lines(self) -> list[str]:
        failures = ", ".join(f"{k}: {v}" for k, v in sorted(self.failures.items())) or "none"
        return [
            f"[{self.name}] {self.completed}/{self.num_requests} completed in "
            f"{self.duration_s:.2f}s; failures: {failures}",
            f"  output: {self.output_tokens} tokens, {self.output_tok_s:.1f} tok/s; "
            f"{self.requests_per_s:.2f} req/s",
            "  " + self.ttft.line("ttft"),
            "  " + self.tpot.line("tpot"),
            "  " + self.itl.line("itl"),
            "  " + self.e2e.line("e2e"),
            *([self.server.line(self.num_requests)] if self.server is not None else []),
        ]


def _failure_kind(record: RequestRecord) -> str:
    if record.error == "timeout":
        return "timeout"
    if record.status and record.status != 200:
        return f"status {record.status}"
    return "stream error" if record.status == 200 else "connection"


def summarize(name: str, records: Sequence[RequestRecord]) -> BurstSummary:
    ok = [r for r in records if r.ok]
    failures = Counter(_failure_kind(r) for r in records if not r.ok)
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.end_s for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    tokens = sum(r.output_tokens for r in ok)
    return BurstSummary(
        name=name,
        num_requests=len(records),
        completed=len(ok),
        failures=dict(failures),
        missing_retry_after=sum(1 for r in records if r.status in (429, 503) and not r.retry_after),
        duration_s=duration,
        output_tokens=tokens,
        output_tok_s=tokens / duration,
        requests_per_s=len(ok) / duration,
        ttft=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Distribution.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itl_s]),
        e2e=Distribution.of([r.e2e_s for r in ok]),
    )


@dataclass
class BenchMeta:
    """Where and how the figures were taken."""

    url: str
    cpu: str = field(default_factory=cpu_model)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 0)
    load_before: str = field(default_factory=read_loadavg)
    load_after: str = ""
    workload: dict = field(default_factory=dict)
    offline: dict | None = None
    """The offline baseline's figures, when it ran."""

    def lines(self) -> list[str]:
        return [
            f"server: {self.url}",
            f"machine: {self.cpu}, {self.cpus} cpus; loadavg before {self.load_before}, "
            f"after {self.load_after}",
            "workload: " + ", ".join(f"{k}={v}" for k, v in self.workload.items()),
        ]


def throughput_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[float]:
    """Text chunks received per `bin_s` window (a chunk is about one token when the
    server streams token by token), from the burst's start."""
    times = [t for r in records for t in r.chunk_s]
    if not times:
        return []
    bins = [0.0] * (int(max(times) / bin_s) + 1)
    for t in times:
        bins[int(t / bin_s)] += 1 / bin_s
    return bins


def first_burst_figures(path: Path) -> dict:
    """The headline figures of the first burst in a `bench_serve.json` (for scripts that
    run several benches and compare them): counts, TTFT p50 / p99 in seconds, output
    tok/s, and the server counters when they were read (else None)."""
    burst = json.loads(Path(path).read_text())["bursts"][0]
    return {
        "completed": burst["completed"],
        "sent": burst["num_requests"],
        "failures": burst["failures"],
        "ttft_p50_s": burst["ttft"]["p50_ms"] / 1000,
        "ttft_p99_s": burst["ttft"]["p99_ms"] / 1000,
        "tok_s": burst["output_tok_s"],
        "server": burst.get("server"),
    }


def write_json(
    path: Path,
    meta: BenchMeta,
    summaries: Sequence[BurstSummary],
    records: Sequence[Sequence[RequestRecord]],
) -> None:
    data = {
        "meta": asdict(meta),
        "bursts": [asdict(s) for s in summaries],
        "requests": [[asdict(r) for r in burst] for burst in records],
    }
    Path(path).write_text(json.dumps(data, indent=1))


def plot(
    path: Path,
    summaries: Sequence[BurstSummary],
    records: Sequence[Sequence[RequestRecord]],
    title: str,
) -> None:
    """Two panels: TTFT / TPOT / ITL percentiles per burst (bars), and chunks per second
    over time per burst (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (bars, lines) = pyplot.subplots(1, 2, figsize=(13, 4.8))
    metrics = ("ttft", "tpot", "itl")
    width = 0.8 / max(len(summaries), 1)
    labels = [f"{m} p{q}" for m in metrics for q in PERCENTILES]
    for i, summary in enumerate(summaries):
        values = [getattr(getattr(summary, m), f"p{q}_ms") for m in metrics for q in PERCENTILES]
        xs = [x + i * width for x in range(len(labels))]
        bars.bar(xs, values, width=width, label=summary.name)
    bars.set_xticks([x + width * (len(summaries) - 1) / 2 for x in range(len(labels))])
    bars.set_xticklabels(labels, rotation=45, ha="right")
    bars.set_yscale("log")
    bars.set_ylabel("milliseconds (log)")
    bars.set_title("latency percentiles")
    bars.legend()
    for summary, burst in zip(summaries, records, strict=True):
        timeline = throughput_timeline(burst)
        lines.plot(range(len(timeline)), timeline, label=summary.name)
    lines.set_xlabel("seconds since the burst started")
    lines.set_ylabel("streamed chunks / s")
    lines.set_title("throughput over time")
    lines.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
