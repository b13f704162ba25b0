"""The `loraplex` command's entry point (pyproject `[project.scripts]`); the command
itself lives with the tooling (tools/cli.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from loraplex.tools.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
