"""The engine on one GPU at real model shapes: tokens/s against the HBM-bandwidth limit,
with and without adapters, optionally against HF transformers `generate`.

For a lent GPU machine, which has no model hub: each model is a seeded random-weight
checkpoint with a production model's config (SmolLM2-135M, Llama-3.2-1B shapes), saved
once into `--model-dir` with a word-level tokenizer. Random weights change no timing:
every workload generates exactly its output length (greedy, EOS ignored).

Per model, each timing the median of `--repeats` warm runs:
- bandwidth limit: the bytes a single-stream decode step must read (every weight once,
  the tied embedding once as the LM head) over the device-to-device copy bandwidth
  measured here (bytes read plus written);
- batch: N prompts at once (the engine schedules them);
- single: one request at a time (the host cost per step shows here);
- adapters: the batch again with 8 PEFT LoRA adapters (rank 16, every projection), the
  prompts spread over them round-robin, against the same engine's base batch;
- fp32 greedy tokens of the engine against HF on 4 prompts (a mismatch is printed).

It uses only the `LLM` API, so the same script times an older checkout imported through
a shim (scripts/gpu_session.sh does: the code before a change, then after it). `--output
FILE` writes every figure as JSON; `--compare BEFORE AFTER` prints the ratios of two.

    python scripts/bench_gpu_engine.py [--models llama-1b] [--hf] [--output FILE]
    python scripts/bench_gpu_engine.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraplex.platform.llm import LLM
from loraplex.tools.engine_bench.offline import fixed_length_params, hf_generate_batch, read_loadavg

logger = logging.getLogger("bench_gpu_engine")

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
}
"""Configs of the real models (their published config.json values that set the cost)."""

NUM_ADAPTERS = 8
ADAPTER_RANK = 16
ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_model(folder: Path, shape: dict, seed: int) -> Path:
    """A seeded random LlamaForCausalLM with `shape`, in bf16 safetensors, and a
    word-level tokenizer whose every id decodes (kept if `folder` already has one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(folder)
    return folder


def save_random_adapters(base: Path, root: Path, device: str) -> list[Path]:
    """NUM_ADAPTERS seeded random PEFT adapters of `base` (rank 16 on every projection;
    PEFT starts B at zero, which would make them no-ops), kept if already saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = [root / f"adapter-{i}" for i in range(NUM_ADAPTERS)]
    if all((f / "adapter_config.json").exists() for f in folders):
        return folders
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(device)
    config = LoraConfig(
        r=ADAPTER_RANK,
        lora_alpha=2 * ADAPTER_RANK,
        target_modules=list(ADAPTER_MODULES),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    for index, folder in enumerate(folders):
        generator = torch.Generator(device="cpu").manual_seed(100 + index)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    values = torch.randn(param.shape, generator=generator) * 0.01
                    param.copy_(values.to(param.device, param.dtype))
        peft_model.save_pretrained(folder)
    del peft_model, model
    return folders


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read plus written), median of 10."""
    if device != "cuda":
        return float("nan")
    source = torch.randn(256 << 20, device=device)  # 1 GiB of float32
    target = torch.empty_like(source)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del source, target
    return 2 * (1 << 30) / statistics.median(times[2:])


def step_weight_bytes(shape: dict, dtype_bytes: int = 2) -> int:
    """Bytes one single-stream decode step must read: every layer's projections, the
    norms, and the LM head (the tied embedding read once as the head)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    per_layer = (
        hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * inter  # gate, up, down
        + 2 * hidden  # norms
    )
    lm_head = shape["vocab_size"] * hidden
    return dtype_bytes * (shape["num_hidden_layers"] * per_layer + lm_head + hidden)


def median_rate(run: Callable[[], int], repeats: int) -> float:
    """Median tokens/s of `repeats` timed calls of `run` (each returns its token count)."""
    rates = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        tokens = run()
        synchronize()
        rates.append(tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def engine_run(
    llm: LLM, batch: list[list[int]], output_len: int, adapters: list[str | None] | None
) -> Callable[[], int]:
    def run() -> int:
        outputs = llm.generate(batch, fixed_length_params(output_len), adapters=adapters)
        tokens = sum(len(o.token_ids) for o in outputs)
        assert tokens == len(batch) * output_len, tokens
        return tokens

    return run


def greedy_agreement(folder: Path, device: str, vocab: int) -> tuple[int, int]:
    """fp32 greedy tokens of the engine and HF on 4 prompts: (equal prompts, prompts)."""
    from transformers import AutoModelForCausalLM

    checks = prompts(4, 32, vocab, seed=7)
    llm = LLM(str(folder), dtype="float32", device=device, kv_cache_memory_bytes=1 << 28)
    ours = [o.token_ids for o in llm.generate(checks, fixed_length_params(16))]
    llm.engine.shutdown()
    del llm
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    equal = 0
    for prompt, tokens in zip(checks, ours, strict=True):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        equal += out[0, len(prompt) :].tolist() == list(tokens)
    del hf
    return equal, len(checks)


def bench_model(
    name: str, folder: Path, adapters: list[Path], device: str, args: argparse.Namespace
) -> dict[str, float]:
    vocab = SHAPES[name]["vocab_size"]
    batch = prompts(args.num_prompts, args.prompt_len, vocab, seed=1)
    single = prompts(1, args.prompt_len, vocab, seed=2)
    started = time.perf_counter()
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        device=device,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=ADAPTER_RANK,
    )
    ready_s = time.perf_counter() - started
    names = []
    for index, adapter in enumerate(adapters):
        names.append(f"a{index}")
        llm.register_adapter(names[-1], str(adapter))
    spread = [names[i % len(names)] for i in range(len(batch))]
    llm.generate(batch[:4], fixed_length_params(4))  # warm-up, base and adapters
    llm.generate(batch[:8], fixed_length_params(4), adapters=spread[:8])
    figures: dict = {"engine_ready_s": ready_s, "adapter_ratio_rounds": []}
    for _ in range(args.rounds):  # alternating: base batch, adapter batch
        rates = {}
        for key, chosen in (("batch", None), ("batch_8_adapters", spread)):
            rates[key] = median_rate(engine_run(llm, batch, args.output_len, chosen), args.repeats)
            figures[key] = max(figures.get(key, 0.0), rates[key])
        figures["adapter_ratio_rounds"].append(rates["batch_8_adapters"] / rates["batch"])
    for key, chosen in (("prefill", None), ("prefill_8_adapters", spread)):
        figures[key] = median_rate(engine_run(llm, batch, 1, chosen), args.repeats)
    figures["single"] = median_rate(engine_run(llm, single, args.output_len, None), args.repeats)
    figures["single_adapter"] = median_rate(
        engine_run(llm, single, args.output_len, names[:1]), args.repeats
    )
    if args.profile is not None:
        profile(llm, batch, single, spread, args)
    if args.kernel_profile is not None:
        kernel_profile(llm, batch, spread, args)
    llm.engine.shutdown()
    del llm
    if args.hf:
        figures.update(hf_figures(folder, batch, single, device, args))
    return figures


def profile(
    llm: LLM,
    batch: list[list[int]],
    single: list[list[int]],
    spread: list[str],
    args: argparse.Namespace,
) -> None:
    """cProfile of one base batch, one adapter batch and one single stream, the top
    functions by own time and by cumulative time, written to `args.profile`."""
    import cProfile
    import io
    import pstats

    report = io.StringIO()
    for label, prompts_, chosen in (
        ("batch", batch, None),
        ("batch with adapters", batch, spread),
        ("single", single, None),
    ):
        profiler = cProfile.Profile()
        profiler.enable()
        engine_run(llm, prompts_, args.output_len, chosen)()
        synchronize()
        profiler.disable()
        for order in ("tottime", "cumulative"):
            report.write(f"===== {label}, by {order}\n")
            pstats.Stats(profiler, stream=report).sort_stats(order).print_stats(30)
    args.profile.write_text(report.getvalue())


def kernel_profile(
    llm: LLM, batch: list[list[int]], spread: list[str], args: argparse.Namespace
) -> None:
    """torch.profiler (CUPTI) over a prefill and a whole batch, each without and with the
    8 adapters: per workload its wall time, the summed device time of its kernels, and the
    kernels with the most device time, written to `args.kernel_profile`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    report = []
    for label, output_len, chosen in (
        ("prefill", 1, None),
        ("prefill, 8 adapters", 1, spread),
        ("batch", args.output_len, None),
        ("batch, 8 adapters", args.output_len, spread),
    ):
        run = engine_run(llm, batch, output_len, chosen)
        run()
        synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            run()
            synchronize()
            wall = time.perf_counter() - started
        averages = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in averages)
        report.append(
            f"===== {label}: wall {wall * 1e3:.1f} ms (profiled), kernels {device_us / 1e3:.1f} ms"
        )
        report.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    args.kernel_profile.write_text("\n".join(report))


def hf_figures(
    folder: Path,
    batch: list[list[int]],
    single: list[list[int]],
    device: str,
    args: argparse.Namespace,
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    hf_generate_batch(hf, batch[:2], 4)
    figures = {
        "hf_batch": median_rate(lambda: hf_generate_batch(hf, batch, args.output_len), 1),
        "hf_single": median_rate(lambda: hf_generate_batch(hf, single, args.output_len), 1),
    }
    return figures


def compare(before_path: Path, after_path: Path) -> None:
    before = json.loads(before_path.read_text())
    after = json.loads(after_path.read_text())
    lines = [f"device: {after['device']}; before {before_path.name}, after {after_path.name}"]
    lines.append(f"{'model':14} {'figure':18} {'before':>10} {'after':>10} {'after/before':>13}")
    for model, figures in after["models"].items():
        old = before["models"].get(model, {})
        for key, value in figures.items():
            if not isinstance(value, float):
                continue
            was = old.get(key)
            ratio = f"{value / was:13.2f}" if was else f"{'':>13}"
            was_text = f"{was:10.1f}" if was else f"{'-':>10}"
            lines.append(f"{model:14} {key:18} {was_text} {value:10.1f} {ratio}")
    logger.info("\n%s", "\n".join(lines))


def summary(result: dict) -> str:
    lines = [f"device: {result['device']}; torch {result['torch']}; loadavg {result['loadavg']}"]
    lines.append(f"copy bandwidth (read + write): {result['copy_bandwidth_gb_s']:.0f} GB/s")
    for model, f in result["models"].items():
        limit = f["bandwidth_limit_tok_s"]
        rounds = f.get("adapter_ratio_rounds", [])
        median = f"{statistics.median(rounds):.2f}" if rounds else "-"
        lines.append(
            f"{model}: single {f['single']:.1f} tok/s = {f['single'] / limit:.0%} of the "
            f"{limit:.0f} tok/s bandwidth limit; single with an adapter "
            f"{f['single_adapter']:.1f}; batch {f['batch']:.1f}; batch with "
            f"{NUM_ADAPTERS} adapters {f['batch_8_adapters']:.1f} "
            f"(best runs {f['batch_8_adapters'] / f['batch']:.2f}x base; alternating rounds "
            f"{', '.join(f'{r:.2f}' for r in rounds)}, median {median}); "
            f"fp32 greedy equal to HF on "
            f"{f['greedy_equal']} of {f['greedy_prompts']}; engine ready in "
            f"{f['engine_ready_s']:.1f}s"
        )
        if "hf_batch" in f:
            lines.append(
                f"{model}: HF batch {f['hf_batch']:.1f} tok/s, single {f['hf_single']:.1f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-1b", help="comma list of SHAPES keys")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/loraplex-gpu-models"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating base / 8-adapter batch rounds"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=int, default=8)
    parser.add_argument("--hf", action="store_true", help="also time HF generate")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="cProfile report file")
    parser.add_argument(
        "--kernel-profile", type=Path, default=None, help="torch.profiler kernel tables file"
    )
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.compare:
        compare(*args.compare)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    logger.info("device %s, torch %s, loadavg %s", machine, torch.__version__, read_loadavg())
    bandwidth = copy_bandwidth(device)
    result = {
        "device": machine,
        "torch": torch.__version__,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "models": {},
    }
    for name in args.models.split(","):
        shape = SHAPES[name]
        folder = save_random_model(args.model_dir / name, shape, seed=0)
        adapters = save_random_adapters(folder, args.model_dir / f"{name}-adapters", device)
        equal, total = greedy_agreement(folder, device, shape["vocab_size"])
        logger.info("%s: fp32 greedy equal to HF on %d of %d prompts", name, equal, total)
        figures = bench_model(name, folder, adapters, device, args)
        figures["bandwidth_limit_tok_s"] = bandwidth / step_weight_bytes(shape)
        figures["greedy_equal"], figures["greedy_prompts"] = equal, total
        result["models"][name] = figures
        logger.info("%s: %s", name, json.dumps(figures))
    result["loadavg"] = read_loadavg()
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1))
    logger.info("\n%s", summary(result))


if __name__ == "__main__":
    main()
