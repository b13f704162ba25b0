"""Speculative decoding A/B: `loraplex bench offline --speculative ngram`.

Two engines in this process, one with speculative decoding and one without, same
weights, dtype and threads, run the same single-stream workloads (one request at a
time, as a latency-bound client sees it), alternating A, B, A, B per round so a
drifting machine hits both alike:

    copy-heavy   chat prompts that quote a passage and ask for it back, repeated or
                 corrected (the answer copies prompt text); greedy, up to
                 `output_len` tokens, EOS ends a request
    random       prompts of `prompt_len` random ordinary token ids; greedy,
                 exactly `output_len` tokens (EOS ignored)

Per run: generated tokens over wall time (prefill included), and decode tokens per
second (after each request's first token). Per workload: the speculative engine's
acceptance rate (accepted / draft tokens) and mean accepted length (tokens per
verification step), and whether both engines produced the same tokens.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from loraplex.platform.config import dtype_name, parse_dtype_option
from loraplex.platform.model_files import resolve_model_folder
from loraplex.platform.request import SamplingParams
from loraplex.tools.engine_bench.offline import (
    MachineInfo,
    model_vocab_size,
    normal_token_ids,
    read_loadavg,
)

logger = logging.getLogger(__name__)

COPY_HEAVY, RANDOM = "copy-heavy", "random"
INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, fixing any mistakes, and return the full text:",
)
PASSAGES = (
    "The old lighthouse stood at the edge of the cliff for more than a century. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and watched the beam "
    "sweep across the dark water. Ships passing the point relied on that light to find "
    "the channel between the rocks.",
    "To make the bread, mix the flour, salt and yeast in a large bowl. Add warm water "
    "slowly and stir until a soft dough forms. Knead it for ten minutes, cover the bowl "
    "with a cloth and leave it in a warm place until it has doubled in size.",
    "Our team meets every Monday at nine to plan the week. Each person shares what they "
    "finished, what they will work on next and anything that blocks them. The meeting "
    "ends after thirty minutes, and the notes are posted in the shared folder.",
    "The river starts as a small stream high in the mountains. It gathers water from "
    "melting snow and many little creeks, then winds through forests and farmland "
    "before it reaches the sea near the harbor town.",
    "Please return the borrowed books to the front desk by Friday. Books returned late "
    "cost ten cents per day, and lost books must be replaced. Members may renew a book "
    "twice unless another reader has reserved it.",
    "The garden has three raised beds. The first holds tomatoes and basil, the second "
    "grows beans that climb a wooden frame, and the third is full of carrots, onions "
    "and lettuce that we pick for salads all summer.",
    "When the train arrived, the platform was crowded with travelers. A conductor "
    "checked tickets at the door while porters carried heavy bags. Within five minutes "
    "every seat was taken and the train left the station on time.",
    "Solar panels turn sunlight into electricity. The cells inside each panel are made "
    "of silicon, and when light strikes them, electrons begin to move and create a "
    "current. An inverter then changes that current into the kind used in homes.",
)


@dataclass(frozen=True)
class SpecWorkload:
    name: str
    prompts: list[list[int]]
    params: SamplingParams


@dataclass(frozen=True)
class SpecRun:
    """One engine's timed pass over one workload."""

    workload: str
    speculative: bool
    round: int
    output_tokens: int
    elapsed_s: float
    decode_tokens: int
    decode_s: float
    token_ids: list[list[int]]
    drafts: tuple[int, int, int] = (0, 0, 0)
    """Verification steps, draft tokens and accepted tokens during the run."""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("inf")


@dataclass
class SpecBenchReport:
    model: str
    dtype: str
    speculative_config: dict[str, object]
    machine: MachineInfo
    load_before: str
    workloads: dict[str, tuple[int, float]] = field(default_factory=dict)
    """name -> (requests, mean prompt tokens)."""
    runs: list[SpecRun] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    """/proc/loadavg after each run, in run order."""
    load_after: str = ""

    def summary(self, workload: str) -> dict[str, float]:
        """Totals over the rounds of one workload: tok/s both ways and their ratio,
        acceptance rate, mean accepted length, identical outputs (1.0 or 0.0)."""
        base = [r for r in self.runs if r.workload == workload and not r.speculative]
        spec = [r for r in self.runs if r.workload == workload and r.speculative]

        def rate(runs: list[SpecRun], decode: bool) -> float:
            if decode:
                return sum(r.decode_tokens for r in runs) / sum(r.decode_s for r in runs)
            return sum(r.output_tokens for r in runs) / sum(r.elapsed_s for r in runs)

        steps = sum(r.drafts[0] for r in spec)
        drafted = sum(r.drafts[1] for r in spec)
        accepted = sum(r.drafts[2] for r in spec)
        return {
            "base_tok_s": rate(base, False),
            "spec_tok_s": rate(spec, False),
            "ratio": rate(spec, False) / rate(base, False),
            "base_decode_tok_s": rate(base, True),
            "spec_decode_tok_s": rate(spec, True),
            "decode_ratio": rate(spec, True) / rate(base, True),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1.0 + accepted / steps if steps else 1.0,
            "identical": float(
                all(b.token_ids == s.token_ids for b, s in zip(base, spec, strict=True))
            ),
        }


def copy_heavy_prompts(llm, num_requests: int) -> list[list[int]]:
    """Chat prompts quoting a passage and asking for it back (repeated, or corrected),
    cycling over passages and instructions."""
    prompts = []
    for index in range(num_requests):
        passage = PASSAGES[index % len(PASSAGES)]
        instruction = INSTRUCTIONS[(index // len(PASSAGES)) % len(INSTRUCTIONS)]
        message = {"role": "user", "content": f"{instruction}\n\n{passage}"}
        prompts.append(llm.chat_prompt_ids([message]))
    return prompts


def run_single_stream(
    llm, workload: SpecWorkload, speculative: bool, round_index: int, use_tqdm: bool
) -> SpecRun:
    """Times the workload one request at a time; the decode time of a request starts
    at its first token."""
    engine = llm.engine
    stats = engine.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    outputs: list[list[int]] = []
    decode_s = 0.0
    label = f"{workload.name} {'spec' if speculative else 'base'} {round_index + 1}"
    started = time.perf_counter()
    for index, prompt in enumerate(tqdm(workload.prompts, disable=not use_tqdm, desc=label)):
        request_id = f"spec-bench-{int(speculative)}-{round_index}-{index}"
        engine.add_request(request_id, prompt, workload.params)
        first = None
        final = None
        while engine.has_unfinished():
            for output in engine.step():
                if first is None and output.token_ids:
                    first = time.perf_counter()
                if output.finished:
                    final = output
        decode_s += time.perf_counter() - first
        outputs.append(list(final.token_ids))
    elapsed = time.perf_counter() - started
    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    tokens = sum(len(ids) for ids in outputs)
    return SpecRun(
        workload=workload.name,
        speculative=speculative,
        round=round_index,
        output_tokens=tokens,
        elapsed_s=elapsed,
        decode_tokens=tokens - len(outputs),
        decode_s=decode_s,
        token_ids=outputs,
        drafts=tuple(b - a for a, b in zip(before, after, strict=True)),
    )


def run_spec_bench(
    model: str,
    dtype: str,
    speculative_config: dict[str, object],
    num_requests: int = 8,
    prompt_len: int = 128,
    output_len: int = 64,
    rounds: int = 2,
    seed: int = 0,
    engine_options: dict[str, object] | None = None,
    use_tqdm: bool = True,
) -> SpecBenchReport:
    """Builds both engines and both workloads, warms each engine up on one request of
    each workload (untimed), then runs `rounds` rounds of A (without) then B (with
    speculation) over each workload."""
    from loraplex.platform.llm import LLM

    if num_requests < 1 or rounds < 1 or output_len < 1 or prompt_len < 1:
        raise ValueError("num_requests, rounds, prompt_len and output_len must be >= 1")
    folder = resolve_model_folder(model)
    options = {"max_num_seqs": 1, **(engine_options or {})}
    report = SpecBenchReport(
        model=model,
        dtype=str(parse_dtype_option(dtype)),
        speculative_config=dict(speculative_config),
        machine=MachineInfo.collect(),
        load_before=read_loadavg(),
    )
    base = LLM(model=str(folder), dtype=dtype, seed=seed, **options)
    resolved = base.engine.config.model.dtype
    report.dtype = dtype_name(resolved)
    spec = LLM(
        model=str(folder),
        dtype=resolved,
        seed=seed,
        speculative_config=speculative_config,
        **options,
    )
    pool = normal_token_ids(base.tokenizer, model_vocab_size(folder))
    workloads = _workloads(base, pool, num_requests, prompt_len, output_len, seed)
    for workload in workloads:
        report.workloads[workload.name] = (
            len(workload.prompts),
            sum(map(len, workload.prompts)) / len(workload.prompts),
        )
    for llm in (base, spec):
        for workload in workloads:
            warm = SpecWorkload(workload.name, workload.prompts[-1:], workload.params)
            run_single_stream(llm, warm, llm is spec, -1, use_tqdm=False)
    for round_index in range(rounds):
        for workload in workloads:
            for llm in (base, spec):
                run = run_single_stream(llm, workload, llm is spec, round_index, use_tqdm)
                report.runs.append(run)
                report.loads.append(read_loadavg())
    del base, spec
    gc.collect()
    report.load_after = read_loadavg()
    return report


def _workloads(
    llm, pool: list[int], num_requests: int, prompt_len: int, output_len: int, seed: int
) -> list[SpecWorkload]:
    rng = random.Random(seed)
    random_prompts = [rng.choices(pool, k=prompt_len) for _ in range(num_requests)]
    return [
        SpecWorkload(
            COPY_HEAVY,
            copy_heavy_prompts(llm, num_requests),
            SamplingParams(temperature=0.0, max_tokens=output_len),
        ),
        SpecWorkload(
            RANDOM,
            random_prompts,
            SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
        ),
    ]


def format_spec_report(report: SpecBenchReport) -> str:
    """Machine, load, workloads, every run, then per workload the ratio (target: >= 1.5x
    copy-heavy, >= 0.95x random), acceptance rate and mean accepted length."""
    m = report.machine
    lines = [
        f"machine: {m.processor}, {m.cpu_count} cpus ({m.usable_cores} usable), "
        f"torch {m.torch_version} with {m.torch_threads} threads",
        f"model: {report.model} ({report.dtype}); speculative_config: {report.speculative_config}",
        "single stream (max_num_seqs=1, one request at a time), greedy; runs alternate "
        "base (no speculation) and spec per round",
    ]
    for name, (count, mean_prompt) in report.workloads.items():
        lines.append(
            f"workload {name}: {count} requests, {mean_prompt:.0f} prompt tokens on average"
        )
    lines.append(f"loadavg before: {report.load_before}")
    for run, load in zip(report.runs, report.loads, strict=True):
        side = "spec" if run.speculative else "base"
        lines.append(
            f"  round {run.round + 1} {run.workload:>10} {side}: {run.output_tokens} tokens in "
            f"{run.elapsed_s:.2f}s = {run.tokens_per_s:.1f} tok/s "
            f"(decode {run.decode_tokens_per_s:.1f} tok/s); loadavg {load}"
        )
    targets = {COPY_HEAVY: 1.5, RANDOM: 0.95}
    for name in report.workloads:
        s = report.summary(name)
        lines.append(
            f"{name}: base {s['base_tok_s']:.1f} tok/s, spec {s['spec_tok_s']:.1f} tok/s, "
            f"ratio {s['ratio']:.2f}x (decode only {s['decode_ratio']:.2f}x; target >= "
            f"{targets[name]:g}x); acceptance rate {s['acceptance_rate']:.2f}, mean accepted "
            f"length {s['mean_accepted_length']:.2f}; identical outputs: "
            f"{'yes' if s['identical'] else 'NO'}"
        )
    lines.append(f"loadavg after: {report.load_after}")
    return "\n".join(lines) + "\n"
