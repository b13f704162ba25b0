"""The engine against HF transformers `generate` on one GPU, at real model shapes.

For a lent GPU machine, which has no model hub: each model is a seeded random-weight
checkpoint with a production model's config (SmolLM2-135M, Llama-3.2-1B shapes), saved
once into a temporary folder with a word-level tokenizer. Random weights change no
timing: every workload generates exactly its output length (greedy, EOS ignored).

Per model it runs, engine then HF, each warmed up first:
- batch: N prompts at once (the engine schedules them; HF in static batches of N);
- single: one request at a time, the host cost per step shows here.
It also checks that the engine's greedy tokens equal HF's for a few prompts in fp32 (on
random weights greedy near-ties are rare at these widths; a mismatch is printed, not
hidden). One table is printed last; `--output FILE` writes every figure as JSON.

    python scripts/bench_gpu_engine.py [--models smollm2-135m,llama-1b] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraplex.platform.bench import fixed_length_params, hf_generate_batch, read_loadavg
from loraplex.platform.llm import LLM

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


@dataclass(frozen=True)
class Timing:
    model: str
    workload: str
    engine_tok_s: float
    hf_tok_s: float

    @property
    def ratio(self) -> float:
        return self.engine_tok_s / self.hf_tok_s


def save_random_model(folder: Path, shape: dict, seed: int) -> Path:
    """A seeded random LlamaForCausalLM with `shape`, in bf16 safetensors, and a
    word-level tokenizer whose every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

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


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_engine(llm: LLM, batch: list[list[int]], output_len: int) -> float:
    llm.generate(batch[:2], fixed_length_params(4))
    synchronize()
    started = time.perf_counter()
    outputs = llm.generate(batch, fixed_length_params(output_len))
    synchronize()
    elapsed = time.perf_counter() - started
    assert sum(len(o.token_ids) for o in outputs) == len(batch) * output_len
    return len(batch) * output_len / elapsed


def time_hf(model, batch: list[list[int]], output_len: int, batch_size: int) -> float:
    hf_generate_batch(model, batch[:2], 4)
    synchronize()
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(batch), batch_size):
        tokens += hf_generate_batch(model, batch[start : start + batch_size], output_len)
    synchronize()
    elapsed = time.perf_counter() - started
    assert tokens == len(batch) * output_len
    return tokens / elapsed


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


def bench_model(name: str, folder: Path, device: str, args: argparse.Namespace) -> list[Timing]:
    from transformers import AutoModelForCausalLM

    vocab = SHAPES[name]["vocab_size"]
    batch = prompts(args.num_prompts, args.prompt_len, vocab, seed=1)
    single = prompts(args.single_prompts, args.prompt_len, vocab, seed=2)
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        device=device,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
    )
    engine_batch = time_engine(llm, batch, args.output_len)
    engine_single = (
        len(single)
        * args.output_len
        / sum(args.output_len / time_engine(llm, [p], args.output_len) for p in single)
    )
    llm.engine.shutdown()
    del llm
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    hf_batch = time_hf(hf, batch, args.output_len, args.num_prompts)
    hf_single = (
        len(single)
        * args.output_len
        / sum(args.output_len / time_hf(hf, [p], args.output_len, 1) for p in single)
    )
    del hf
    label = f"{args.num_prompts} x {args.prompt_len} -> {args.output_len}"
    return [
        Timing(name, label, engine_batch, hf_batch),
        Timing(name, f"1 x {args.prompt_len} -> {args.output_len}", engine_single, hf_single),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help="comma list of SHAPES keys")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--single-prompts", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=int, default=8)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    logger.info("device %s, torch %s, loadavg %s", machine, torch.__version__, read_loadavg())
    results: list[Timing] = []
    agreement: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = save_random_model(Path(tmp) / name, SHAPES[name], seed=0)
            agreement[name] = greedy_agreement(folder, device, SHAPES[name]["vocab_size"])
            logger.info("%s: fp32 greedy equal to HF on %d of %d prompts", name, *agreement[name])
            results.extend(bench_model(name, folder, device, args))
    if args.output is not None:
        rows = [{**asdict(t), "ratio": t.ratio} for t in results]
        args.output.write_text(json.dumps({"device": machine, "rows": rows, "greedy": agreement}))
    lines = [f"device: {machine}; loadavg after: {read_loadavg()}"]
    lines.append(f"{'model':14} {'workload':20} {'engine tok/s':>13} {'HF tok/s':>10} {'ratio':>6}")
    for t in results:
        lines.append(
            f"{t.model:14} {t.workload:20} {t.engine_tok_s:13.1f} {t.hf_tok_s:10.1f} {t.ratio:6.2f}"
        )
    lines.extend(f"{name}: fp32 greedy equal on {a} of {n}" for name, (a, n) in agreement.items())
    logger.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
