"""What guided decoding costs: `loraplex bench offline --guided`.

One engine runs the same batch three ways, alternating per round (unguided, JSON
schema, regex, unguided, ...) so a drifting machine hits all alike: `num_requests`
seeded random prompts of `prompt_len` tokens, all submitted at once (the batch is
`max_num_seqs`, 32 by default), each producing exactly `output_len` tokens:

    unguided  greedy, EOS ignored
    json      greedy, guided by a schema no answer of `output_len` tokens can finish
              (an object whose one string needs 8 characters per output token), so
              every request runs to `max_tokens`
    regex     greedy, guided by `[a-z ,.]{8 * output_len}`, likewise

The figure is each guided run's time per output token over the unguided run's in the
same round, averaged over rounds: the price of compiling nothing (grammars are cached
after the first round), filling each guided row's token bitmask, masking the logits and
advancing each matcher, per step.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from loraplex.platform.config import dtype_name
from loraplex.platform.guided import GuidedSpec
from loraplex.platform.model_files import resolve_model_folder
from loraplex.platform.request import SamplingParams
from loraplex.tools.engine_bench.offline import (
    MachineInfo,
    build_workload,
    model_vocab_size,
    normal_token_ids,
    read_loadavg,
)

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 8
"""Guided answers need this many characters per output token: none can end early."""
KINDS = ("unguided", "json", "regex")


def guided_specs(output_len: int) -> dict[str, GuidedSpec | None]:
    """Each run kind's spec: none, or one that no answer of `output_len` tokens finishes."""
    length = CHARS_PER_TOKEN * output_len
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": length}},
        "required": ["text"],
        "additionalProperties": False,
    }
    return {
        "unguided": None,
        "json": GuidedSpec("json_schema", json.dumps(schema)),
        "regex": GuidedSpec("regex", f"[a-z ,.]{{{length}}}"),
    }


@dataclass
class GuidedReport:
    model: str
    dtype: str
    num_requests: int
    prompt_len: int
    output_len: int
    max_num_seqs: int
    rounds: int
    machine: MachineInfo
    load_before: str
    load_after: str = ""
    seconds: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})

    def ratio(self, kind: str) -> float:
        """Mean over rounds of this kind's time over the unguided time of that round."""
        pairs = zip(self.seconds[kind], self.seconds["unguided"], strict=True)
        ratios = [guided / plain for guided, plain in pairs]
        return sum(ratios) / len(ratios)


def run_guided_bench(
    model: str | None,
    dtype: str,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    rounds: int,
    seed: int,
    engine_options: dict[str, object],
) -> GuidedReport:
    from loraplex.platform.llm import LLM

    folder = resolve_model_folder(model)
    options = {"max_num_seqs": 32, **engine_options}
    llm = LLM(str(folder), dtype=dtype, seed=seed, **options)
    pool = normal_token_ids(llm.tokenizer, model_vocab_size(folder))
    workload = build_workload(pool, num_requests, prompt_len, output_len, seed)
    specs = guided_specs(output_len)
    report = GuidedReport(
        model=str(folder),
        dtype=dtype_name(llm.engine.config.model.dtype),
        num_requests=num_requests,
        prompt_len=prompt_len,
        output_len=output_len,
        max_num_seqs=int(options["max_num_seqs"]),
        rounds=rounds,
        machine=MachineInfo.collect(),
        load_before=read_loadavg(),
    )
    expected = num_requests * output_len

    def run(kind: str) -> float:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=output_len,
            ignore_eos=specs[kind] is None,
            guided=specs[kind],
        )
        gc.collect()
        started = time.perf_counter()
        outputs = llm.generate(workload.prompts, params)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if tokens != expected:
            raise RuntimeError(f"{kind} run generated {tokens} tokens, expected {expected}")
        return elapsed

    run("unguided")
    for kind in KINDS[1:]:
        run(kind)  # compiles the grammar once, as a served replica's cache would
    with tqdm(total=rounds * len(KINDS), desc="guided bench", unit="run") as bar:
        for _ in range(rounds):
            for kind in KINDS:
                report.seconds[kind].append(run(kind))
                bar.update()
    report.load_after = read_loadavg()
    return report


def format_guided_report(report: GuidedReport) -> str:
    machine = report.machine
    tokens = report.num_requests * report.output_len
    lines = [
        f"guided decoding cost: {report.model} ({report.dtype})",
        f"  {report.num_requests} requests x {report.prompt_len} prompt tokens -> "
        f"{report.output_len} tokens each, max_num_seqs {report.max_num_seqs}, "
        f"{report.rounds} alternating rounds",
        f"  machine: {machine.processor}, {machine.usable_cores} usable cores, "
        f"torch {machine.torch_version} with {machine.torch_threads} threads",
        f"  load before {report.load_before}, after {report.load_after}",
    ]
    for kind in KINDS:
        seconds = report.seconds[kind]
        mean = sum(seconds) / len(seconds)
        line = f"  {kind:9s} {mean:7.2f} s  {tokens / mean:8.1f} tok/s"
        if kind != "unguided":
            line += f"  {report.ratio(kind):.2f}x the unguided time per output token"
        lines.append(line)
    return "\n".join(lines) + "\n"
