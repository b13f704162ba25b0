"""Tenant fair share inside the engine alone: what the light tenant's TTFT costs per
step budget, without the serving path (scripts/bench_fair_share.py measures it served).

One process, one engine (default model, fp32, `policy: fair` unless `--policy`), driven
by its own step loop in real time: Poisson arrivals of 64 -> 16-token requests,
`light` alone at `--light-rate` req/s, then `heavy` at 10x that rate and, 10 s later,
`light` again, until every light request has its first token (the heavy tenant's
backlog is then dropped). TTFT is taken engine-side: from a request's arrival to the
end of the step that sampled its first token. For each `--configs` entry (step budget x
`max_num_seqs`) it prints light's TTFT p50 / p99 alone and with heavy, their p99
ratio, the heavy tenant's output tok/s, step times while both ran, preemptions, the
CPU model and the load. On a CPU a step's time grows with its rows, so the light
tenant's TTFT under load is at least one step of the heavy tenant's batch: the sweep
shows what a smaller step buys the light tenant and costs the heavy one.

Usage: .venv/bin/python scripts/bench_fair_share_engine.py [--configs 256x32,64x8]
       [--light-rate R] [--light-prompts N] [--policy fair] [--heavy-output-len N]
       [--heavy-prompt-len N]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from dataclasses import dataclass

from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams
from loraplex.tools.engine_bench.offline import cpu_model, read_loadavg

logger = logging.getLogger("bench_fair_share_engine")

PROMPT_LEN, OUTPUT_LEN = 64, 16
HEAVY_TIMES_LIGHT = 10
HEAVY_HEAD_START_S = 10.0


@dataclass(frozen=True)
class Arrival:
    at_s: float
    phase: str
    """'alone' or 'together' (light), or 'heavy'."""

    @property
    def tenant(self) -> str:
        return "heavy" if self.phase == "heavy" else "light"


def poisson(rate: float, count: int, start_s: float, seed: int, phase: str) -> list[Arrival]:
    rng, at = random.Random(seed), start_s
    arrivals = []
    for _ in range(count):
        at += rng.expovariate(rate)
        arrivals.append(Arrival(at, phase))
    return arrivals


def workload(light_rate: float, light_prompts: int) -> tuple[list[Arrival], float, float]:
    """Every arrival in time order, when heavy starts and when light comes back."""
    alone = poisson(light_rate, light_prompts, 0.0, 1, "alone")
    heavy_start = alone[-1].at_s + 2.0
    light_back = heavy_start + HEAVY_HEAD_START_S
    heavy_rate = HEAVY_TIMES_LIGHT * light_rate
    heavy_count = int(heavy_rate * (HEAVY_HEAD_START_S + light_prompts / light_rate))
    heavy = poisson(heavy_rate, heavy_count, heavy_start, 3, "heavy")
    together = poisson(light_rate, light_prompts, light_back, 2, "together")
    return sorted(alone + heavy + together, key=lambda a: a.at_s), heavy_start, light_back


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(
    budget: int,
    max_num_seqs: int,
    policy: str,
    light_rate: float,
    prompts: int,
    heavy_output_len: int,
    heavy_prompt_len: int,
) -> dict:
    llm = LLM(
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        policy=policy,
        kv_cache_memory_bytes=512 << 20,
        max_model_len=2048,
    )
    engine = llm.engine
    params = {
        tenant: SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
        for tenant, length in (("light", OUTPUT_LEN), ("heavy", heavy_output_len))
    }
    arrivals, heavy_start, light_back = workload(light_rate, prompts)
    token_rng = random.Random(0)
    phase_of: dict[str, Arrival] = {}
    first_token_s: dict[str, float] = {}
    heavy_tokens: dict[str, int] = {}
    step_times: list[float] = []
    light_left = sum(a.tenant == "light" for a in arrivals)
    start, next_arrival = time.monotonic(), 0
    while light_left:
        now = time.monotonic() - start
        while next_arrival < len(arrivals) and arrivals[next_arrival].at_s <= now:
            arrival = arrivals[next_arrival]
            request_id = f"{arrival.phase}-{next_arrival}"
            length = heavy_prompt_len if arrival.tenant == "heavy" else PROMPT_LEN
            prompt = [token_rng.randrange(100, 20000) for _ in range(length)]
            engine.add_group(
                engine.make_request_group(
                    request_id, prompt, params[arrival.tenant], tenant=arrival.tenant
                )
            )
            phase_of[request_id] = arrival
            next_arrival += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[next_arrival].at_s - now))
            continue
        step_start = time.monotonic() - start
        outputs = engine.step()
        step_end = time.monotonic() - start
        if light_back <= step_start <= light_back + prompts / light_rate:
            step_times.append(step_end - step_start)
        for output in outputs:
            tenant = phase_of[output.request_id].tenant
            if output.request_id not in first_token_s and output.outputs[0].token_ids:
                first_token_s[output.request_id] = step_end
                light_left -= tenant == "light"
            if tenant == "heavy":
                heavy_tokens[output.request_id] = len(output.outputs[0].token_ids)
    heavy_end = time.monotonic() - start
    ttft = {
        phase: [first_token_s[r] - a.at_s for r, a in phase_of.items() if a.phase == phase]
        for phase in ("alone", "together")
    }
    return {
        "alone_p50": percentile(ttft["alone"], 0.5),
        "alone_p99": percentile(ttft["alone"], 0.99),
        "together_p50": percentile(ttft["together"], 0.5),
        "together_p99": percentile(ttft["together"], 0.99),
        "heavy_tok_s": sum(heavy_tokens.values()) / (heavy_end - heavy_start),
        "step_p50": statistics.median(step_times),
        "step_p99": percentile(step_times, 0.99),
        "preemptions": engine.scheduler.num_preemptions,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="256x32,128x32,64x16,64x8")
    parser.add_argument("--light-rate", type=float, default=2.0, help="light req/s")
    parser.add_argument("--light-prompts", type=int, default=40)
    parser.add_argument("--policy", default="fair")
    parser.add_argument(
        "--heavy-output-len",
        type=int,
        default=OUTPUT_LEN,
        help="the heavy tenant's output tokens (longer: its requests hold places longer)",
    )
    parser.add_argument(
        "--heavy-prompt-len",
        type=int,
        default=PROMPT_LEN,
        help="the heavy tenant's prompt tokens (longer: prefill chunks fill its steps)",
    )
    args = parser.parse_args()
    logger.info("machine: %s; light %.1f req/s, %d -> %d tokens; heavy %.1f req/s, %d -> %d",
                cpu_model(), args.light_rate, PROMPT_LEN, OUTPUT_LEN,
                HEAVY_TIMES_LIGHT * args.light_rate, args.heavy_prompt_len,
                args.heavy_output_len)  # fmt: skip
    for config in args.configs.split(","):
        budget, max_num_seqs = (int(part) for part in config.split("x"))
        load = read_loadavg()
        r = run(
            budget,
            max_num_seqs,
            args.policy,
            args.light_rate,
            args.light_prompts,
            args.heavy_output_len,
            args.heavy_prompt_len,
        )
        logger.info(
            "budget %d x max_num_seqs %d (%s): light TTFT p50/p99 alone %.3f/%.3f s, with "
            "heavy %.3f/%.3f s (p99 %.2fx); heavy %.1f tok/s; steps p50/p99 %.3f/%.3f s; "
            "%d preemptions; loadavg %s -> %s",
            budget, max_num_seqs, args.policy, r["alone_p50"], r["alone_p99"],
            r["together_p50"], r["together_p99"], r["together_p99"] / r["alone_p99"],
            r["heavy_tok_s"], r["step_p50"], r["step_p99"], r["preemptions"], load,
            read_loadavg(),
        )  # fmt: skip


if __name__ == "__main__":
    main()
