"""`loraplex check fuzz | soak | load` against any loraplex URL: prints a summary (fuzz: a table
per operation, optionally JSON with every unexpected answer), exits 1 on any unexpected
answer (soak: or a gauge not back to zero once idle)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `check` (with `fuzz`) to the `loraplex` command."""
    check = commands.add_parser("check", help="probe a running app (fuzz)")
    suites = check.add_subparsers(dest="suite", required=True)
    fuzz = suites.add_parser("fuzz", help="schemathesis + hand list + slow client")
    fuzz.add_argument("--url", default="http://127.0.0.1:8000", help="app root")
    fuzz.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="a tenant key ($OPENAI_API_KEY)"
    )
    fuzz.add_argument("--model", default="smollm2-135m-instruct", help="a base model it serves")
    fuzz.add_argument(
        "--examples", type=int, default=100, help="generated requests per operation and mode"
    )
    fuzz.add_argument("--output-dir", type=Path, default=None, help="write check_fuzz.json here")
    fuzz.set_defaults(handler=run_check_fuzz)
    soak = suites.add_parser("soak", help="mixed traffic with aborts and adapter churn")
    soak.add_argument("--url", default="http://127.0.0.1:8000", help="app root")
    soak.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="a tenant key ($OPENAI_API_KEY)"
    )
    soak.add_argument("--operator-key", required=True, help="reads /metrics afterwards")
    soak.add_argument("--requests", type=int, default=5000)
    soak.add_argument("--concurrency", type=int, default=32)
    soak.add_argument("--abort-fraction", type=float, default=0.15)
    soak.add_argument(
        "--churn-base", default=None, help="base model to register churned adapters on"
    )
    soak.add_argument(
        "--churn-path", default=None, help="adapter folder under the tenant's root to churn"
    )
    soak.set_defaults(handler=run_check_soak)
    load = suites.add_parser("load", help="open-loop arrivals at 1x, 2x, 4x capacity")
    load.add_argument("--url", default="http://127.0.0.1:8000", help="app root")
    load.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="a tenant key ($OPENAI_API_KEY)"
    )
    load.add_argument("--phase-s", type=float, default=60.0, help="seconds per load level")
    load.add_argument("--multiples", default="1,2,4", help="load levels, x measured capacity")
    load.add_argument("--deadline-s", type=float, default=60.0, help="a later answer has hung")
    load.add_argument(
        "--operator-key", default=None, help="reads each component's memory from /metrics"
    )
    load.set_defaults(handler=run_check_load)


def run_check_fuzz(args: argparse.Namespace) -> int:
    from loraplex.tools.check.fuzz import run_fuzz

    if not args.api_key:
        sys.stderr.write("loraplex check fuzz: --api-key (or $OPENAI_API_KEY) is required\n")
        return 2
    with tqdm(desc="fuzz", unit="step") as bar:

        def progress(step: str) -> None:
            bar.set_postfix_str(step[:60])
            bar.update()

        report = run_fuzz(args.url, args.api_key, args.model, args.examples, progress)
    sys.stdout.write(report.table() + "\n")
    for line in report.unexpected:
        sys.stdout.write(f"UNEXPECTED {line}\n")
    for line in report.errors:
        sys.stdout.write(f"not generated: {line}\n")
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        path = args.output_dir / "check_fuzz.json"
        payload = {
            "url": report.url,
            "requests": report.requests,
            "unexpected": report.unexpected,
            "errors": report.errors,
            "tallies": {
                name: {
                    **dataclasses.asdict(t),
                    "statuses": {str(k): v for k, v in t.statuses.items()},
                }
                for name, t in report.tallies.items()
            },
        }
        path.write_text(json.dumps(payload, indent=2))
        logger.info("wrote %s", path)
    return 1 if report.unexpected else 0


def run_check_soak(args: argparse.Namespace) -> int:
    from loraplex.tools.check.fuzz import served_models
    from loraplex.tools.check.soak import SoakPlan, run_soak

    plan = SoakPlan(
        num_requests=args.requests,
        concurrency=args.concurrency,
        models=tuple(served_models(args.url, args.api_key)),
        abort_fraction=args.abort_fraction,
        churn_base=args.churn_base,
        churn_path=args.churn_path,
    )
    with tqdm(total=plan.num_requests, desc="soak", unit="req") as bar:
        report = run_soak(args.url, args.api_key, args.operator_key, plan, lambda _: bar.update())
    sys.stdout.write(report.summary() + "\n")
    for line in report.unexpected:
        sys.stdout.write(f"UNEXPECTED {line}\n")
    return 1 if report.unexpected or any(report.idle_gauges.values()) else 0


def run_check_load(args: argparse.Namespace) -> int:
    from loraplex.tools.check.fuzz import served_models
    from loraplex.tools.check.load import LoadPlan, run_load

    plan = LoadPlan(
        models=tuple(served_models(args.url, args.api_key)),
        multiples=tuple(float(m) for m in args.multiples.split(",")),
        phase_s=args.phase_s,
        deadline_s=args.deadline_s,
        operator_key=args.operator_key,
    )
    report = run_load(args.url, args.api_key, plan, lambda step: logger.warning("load: %s", step))
    sys.stdout.write(report.table() + "\n")
    for line in report.failures:
        sys.stdout.write(f"UNEXPECTED {line}\n")
    return 1 if report.failures else 0
