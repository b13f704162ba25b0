"""The `loraplex` CLI wiring and the offline benchmark's building blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams
from loraplex.tools import cli
from loraplex.tools.engine_bench import offline as bench


def test_generate_arguments():
    args = cli.build_parser().parse_args(
        ["generate", "hello there", "--max-tokens", "5", "--temperature", "0.5", "--no-chat"]
    )
    assert args.handler is cli.run_generate
    assert (args.prompt, args.max_tokens, args.temperature, args.chat) == (
        "hello there",
        5,
        0.5,
        False,
    )
    assert (args.model, args.dtype) == (cli.DEFAULT_MODEL, "auto")
    assert cli.build_parser().parse_args(["generate", "x"]).chat is None


def test_bench_offline_arguments():
    args = cli.build_parser().parse_args(
        ["bench", "offline", "--dtype", "bfloat16", "--num-requests", "8", "--baseline", "hf"]
    )
    assert args.handler is cli.run_bench_offline
    assert (args.dtype, args.num_requests, args.baseline) == ("bfloat16", 8, "hf")
    assert (args.prompt_len, args.output_len, args.hf_batch_size) == (128, 64, None)
    assert args.max_num_seqs is None


def test_bad_arguments_exit():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "offline", "--dtype", "int8"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([])


def test_workload_has_exact_lengths_and_is_seeded():
    pool = list(range(10, 500))
    workload = bench.build_workload(pool, num_requests=5, prompt_len=17, output_len=3, seed=1)
    assert workload.num_requests == 5 and workload.total_output_tokens == 15
    assert all(len(prompt) == 17 for prompt in workload.prompts)
    assert all(set(prompt) <= set(pool) for prompt in workload.prompts)
    assert workload == bench.build_workload(pool, 5, 17, 3, seed=1)
    assert workload != bench.build_workload(pool, 5, 17, 3, seed=2)
    with pytest.raises(ValueError):
        bench.build_workload(pool, 0, 17, 3)


def test_normal_token_ids_skip_special_and_out_of_vocab():
    tokenizer = type("Tok", (), {"all_special_ids": [0, 2], "__len__": lambda self: 6})()
    assert bench.normal_token_ids(tokenizer, vocab_size=5) == [1, 3, 4]


def test_left_pad():
    input_ids, mask = bench.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_stream_text_yields_deltas():
    class FakeEngine:
        def __init__(self) -> None:
            self.texts = iter(["He", "Hell", "Hell", "Hello!"])
            self.done = False

        def add_request(self, request_id, prompt, params) -> None:
            self.request_id = request_id

        def has_unfinished(self) -> bool:
            return not self.done

        def step(self):
            text = next(self.texts, None)
            if text is None:
                self.done = True
                return []
            return [SimpleNamespace(request_id=self.request_id, text=text)]

    assert list(cli.stream_text(FakeEngine(), "r", "prompt", None)) == ["He", "ll", "o!"]


def test_run_engine_warms_up_then_times_the_workload():
    class FakeLLM:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def generate(self, prompts, params, use_tqdm=False):
            self.calls.append((len(prompts), params.max_tokens))
            assert params.greedy and params.ignore_eos
            return [SimpleNamespace(token_ids=[1] * params.max_tokens) for _ in prompts]

    llm = FakeLLM()
    workload = bench.build_workload(range(100), 6, 4, 9)
    warmup = bench.build_workload(range(100), 3, 4, 9, seed=1)
    assert not set(map(tuple, warmup.prompts)) & set(map(tuple, workload.prompts))
    result = bench.run_engine(llm, workload, use_tqdm=False, warmup_prompts=warmup.prompts)
    assert llm.calls == [(3, bench.WARMUP_TOKENS), (6, 9)]
    assert result.output_tokens == 54 and result.tokens_per_s > 0


def test_hf_baseline_on_tiny_llama(tiny_model_factory):
    folder = tiny_model_factory("llama")
    workload = bench.build_workload(range(1, 512), num_requests=5, prompt_len=6, output_len=4)
    result = bench.run_hf(folder, workload, torch.float32, batch_size=2, use_tqdm=False)
    assert result.name == "hf"
    assert result.num_requests == 5 and result.output_tokens == 20
    assert result.elapsed_s > 0 and result.tokens_per_s > 0


def test_format_report_shows_rates_ratio_and_load():
    workload = bench.build_workload(range(100), 2, 3, 4)
    report = bench.BenchReport(
        model="m",
        dtype="float32",
        workload=workload,
        machine=bench.MachineInfo.collect(),
        load_before="0.1 0.2 0.3",
        load_after="0.4 0.5 0.6",
        results=[
            bench.RunResult("loraplex", 2, 8, 1.0),
            bench.RunResult("hf", 2, 8, 2.0),
        ],
    )
    text = bench.format_report(report)
    assert "8.0 generated tokens/s" in text and "4.0 generated tokens/s" in text
    assert "ratio ours/hf: 2.00x" in text
    assert "loadavg before: 0.1 0.2 0.3" in text and "loadavg after: 0.4 0.5 0.6" in text
    assert "torch" in text and "threads" in text


def test_generate_streams_from_the_engine(tiny_model_factory, capsys):
    folder = tiny_model_factory("llama")
    argv = ["generate", "w1 w2 w3", "--no-chat", "--model", str(folder), "--max-tokens", "4"]
    code = cli.main(argv)
    assert code == 0
    streamed = capsys.readouterr().out
    llm = LLM(model=str(folder))
    whole = llm.generate(["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=4))
    assert streamed == whole[0].text + "\n"
    assert streamed.strip()


def test_bench_offline_end_to_end(tiny_model_factory, capsys):
    folder = tiny_model_factory("llama")
    argv = ["bench", "offline", "--model", str(folder), "--num-requests", "3"]
    argv += ["--prompt-len", "5", "--output-len", "3", "--baseline", "hf", "--hf-batch-size", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "loraplex: 9 tokens" in out and "hf: 9 tokens" in out
    assert "ratio ours/hf:" in out and "loadavg after:" in out


def test_bench_offline_guided_end_to_end(tiny_model_factory, capsys):
    folder = tiny_model_factory("llama", tokenizer="bytes")
    argv = ["bench", "offline", "--guided", "--model", str(folder), "--dtype", "float32"]
    argv += ["--num-requests", "2", "--prompt-len", "4", "--output-len", "6", "--rounds", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 requests x 4 prompt tokens -> 6 tokens each" in out
    assert out.count("the unguided time per output token") == 2
