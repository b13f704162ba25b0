"""Tenant fair share on the served path (issue 13's acceptance 3), one app per policy.

For each scheduling policy (`fair`, then `fcfs`) the script starts
scripts/bench_fair_share_config.yaml with that policy and runs `loraplex bench serve`:
0. a few untimed `light` requests, so the measured phases start on a settled app;
1. `light` alone: Poisson arrivals at `--light-rate` req/s;
2. `heavy` at 10x that rate and, once it has run for HEAVY_HEAD_START_S, `light` again
   as in 1 (new prompts), both to the end.
It prints light's TTFT p50 / p99 in both phases and their ratio, what each tenant got
(completed, refused, output tok/s against the tok/s it asked for: past saturation it
gets less), the CPU model and the load. The rate that saturates the replica depends on
the CPU: raise `--light-rate` until the heavy tenant gets less than it asks for. The
figures of record are in docs/operations.md (Tenant fair share).

Usage: .venv/bin/python scripts/bench_fair_share.py [OUTPUT_DIR] [--policies fair,fcfs]
       [--max-num-batched-tokens N] [--light-rate R] [--light-prompts N]
       [--heavy-output-len N]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from loraplex.tools.engine_bench.offline import cpu_model, read_loadavg
from loraplex.tools.serve_bench.report import first_burst_figures
from loraplex.tools.serve_bench.server import ServeApp, wait_until_stopped

logger = logging.getLogger("bench_fair_share")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "scripts" / "bench_fair_share_config.yaml"
URL = "http://127.0.0.1:8000"
MODEL = "smollm2-135m-instruct"
KEYS = {"light": "sk-bench-light", "heavy": "sk-bench-heavy"}
HEAVY_TIMES_LIGHT = 10
HEAVY_HEAD_START_S = 15.0
SETTLE_PROMPTS = 8
PROMPT_LEN, OUTPUT_LEN = 64, 16


def bench(
    tenant: str, rate: float, prompts: int, seed: int, out: Path, output_len: int = OUTPUT_LEN
) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).with_name("loraplex")),
        "bench", "serve", "--url", URL, "--api-key", KEYS[tenant], "--model", MODEL,
        "--num-prompts", str(prompts), "--request-rate", str(rate),
        "--prompt-len", str(PROMPT_LEN), "--output-len", str(output_len),
        "--seed", str(seed), "--timeout", "120", "--output-dir", str(out),
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "client.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def run_policy(
    policy: str,
    out: Path,
    engine_options: dict,
    light_rate: float,
    light_prompts: int,
    heavy_output_len: int,
) -> dict:
    config = yaml.safe_load(CONFIG.read_text())
    engine = config["applications"][0]["args"]["models"][0]["engine"]
    engine.update(engine_options, policy=policy)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        log = out / f"serve-{policy}.log"
        with ServeApp(path, URL, log, api_key=KEYS["light"], cwd=ROOT):
            bench("light", light_rate, SETTLE_PROMPTS, 0, out / policy / "settle").wait()
            load = {"before": read_loadavg()}
            bench("light", light_rate, light_prompts, 1, out / policy / "alone").wait()
            load["alone"] = read_loadavg()
            heavy_rate = HEAVY_TIMES_LIGHT * light_rate
            heavy_prompts = int(heavy_rate * (HEAVY_HEAD_START_S + light_prompts / light_rate))
            heavy = bench(
                "heavy", heavy_rate, heavy_prompts, 3, out / policy / "heavy", heavy_output_len
            )
            time.sleep(HEAVY_HEAD_START_S)
            bench("light", light_rate, light_prompts, 2, out / policy / "together").wait()
            load["together"] = read_loadavg()
            heavy.wait()
    wait_until_stopped(URL)
    return {
        "alone": first_burst_figures(out / policy / "alone" / "bench_serve.json"),
        "together": first_burst_figures(out / policy / "together" / "bench_serve.json"),
        "heavy": first_burst_figures(out / policy / "heavy" / "bench_serve.json"),
        "load": load,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", default="bench-fair-share-results")
    parser.add_argument("--policies", default="fair,fcfs")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine's step budget (default: the config's)",
    )
    parser.add_argument("--light-rate", type=float, default=0.5, help="light req/s")
    parser.add_argument("--light-prompts", type=int, default=30)
    parser.add_argument(
        "--heavy-output-len",
        type=int,
        default=OUTPUT_LEN,
        help="the heavy tenant's output tokens (longer: its requests hold places longer)",
    )
    args = parser.parse_args()
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    engine_options = {}
    if args.max_num_batched_tokens is not None:
        engine_options["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = {
        policy: run_policy(
            policy, out, engine_options, args.light_rate, args.light_prompts, args.heavy_output_len
        )
        for policy in args.policies.split(",")
    }
    heavy_rate = HEAVY_TIMES_LIGHT * args.light_rate
    (out / "fair_share.json").write_text(json.dumps(results, indent=1))
    logger.info("machine: %s; light %.1f req/s, %d -> %d tokens; heavy %.1f req/s, %d -> %d",
                cpu_model(), args.light_rate, PROMPT_LEN, OUTPUT_LEN, heavy_rate, PROMPT_LEN,
                args.heavy_output_len)  # fmt: skip
    for policy, result in results.items():
        alone, together, heavy = result["alone"], result["together"], result["heavy"]
        logger.info(
            "%s: light TTFT p50/p99 alone %.3f/%.3f s, with heavy %.3f/%.3f s (p99 %.2fx); "
            "light %d/%d ok %s; heavy %d/%d ok %s, %.1f tok/s of %.1f asked; loadavg %s",
            policy, alone["ttft_p50_s"], alone["ttft_p99_s"], together["ttft_p50_s"],
            together["ttft_p99_s"], together["ttft_p99_s"] / alone["ttft_p99_s"],
            together["completed"], together["sent"], together["failures"],
            heavy["completed"], heavy["sent"], heavy["failures"], heavy["tok_s"],
            heavy_rate * args.heavy_output_len, result["load"],
        )  # fmt: skip


if __name__ == "__main__":
    main()
