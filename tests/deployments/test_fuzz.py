"""The fuzz suite against the session's real Serve app: every operation of its
/openapi.json through schemathesis (fitting and breaking the schema; valid, wrong and no
key), the hand list and a stalled client; nothing but 2xx and OpenAI-error 4xx (and
overload 503s with Retry-After) may come back.

`LORAPLEX_FUZZ_EXAMPLES` sets the generated requests per operation and mode (default 8:
the fast subset CI runs); docs/reliability.md's figure comes from a larger run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import requests

from loraplex.tools.check.fuzz import FuzzReport, run_fuzz
from loraplex.tools.check.hand_cases import hand_cases
from loraplex.tools.check.verdict import judge

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "8"))
REPORT_PATH = os.environ.get("LORAPLEX_FUZZ_REPORT")
"""Where to write the summary table of the run (unset: nowhere)."""


@pytest.fixture(scope="module")
def report(serve_url, tenant_keys) -> FuzzReport:
    started = time.monotonic()
    result = run_fuzz(serve_url, tenant_keys["acme"], "tiny", EXAMPLES)
    if REPORT_PATH:
        summary = f"{result.requests} requests in {time.monotonic() - started:.0f} s\n"
        Path(REPORT_PATH).write_text(summary + result.table() + "\n")
    return result


def test_no_unexpected_answer(report):
    assert report.unexpected == [], "\n".join(report.unexpected[:20])


def test_every_operation_was_probed(report, serve_url):
    document = requests.get(f"{serve_url}/openapi.json", timeout=30).json()
    operations = {
        f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops
    }
    assert operations <= set(report.tallies), sorted(operations - set(report.tallies))
    assert report.errors == []
    schemas = document["components"]["schemas"]
    assert report.tallies["hand list"].requests == len(hand_cases("tiny", schemas))
    assert report.tallies["slow client"].requests >= 3


def test_openapi_documents_the_request_bodies(serve_url):
    document = requests.get(f"{serve_url}/openapi.json", timeout=30).json()
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/CompletionRequest"
    assert "max_tokens" in document["components"]["schemas"]["CompletionRequest"]["properties"]


@pytest.mark.parametrize(
    ("status", "headers", "body", "allowed"),
    [
        (200, {}, b"anything", True),
        (400, {}, b'{"error": {"message": "m", "type": "invalid_request_error"}}', True),
        (404, {}, b'{"detail": "Not Found"}', False),
        (429, {}, b'{"error": {"message": "m", "type": "t"}}', False),
        (503, {"retry-after": "2"}, b'{"error": {"message": "m", "type": "t"}}', True),
        (500, {}, b'{"error": {"message": "m", "type": "t"}}', False),
        (502, {}, b"", False),
    ],
)
def test_the_verdicts(status, headers, body, allowed):
    assert judge(status, headers, body).allowed is allowed
