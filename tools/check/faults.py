"""The fault suite: with traffic flowing (traffic.py), inject one fault at a time into a
running app and measure what it did.

A drill records, for the requests in flight during the fault window (from the injection
to the recovery), how each ended, split into the requests the fault may touch (its
`blast` models) and all others; and the recovery time: from the injection until the
probe (one small request, or the drill's own check) succeeds again. A drill passes when
no request hung, every touched request ended with a completion or a clean error
(`dropped` only where the drill allows it: a killed ingress cannot answer for itself),
every untouched request completed, and the probe succeeded within the bound.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.tools.check.probes import http_status
from loraplex.tools.check.traffic import KINDS, Outcome, Traffic, tally

logger = logging.getLogger(__name__)

RECOVERY_BOUND_S = 60.0
PROBE_PERIOD_S = 0.25
SETTLE_S = 2.0
"""Traffic kept flowing after recovery before a drill's window closes."""


class DrillFailure(AssertionError):
    """Raised by a fault's own steps when the app did not do what the drill expects (a
    poisoned request that was served, a registration that did not fail)."""


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[], str]
    """Does the damage (and checks its direct effect, raising DrillFailure); returns
    what it did, for the report."""
    blast: frozenset[str]
    """Models whose requests the fault may end with an error: base names (with their
    adapters) or single `base:adapter`s. Every other request must complete. Empty: the
    fault must not fail any request."""
    recovered: Callable[[], bool]
    """True once the service is whole again (polled from the injection on)."""
    repair: Callable[[], None] | None = None
    """What an operator or tenant does after the fault (restore files, free disk),
    before recovery is polled; None when the platform must heal alone."""
    may_drop: bool = False
    """Whether touched requests may end without a clean error (a killed ingress)."""
    inject_during: frozenset[str] = frozenset()
    """Inject only while a request to one of these models (as in `blast`) is in flight,
    so the fault lands mid-request or mid-batch; empty: at once."""


@dataclass
class DrillResult:
    name: str
    action: str = ""
    recovery_s: float = float("nan")
    in_flight_at_injection: int = 0
    touched: Counter = field(default_factory=Counter)
    untouched: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def row(self) -> str:
        def kinds(counts: Counter) -> str:
            return " / ".join(str(counts.get(kind, 0)) for kind in KINDS)

        return (
            f"| {self.name} | {self.in_flight_at_injection} | {kinds(self.touched)} | "
            f"{kinds(self.untouched)} | {self.recovery_s:.1f} |"
        )


@dataclass
class FaultReport:
    drills: list[DrillResult] = field(default_factory=list)

    def table(self) -> str:
        head = (
            "| fault | in flight at injection | touched: ok / error / dropped / hung | "
            "others: ok / error / dropped / hung | recovered after s |\n"
            "|---|---:|---|---|---:|"
        )
        return head + "\n" + "\n".join(d.row() for d in self.drills)


def model_answers(url: str, api_key: str, model: str) -> Callable[[], bool]:
    """A recovery probe: a two-token completion of `model` gets a 200."""
    body = f'{{"model": "{model}", "prompt": "w1 w2", "max_tokens": 2}}'.encode()
    return lambda: http_status(f"{url}/v1/completions", api_key, body) == 200


def run_drill(traffic: Traffic, fault: Fault, bound_s: float = RECOVERY_BOUND_S) -> DrillResult:
    """Injects `fault` under `traffic`, waits for recovery, judges the window."""
    result = DrillResult(fault.name)
    touches = functools.partial(_in_blast, blast=fault.blast)
    during = functools.partial(_in_blast, blast=fault.inject_during)
    if fault.inject_during and not traffic.wait_in_flight(during):
        result.problems.append("no request came in flight to inject into")
    logger.warning("fault drill %s: injecting", fault.name)
    injected = time.monotonic()
    try:
        result.action = fault.inject()
        if fault.repair is not None:
            fault.repair()
    except DrillFailure as exc:
        result.problems.append(str(exc))
    while not fault.recovered():
        if time.monotonic() - injected > bound_s:
            result.problems.append(f"not recovered within {bound_s:.0f} s")
            break
        time.sleep(PROBE_PERIOD_S)
    else:
        result.recovery_s = time.monotonic() - injected
    time.sleep(SETTLE_S)
    closed = time.monotonic()
    traffic.wait_for_ends(closed)
    window = traffic.between(injected, closed)
    touched = [o for o in window if touches(o.model)]
    others = [o for o in window if not touches(o.model)]
    result.in_flight_at_injection = sum(o.in_flight_at(injected) for o in window)
    result.touched, result.untouched = tally(touched), tally(others)
    allowed = {"ok", "error"} | ({"dropped"} if fault.may_drop else set())
    result.problems += [_describe(o, "touched") for o in touched if o.kind not in allowed]
    result.problems += [_describe(o, "untouched") for o in others if o.kind != "ok"]
    logger.warning(
        "fault drill %s: %s; recovered after %.1f s; touched %s; others %s",
        fault.name,
        result.action,
        result.recovery_s,
        dict(result.touched),
        dict(result.untouched),
    )
    return result


def _in_blast(model: str, blast: frozenset[str]) -> bool:
    """`blast` names base models (every adapter on them too) or single `base:adapter`s."""
    return model in blast or model.partition(":")[0] in blast


def _describe(outcome: Outcome, group: str) -> str:
    return f"{group} request {outcome.kind}: {outcome.detail} <- {outcome.prompt}"
