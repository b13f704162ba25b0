"""The GEMM ceiling: the ideal schedule against the real scheduler, the ceiling sum,
`dtype: auto` and the bench's ceiling report."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.cache_dir import CACHE_DIR_ENV
from loraplex.platform.config import AUTO_DTYPE, EngineConfig, SchedulerConfig
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams
from loraplex.platform.scheduler import Scheduler
from loraplex.tools.engine_bench import ceiling, gemm_probe
from loraplex.tools.engine_bench import offline as bench
from loraplex.tools.engine_bench.ceiling import FixedWorkload, StepRows, ideal_schedule
from loraplex.tools.engine_bench.gemm_probe import GemmTimes, Projection


@pytest.fixture
def quick_probe(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_probe, "MIN_TIMED_S", 0.001)
    monkeypatch.setattr(ceiling, "QUICK_PROBE_S", 0.001)
    return tmp_path


def engine_steps(llm: LLM, workload: FixedWorkload, monkeypatch) -> list[StepRows]:
    """The (tokens, sampled rows) of every step the real engine runs for `workload`."""
    steps: list[StepRows] = []
    real_schedule = Scheduler.schedule

    def recording(self):
        out = real_schedule(self)
        if not out.empty:
            steps.append(StepRows(out.num_tokens, sum(item.samples for item in out.scheduled)))
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    prompts = [
        [5 + (i * 7 + j) % 200 for j in range(workload.prompt_len)]
        for i in range(workload.num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return steps


@pytest.mark.parametrize(
    ("workload", "budget", "max_seqs", "chunked"),
    [
        (FixedWorkload(6, 10, 4), 16, 4, True),
        (FixedWorkload(5, 7, 3), 64, 8, True),
        (FixedWorkload(4, 12, 2), 12, 3, False),
    ],
)
def test_ideal_schedule_is_the_schedulers(
    tiny_model_factory, monkeypatch, workload, budget, max_seqs, chunked
):
    options = {
        "dtype": "float32",
        "max_model_len": 64,
        "max_num_batched_tokens": budget,
        "max_num_seqs": max_seqs,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": False,
    }
    llm = LLM(str(tiny_model_factory("llama")), **options)
    scheduler = llm.engine.config.scheduler
    assert engine_steps(llm, workload, monkeypatch) == ideal_schedule(workload, scheduler)


def test_ideal_schedule_of_the_reference_workload():
    steps = ideal_schedule(ceiling.REFERENCE_WORKLOAD, SchedulerConfig(max_num_seqs=64))
    assert sum(s.sampled for s in steps) == 64 * 64
    assert sum(s.tokens for s in steps) == 64 * 128 + 64 * 63
    assert steps[0] == StepRows(2048, 16)
    assert max(s.tokens for s in steps) <= 2048


def test_ceiling_sums_every_projection_of_every_step():
    projections = (Projection("qkv", 8, 8, 3), Projection("lm_head", 8, 8, 1))
    times = GemmTimes(
        "float32",
        2,
        seconds={"qkv": {4: 1.0, 2: 0.5}, "lm_head": {1: 10.0, 2: 20.0}},
        backend={"qkv": {4: "mkl", 2: "mkl"}, "lm_head": {1: "mkl", 2: "mkl"}},
    )
    steps = [StepRows(4, 1), StepRows(2, 2), StepRows(2, 0)]
    expected = (3 * 1.0 + 10.0) + (3 * 0.5 + 20.0) + 3 * 0.5
    assert ceiling.ceiling_seconds(projections, steps, times) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("seconds", "chosen"),
    [
        ({torch.float32: 10.0, torch.bfloat16: 9.6}, torch.float32),
        ({torch.float32: 10.0, torch.bfloat16: 9.0}, torch.bfloat16),
        ({torch.float32: 10.0, torch.bfloat16: 16.0, torch.float16: 8.0}, torch.float16),
        ({torch.float32: 10.0, torch.bfloat16: 12.0}, torch.float32),
    ],
)
def test_auto_prefers_fp32_unless_a_half_dtype_is_clearly_faster(
    tiny_model_factory, monkeypatch, seconds, chosen
):
    from loraplex.platform.arch import ModelArch

    monkeypatch.setattr(ceiling, "candidate_dtypes", lambda device: tuple(seconds))
    monkeypatch.setattr(ceiling, "step_mix_seconds", lambda arch, dtype, w, s: seconds[dtype])
    arch = ModelArch.from_folder(tiny_model_factory("llama"))
    assert ceiling.measure_dtype(arch, SchedulerConfig())[0] == chosen


def test_the_probe_records_what_an_auto_engine_then_runs(tiny_model_factory, quick_probe, caplog):
    """`loraplex probe dtype` measures (GEMM probe files appear) and records its pick;
    an engine with `dtype: auto` reads the record and says so."""
    from loraplex.platform.arch import ModelArch

    assert EngineConfig.from_options("m", {}).model.dtype == AUTO_DTYPE
    folder = tiny_model_factory("llama")
    dtype, path = ceiling.record_dtype(ModelArch.from_folder(folder), SchedulerConfig())
    assert dtype in gemm_probe.candidate_dtypes(torch.device("cpu"))
    assert path.is_file() and list((quick_probe / "gemm_probe").glob("*.json"))
    with caplog.at_level("INFO", logger="loraplex.platform.dtype_choice"):
        llm = LLM(str(folder), max_model_len=64)
    assert llm.engine.config.model.dtype == dtype
    assert next(llm.engine.runner.model.parameters()).dtype == dtype
    assert "measured by `loraplex probe dtype" in caplog.text


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported dtype"):
        EngineConfig.from_options("m", {"dtype": "int8"})


def test_bench_offline_reports_the_ceiling_and_the_engine_share(tiny_model_factory, quick_probe):
    report = bench.run_offline_bench(
        str(tiny_model_factory("llama")),
        "auto",
        num_requests=4,
        prompt_len=6,
        output_len=3,
        use_tqdm=False,
        ceiling=True,
    )
    native = gemm_probe.candidate_dtypes(torch.device("cpu"))
    assert report.dtype == report.ceilings[0].dtype
    assert sorted(c.dtype for c in report.ceilings) == sorted(
        [*(gemm_probe.dtype_name(d) for d in native), f"int8_dynamic/{report.dtype}"]
    )
    assert all(c.tokens_per_s > 0 and c.workload.output_tokens == 12 for c in report.ceilings)
    share = report.ceiling_share()
    assert share == pytest.approx(report.results[0].tokens_per_s / report.ceilings[0].tokens_per_s)
    text = bench.format_report(report)
    assert "engine share of its ceiling:" in text and "(engine dtype)" in text


def test_an_int8_engine_is_measured_against_its_int8_ceiling(tiny_model_factory, quick_probe):
    report = bench.run_offline_bench(
        str(tiny_model_factory("llama")),
        "float32",
        num_requests=4,
        prompt_len=6,
        output_len=3,
        use_tqdm=False,
        ceiling=True,
        engine_options={"quantization": "int8"},
    )
    assert report.ceilings[0].dtype == "int8_dynamic/float32"
    assert "float32" in [c.dtype for c in report.ceilings[1:]]
    assert report.ceiling_share() == pytest.approx(
        report.results[0].tokens_per_s / report.ceilings[0].tokens_per_s
    )


def test_the_ceiling_is_for_the_base_model():
    with pytest.raises(ValueError, match="without adapters"):
        bench.run_offline_bench("m", "auto", 1, 1, 1, adapters=2, ceiling=True)
