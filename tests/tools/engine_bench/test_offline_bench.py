"""`loraplex bench offline --adapters N`: the three runs (engine base, engine over the
adapters, HF + PEFT grouped by adapter) and the report built from them."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.tools import cli
from loraplex.tools.engine_bench import offline as bench


def test_lora_bench_runs_three_consistent_runs(tiny_model_factory):
    folder = tiny_model_factory("llama")
    report = bench.run_offline_bench(
        model=str(folder),
        dtype="float32",
        num_requests=4,
        prompt_len=8,
        output_len=4,
        baseline="hf",
        adapters=2,
        lora_rank=4,
        use_tqdm=False,
    )
    assert report.workload.num_requests == 4
    assert all(len(prompt) == 8 for prompt in report.workload.prompts)
    names = [result.name for result in report.results]
    assert names == [bench.BASE_RUN, bench.LORA_RUN, bench.HF_PEFT_RUN]
    for result in report.results:
        assert result.num_requests == 4
        assert result.output_tokens == 4 * 4
        assert result.elapsed_s > 0
        assert result.tokens_per_s == pytest.approx(16 / result.elapsed_s)
    base, lora, hf_peft = report.results
    ratios = report.ratios()
    assert set(ratios) == {"lora/base", "lora/hf+peft"}
    assert ratios["lora/base"] == pytest.approx(base.elapsed_s / lora.elapsed_s)
    assert ratios["lora/hf+peft"] == pytest.approx(hf_peft.elapsed_s / lora.elapsed_s)
    assert report.lora == bench.LoRABenchSetup(
        num_adapters=2,
        rank=4,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        max_loras=2,
        hf_batch_size=bench.HF_PEFT_BATCH_SIZE,
        warmup_requests=4,
    )
    assert report.load_before and report.load_after

    text = bench.format_report(report)
    for result in report.results:
        assert f"{result.name}: 16 tokens in {result.elapsed_s:.2f}s" in text
        assert f"= {result.tokens_per_s:.1f} generated tokens/s" in text
    assert f"ratio lora/base: {ratios['lora/base']:.2f}x (target >= 0.8x)" in text
    assert f"ratio lora/hf+peft: {ratios['lora/hf+peft']:.2f}x (target >= 4x)" in text
    assert "ratio ours/hf" not in text
    assert "static batches of 8" in text and "2 PEFT LoRA, rank 4" in text
    assert f"loadavg before: {report.load_before}" in text
    assert f"loadavg after: {report.load_after}" in text


def test_bench_adapters_are_real_peft_adapters_that_change_outputs(tiny_model_factory, tmp_path):
    from loraplex.platform.llm import LLM

    folder = tiny_model_factory("llama")
    folders = bench.make_bench_adapters(
        folder, tmp_path, ["a", "b"], rank=4, targets=("q_proj", "down_proj"), seed=0
    )
    config = json.loads((folders["a"] / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    assert (folders["a"] / "adapter_model.safetensors").read_bytes() != (
        folders["b"] / "adapter_model.safetensors"
    ).read_bytes()
    llm = LLM(model=str(folder), max_loras=2, max_lora_rank=4)
    prompts = [[5, 6, 7, 8, 9]] * 3
    outputs = llm.generate(
        prompts, bench.fixed_length_params(6), adapters=[None, str(folders["a"]), folders["b"]]
    )
    tokens = [output.token_ids for output in outputs]
    assert all(len(t) == 6 for t in tokens)
    assert tokens[0] != tokens[1] or tokens[0] != tokens[2]


def test_hf_peft_groups_by_adapter(tiny_model_factory, tmp_path, monkeypatch):
    folder = tiny_model_factory("llama")
    folders = bench.make_bench_adapters(folder, tmp_path, ["a", "b"], 4, ("v_proj",))
    workload = bench.build_workload(range(1, 512), num_requests=5, prompt_len=6, output_len=3)
    calls: list[tuple[str, int]] = []
    real = bench.hf_generate_batch

    def spy(model, prompts, output_len):
        calls.append((model.active_adapter, len(prompts)))
        return real(model, prompts, output_len)

    monkeypatch.setattr(bench, "hf_generate_batch", spy)
    request_adapters = bench.spread_over(["a", "b"], 5)
    assert request_adapters == ["a", "b", "a", "b", "a"]
    result = bench.run_hf_peft(folder, workload, torch.float32, folders, request_adapters, 2, False)
    assert result.name == "hf+peft" and result.output_tokens == 15
    # warm-up on the first adapter, then a's 3 requests in batches of 2, then b's 2
    assert calls == [("a", 2), ("a", 2), ("a", 1), ("b", 2)]


def test_parse_lora_targets_and_defaults():
    assert bench.parse_lora_targets("q,k,v,o,gate,up,down") == bench.SUPPORTED_MODULES
    assert bench.parse_lora_targets("down, q_proj") == ("q_proj", "down_proj")
    with pytest.raises(ValueError, match="unknown LoRA target"):
        bench.parse_lora_targets("q,lm_head")
    assert bench.default_hf_batch_size(0) == 16 and bench.default_hf_batch_size(3) == 8


def test_warmup_fills_one_step_budget():
    assert bench.warmup_request_count(2048, 128, 64) == 16
    assert bench.warmup_request_count(2048, 100, 64) == 21
    assert bench.warmup_request_count(2048, 8, 4) == 4
    assert bench.warmup_request_count(64, 512, 64) == bench.WARMUP_REQUESTS


def test_cli_lora_flags():
    args = cli.build_parser().parse_args(["bench", "offline", "--adapters", "8"])
    assert (args.adapters, args.lora_rank, args.lora_targets) == (8, 8, "q,k,v,o,gate,up,down")
    assert args.max_loras is None and args.hf_batch_size is None
    args = cli.build_parser().parse_args(["bench", "offline", "--max-loras", "4"])
    assert (args.adapters, args.max_loras) == (0, 4)


def test_cli_bench_with_adapters_end_to_end(tiny_model_factory, capsys):
    folder = tiny_model_factory("llama")
    argv = ["bench", "offline", "--model", str(folder), "--num-requests", "3"]
    argv += ["--prompt-len", "5", "--output-len", "2", "--adapters", "2", "--lora-rank", "2"]
    argv += ["--lora-targets", "q,v"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "base: 6 tokens" in out and "lora: 6 tokens" in out and "hf+peft" not in out
    assert "ratio lora/base:" in out and "q_proj,v_proj" in out and "loadavg after:" in out
