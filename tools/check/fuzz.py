"""The fuzz suite: schemathesis over every operation of the app's `/openapi.json`
(requests that fit the schema and requests that break it), with the caller's key, a
wrong key and no key; then the hand list (hand_cases.py) as raw bytes; then a slow
client holding a half-sent body while `/health` must keep answering. Every answer is
judged by verdict.py; the report counts requests per operation and lists every
unexpected answer with the request that got it.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from loraplex.tools.check.hand_cases import RawCase, hand_cases
from loraplex.tools.check.verdict import judge

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0
WRONG_KEY = "sk-loraplex-fuzz-wrong-key"


@dataclass
class Tally:
    """Answers of one operation (or of the hand list)."""

    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)


@dataclass
class FuzzReport:
    url: str
    tallies: dict[str, Tally] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    """Operations schemathesis could not generate for (with why)."""

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.tallies.values())

    @property
    def unexpected(self) -> list[str]:
        return [f"{name}: {u}" for name, t in self.tallies.items() for u in t.unexpected]

    def table(self) -> str:
        """One row per operation: requests, answers by status, unexpected."""
        rows = ["| operation | requests | statuses | unexpected |", "|---|---:|---|---:|"]
        for name, tally in sorted(self.tallies.items()):
            statuses = ", ".join(
                f"{s}: {n}"
                for s, n in sorted(tally.statuses.items(), key=lambda item: str(item[0]))
            )
            rows.append(f"| {name} | {tally.requests} | {statuses} | {len(tally.unexpected)} |")
        rows.append(f"| all | {self.requests} | | {len(self.unexpected)} |")
        return "\n".join(rows)


class Recorder:
    def __init__(self, report: FuzzReport) -> None:
        self.report = report

    def record(self, name: str, status: int, headers: dict[str, str], body: bytes, what: str):
        tally = self.report.tallies.setdefault(name, Tally())
        tally.requests += 1
        tally.statuses[status] += 1
        verdict = judge(status, headers, body)
        if not verdict.allowed:
            tally.unexpected.append(f"{verdict.reason} <- {what}")
            logger.warning("%s: %s <- %s", name, verdict.reason, what)

    def failed(self, name: str, error: BaseException, what: str) -> None:
        tally = self.report.tallies.setdefault(name, Tally())
        tally.requests += 1
        tally.statuses["no answer"] += 1
        tally.unexpected.append(f"no answer ({error!r}) <- {what}")
        logger.warning("%s: no answer (%r) <- %s", name, error, what)


def _key_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def served_models(url: str, api_key: str) -> list[str]:
    """The model ids (`base` and `base:adapter`) the key may call."""
    response = requests.get(f"{url}/v1/models", headers=_key_headers(api_key), timeout=30)
    response.raise_for_status()
    return [card["id"] for card in response.json()["data"]]


def run_schemathesis(
    url: str, api_key: str, examples: int, recorder: Recorder, progress: Callable[[str], None]
) -> None:
    """Positive and negative cases for every operation: `examples` per operation and mode
    with the valid key, a tenth of that with a wrong key and with none. Most cases name
    a model the key may call (a random name would stop at the 404 and never reach a
    model server)."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)
    keys = {"valid key": api_key, "wrong key": WRONG_KEY, "no key": None}
    models = served_models(url, api_key)
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for key_name, key in keys.items():
                count = examples if key == api_key else max(1, examples // 10)
                progress(f"{name} ({mode.value}, {key_name}, {count} examples)")
                try:
                    _probe_operation(operation, name, mode, key, count, url, recorder, models)
                except Unsatisfiable:
                    # Nothing to break: an operation without parameters or body has no
                    # request that violates its schema.
                    logger.info("%s: no %s cases exist", name, mode.value)
                except Exception as exc:  # generation itself failed: say so, go on
                    recorder.report.errors.append(f"{name} {mode.value} {key_name}: {exc!r}")
                    logger.warning("%s %s: generation failed: %r", name, mode.value, exc)


def _pin_model(pair: tuple) -> object:
    """A case with its body's `model` (and its `{model}` path parameter: the base) set
    to a served model id, unless the drawn id is None."""
    case, model = pair
    if model is not None:
        if isinstance(case.body, dict):
            case.body["model"] = model
        if case.path_parameters and "model" in case.path_parameters:
            case.path_parameters["model"] = model.split(":")[0]
    return case


def _probe_operation(
    operation, name, mode, key, count, url, recorder: Recorder, models: list[str]
) -> None:
    """`count` schemathesis cases of `operation` in `mode`, each sent with `key`; three
    in four name one of `models`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    choices = st.sampled_from(models) if models else st.just(None)
    weighted = st.sampled_from([0, 1, 2, 3]).flatmap(lambda i: st.just(None) if i == 0 else choices)
    strategy = st.tuples(operation.as_strategy(generation_mode=mode), weighted).map(_pin_model)

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def probe(case) -> None:
        what = f"{case.method} {case.formatted_path} body={str(case.body)[:300]}"
        try:
            response = case.call(base_url=url, headers=_key_headers(key), timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            recorder.failed(name, exc, what)
            return
        headers = {k: v[0] for k, v in response.headers.items()}
        recorder.record(name, response.status_code, headers, response.content, what)

    probe()


def send_raw(url: str, case: RawCase, api_key: str) -> requests.Response:
    headers = {}
    if case.content_type is not None:
        headers["Content-Type"] = case.content_type
    key = api_key if case.key == "valid" else case.key
    headers.update(_key_headers(key))
    return requests.request(
        case.method, url + case.path, data=case.body, headers=headers, timeout=REQUEST_TIMEOUT_S
    )


def run_hand_list(url: str, api_key: str, model: str, recorder: Recorder) -> None:
    schemas = requests.get(f"{url}/openapi.json", timeout=30).json()["components"]["schemas"]
    for case in hand_cases(model, schemas):
        what = f"hand case {case.name!r}"
        try:
            response = send_raw(url, case, api_key)
        except requests.RequestException as exc:
            recorder.failed("hand list", exc, what)
            continue
        headers = {k.lower(): v for k, v in response.headers.items()}
        recorder.record("hand list", response.status_code, headers, response.content, what)


def run_slow_client(url: str, api_key: str, recorder: Recorder, hold_s: float = 5.0) -> None:
    """A client that sends headers and half its body, then stalls: meanwhile `/health`
    must answer, and afterwards the app must still serve."""
    parsed = urllib.parse.urlsplit(url)
    body = b'{"model": "x", "prompt": "w1"}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
        f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) * 100}\r\n\r\n"
    ).encode()
    with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=hold_s + 5) as s:
        s.sendall(head + body)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                response = requests.get(f"{url}/health", timeout=5)
            except requests.RequestException as exc:
                recorder.failed("slow client", exc, "GET /health while a body stalls")
                return
            elapsed = time.monotonic() - started
            what = f"GET /health while a body stalls ({elapsed * 1e3:.0f} ms)"
            headers = {k.lower(): v for k, v in response.headers.items()}
            recorder.record("slow client", response.status_code, headers, response.content, what)
            time.sleep(0.5)


def run_fuzz(
    url: str,
    api_key: str,
    model: str,
    examples: int,
    progress: Callable[[str], None] = lambda _: None,
) -> FuzzReport:
    """The whole suite against the app at `url` (its base model `model`)."""
    report = FuzzReport(url)
    recorder = Recorder(report)
    run_schemathesis(url, api_key, examples, recorder, progress)
    progress("hand list")
    run_hand_list(url, api_key, model, recorder)
    progress("slow client")
    run_slow_client(url, api_key, recorder)
    return report
