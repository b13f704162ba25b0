"""The `loraplex` command: the engine's commands (platform/cli.py) plus the ones that
need the serving layer (`bench serve`, `check`), so the engine never imports deployments."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from loraplex.deployments.bench.cli import add_parser as add_serve_bench
    from loraplex.deployments.check.cli import add_parser as add_check
    from loraplex.platform import cli as engine_cli

    return engine_cli.main(argv, bench_commands=[add_serve_bench], commands=[add_check])


if __name__ == "__main__":
    sys.exit(main())
