"""Small HTTP reads the suites and the bench share: the status of one call, and sums
over the platform's `/metrics` (operator key)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families


def http_status(
    url: str, api_key: str | None, body: bytes | None = None, timeout: float = 10
) -> int:
    """The status of one GET (POST with `body`, JSON); 0 when nothing answered."""
    request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def metric_sums(
    url: str, operator_key: str, names: Iterable[str], by: str | None = None
) -> dict[str, float]:
    """The families `names` of the app's `/metrics`, each summed over its series (0 when
    absent); with `by`, one family summed per value of that label instead."""
    request = urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {operator_key}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    wanted = set(names)
    sums: dict[str, float] = {} if by else dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            key = sample.labels.get(by, "?") if by else family.name
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums
