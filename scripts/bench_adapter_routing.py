"""Fleet routing on the served path (issue 13's acceptance 2), one app per variant.

Two scenarios on scripts/bench_adapter_routing_config.yaml (two replicas of the default
model), each run through `loraplex bench serve --server-counters`:
1. adapters: 400 requests over 32 random rank-8 adapters with Zipf(1.1) popularity,
   8 at a time, with the residency router and with Ray Serve's default router
   (`server.request_router: power_of_two`): adapter loads per 1000 requests, TTFT p99;
2. prefixes: 400 base-model requests, 8 at a time, each a 128-token prefix out of 32
   followed by 16 tokens of its own, with the residency router's prefix affinity on and off: the
   replicas' prefix-cache hit rate, TTFT p50 / p99.
The variants of a scenario alternate (A, B, A, B) so the VM's drift falls on both.
It prints one line per run and a table, with the CPU model and the load. The figures of
record are in docs/operations.md (Fleet routing).

Usage: .venv/bin/python scripts/bench_adapter_routing.py [OUTPUT_DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from loraplex.tools.engine_bench.offline import cpu_model, read_loadavg
from loraplex.tools.serve_bench.report import first_burst_figures
from loraplex.tools.serve_bench.server import wait_until_stopped

logger = logging.getLogger("bench_adapter_routing")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "scripts" / "bench_adapter_routing_config.yaml"
URL = "http://127.0.0.1:8000"
NUM_PROMPTS = 400
MAX_CONCURRENCY = 8
"""Closed loop: TTFT is the router's and the replicas' doing, not a queue's growth."""
ADAPTERS, ZIPF_S = 32, 1.1
PREFIX_LEN, PREFIX_GROUPS = 128, 32

SCENARIOS = {
    "adapters": {
        "variants": {
            "residency": {"request_router": "residency"},
            "serve default": {"request_router": "power_of_two"},
        },
        "args": [
            "--synthetic-adapters", str(ADAPTERS), "--adapter-popularity", f"zipf:{ZIPF_S}",
            "--prompt-len", "16", "--output-len", "4",
        ],
    },
    "prefixes": {
        "variants": {
            "affinity": {"request_router": "residency", "prefix_affinity": True},
            "no affinity": {"request_router": "residency", "prefix_affinity": False},
        },
        "args": [
            "--prefix-len", str(PREFIX_LEN), "--prefix-groups", str(PREFIX_GROUPS),
            "--prompt-len", "16", "--output-len", "4",
        ],
    },
}  # fmt: skip


def variant_config(server_options: dict, folder: Path) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config["applications"][0]["args"]["models"][0]["server"].update(server_options)
    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(scenario: str, variant: str, seed: int, out: Path) -> dict:
    spec = SCENARIOS[scenario]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        config = variant_config(spec["variants"][variant], Path(folder))
        command = [
            str(Path(sys.executable).with_name("loraplex")), "bench", "serve",
            "--serve-config", str(config), "--url", URL, "--server-counters",
            "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", str(MAX_CONCURRENCY),
            "--seed", str(seed), "--timeout", "300", "--output-dir", str(out), *spec["args"],
        ]  # fmt: skip
        load_before = read_loadavg()
        with (out / "client.log").open("w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    wait_until_stopped(URL)
    figures = first_burst_figures(out / "bench_serve.json")
    server = figures.pop("server")
    result = {
        **figures,
        "loads_per_1000": 1000 * server["adapter_loads"] / figures["sent"],
        "prefix_hit_rate": server["prefix_hits"] / max(server["prefix_queries"], 1),
        "load_before": load_before,
        "load_after": read_loadavg(),
    }
    logger.info("%s / %s (seed %d): %s", scenario, variant, seed, result)
    return result


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", default="bench-adapter-routing-results")
    parser.add_argument("--rounds", type=int, default=1, help="A, B runs per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    out = Path(args.output_dir).resolve()
    results: dict[str, dict[str, list[dict]]] = {}
    for scenario in args.scenarios.split(","):
        results[scenario] = {variant: [] for variant in SCENARIOS[scenario]["variants"]}
        for round_index in range(args.rounds):
            for variant in SCENARIOS[scenario]["variants"]:
                folder = out / scenario / variant.replace(" ", "-") / f"round-{round_index + 1}"
                results[scenario][variant].append(run(scenario, variant, round_index, folder))
    (out / "adapter_routing.json").write_text(json.dumps(results, indent=1))
    logger.info("machine: %s; %d requests, %d at a time, per run", cpu_model(), NUM_PROMPTS,
                MAX_CONCURRENCY)  # fmt: skip
    for scenario, variants in results.items():
        for variant, runs in variants.items():
            for index, r in enumerate(runs, start=1):
                logger.info(
                    "%-8s %-13s round %d: %d/%d ok, adapter loads %.1f per 1000 requests, "
                    "prefix-cache hit rate %.1f%%, TTFT p50 %.2f s p99 %.2f s, %.1f tok/s, "
                    "loadavg %s -> %s",
                    scenario, variant, index, r["completed"], r["sent"], r["loads_per_1000"],
                    100 * r["prefix_hit_rate"], r["ttft_p50_s"], r["ttft_p99_s"], r["tok_s"],
                    r["load_before"], r["load_after"],
                )  # fmt: skip


if __name__ == "__main__":
    main()
