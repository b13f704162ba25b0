"""`loraplex bench offline` on another commit against the working tree, alternating.

    .venv/bin/python scripts/bench_ab.py REV [--rounds 3] [-- bench offline options]

REV is checked out into a temporary git worktree and imported through a shim folder
(`loraplex` -> that worktree's `_loraplex/`) put first on PYTHONPATH, so both sides run
with this checkout's `.venv` and differ only in loraplex's code. Runs alternate
(before, after, before, after, ...) because these VMs drift within an hour; the script
prints every run's engine tok/s, the load average before it, the CPU model, and the
after/before ratio of the medians.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_LINE = re.compile(r"^\s*loraplex: .* = ([0-9.]+) generated tokens/s", re.MULTILINE)
logger = logging.getLogger("bench_ab")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run_bench(pythonpath: str | None, options: list[str]) -> tuple[float, str]:
    """(engine tok/s, load average before) of one `bench offline` run."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    load = Path("/proc/loadavg").read_text().strip()
    command = [sys.executable, "-m", "loraplex.cli", "bench", "offline", *options]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    match = ENGINE_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"bench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return float(match.group(1)), load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the commit to compare against (before)")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.options = argv[split + 1 :]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        tree, shim = Path(tmp) / "tree", Path(tmp) / "shim"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), args.rev],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            shim.mkdir()
            (shim / "loraplex").symlink_to(tree / "_loraplex")
            results: dict[str, list[float]] = {"before": [], "after": []}
            for round_index in range(args.rounds):
                for side, path in (("before", str(shim)), ("after", None)):
                    rate, load = run_bench(path, args.options)
                    results[side].append(rate)
                    sys.stdout.write(
                        f"round {round_index + 1} {side:>6}: {rate:.1f} tok/s (load {load})\n"
                    )
                    sys.stdout.flush()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    before, after = (statistics.median(results[s]) for s in ("before", "after"))
    sys.stdout.write(
        f"{cpu_model()}: before ({args.rev}) median {before:.1f} tok/s, after (working "
        f"tree) median {after:.1f} tok/s, after/before {after / before:.3f}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
