"""Decode steps through the graphs' static buffers (platform/decode_graphs.py) equal PEFT
and HF greedy fp32, token for token: base and adapter sequences mixed, batches padded
up to their bucket, sequences finishing mid-batch, block copies and preemption.

On LORAPLEX_TEST_DEVICE=cuda the engine captures the graphs itself and every decode
step replays one; on a CPU the same padded forward over the same buffers runs eagerly
(`DecodeGraphs.run` before capture), attached to the engine by the test, through the
native CPU kernels and through the Triton kernels (under the interpreter). Two adapter
slots: on the Triton kernels, whose projections fold the LoRA shrink into their weights,
every bucket runs SGMV over the segment table (the shrink in the projection's matmul);
without the fold a bucket of up to 2 decodes runs BGMV, a larger one SGMV.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from loraplex.kernels.selection import KERNEL_BACKEND_ENV
from loraplex.platform.decode_graphs import BUCKETS, DecodeGraphs, buckets_up_to
from loraplex.platform.layers.linear import has_folded_projections
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

DEVICE = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu")
MAX_NEW = 12
ADAPTERS = {
    "attn4": dict(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj"), seed=11),
    "mlp8": dict(rank=8, alpha=16.0, target_modules=("gate_proj", "up_proj", "down_proj"), seed=12),
}
MODES = {
    "plain": dict(),
    "preempt": dict(num_blocks_override=17, block_size=8),
}


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("graph-adapters")
    folders = {name: peft_adapter_factory(base, root / name, **o) for name, o in ADAPTERS.items()}
    return base, folders


def requests(vocab: int) -> list[tuple[list[int], str | None, int]]:
    """7 (prompt, adapter, max_tokens): 7 decodes pad to a bucket of 8, and sequences
    ending early leave odd batch sizes (5, 3) behind them."""
    rng = random.Random(3)
    cycle = [None, "attn4", "mlp8"]
    lengths = (1, 5, 16, 17, 30, 9, 40)
    max_tokens = (MAX_NEW, 4, MAX_NEW, 7, MAX_NEW, 2, MAX_NEW)
    return [
        ([rng.randrange(vocab) for _ in range(n)], cycle[i % 3], max_tokens[i])
        for i, n in enumerate(lengths)
    ]


def oracle(base, folders, wanted) -> list[list[int]]:
    """HF transformers (with PEFT's unmerged adapter where one is named), greedy fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    outputs = []
    for prompt, adapter, max_tokens in wanted:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, folders[adapter])
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.eval().generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


class CountingGraphs(DecodeGraphs):
    """DecodeGraphs that count the steps they ran and the batch sizes they padded to."""

    def run(self, step):
        self.sizes = [
            *getattr(self, "sizes", []),
            (step.num_decodes, self.bucket_for(step.num_decodes)),
        ]
        return super().run(step)


def build(base, folders, mode: dict) -> LLM:
    options = dict(
        dtype="float32", max_model_len=128, device=DEVICE, max_lora_rank=8, max_loras=2, **mode
    )
    if DEVICE == "cuda":
        options["kv_cache_memory_bytes"] = 64 << 20
    llm = LLM(str(base), **options)
    for name, folder in folders.items():
        llm.register_adapter(name, str(folder))
    engine = llm.engine
    if DEVICE == "cuda":
        assert engine.runner.graphs is not None, "the engine captured no decode graphs on CUDA"
        engine.runner.graphs.__class__ = CountingGraphs
    else:
        assert engine.runner.graphs is None, "graphs are for CUDA only"
        engine.runner.graphs = CountingGraphs(
            engine.runner.decode_logits,
            engine.device,
            engine.config.cache.block_size,
            engine.max_model_len,
            max_batch=8,
            max_loras=engine.config.lora.max_loras,
            kernels=engine.kernel_backend,
            folded_shrink=has_folded_projections(engine.runner.model),
        )
    return llm


KERNELS = ["triton"] if DEVICE == "cuda" else ["cpu", "triton"]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", list(MODES))
def test_graph_decodes_match_peft(setup, mode, kernels, monkeypatch):
    monkeypatch.setenv(KERNEL_BACKEND_ENV, kernels)
    base, folders = setup
    wanted = requests(512)
    llm = build(base, folders, MODES[mode])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for *_, m in wanted]
    outputs = llm.generate([p for p, *_ in wanted], params, adapters=[a for _, a, _ in wanted])
    got = [o.token_ids for o in outputs]
    want = oracle(base, folders, wanted)
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, f"requests {mismatches} differ from HF/PEFT ({mode})"
    engine = llm.engine
    assert engine.kernel_backend == kernels
    assert engine.runner.graphs.folded_shrink == (kernels == "triton")
    sizes = engine.runner.graphs.sizes
    assert any(count < bucket for count, bucket in sizes), f"no padded batch ran: {sizes}"
    assert any(count >= 5 for count, _ in sizes), f"no wide decode batch ran: {sizes}"
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_lone_adapter_decode_matches_peft(setup, kernels, monkeypatch):
    """One sequence on an adapter: a bucket of 1 (BGMV, or the segment table where the
    shrink is folded)."""
    monkeypatch.setenv(KERNEL_BACKEND_ENV, kernels)
    base, folders = setup
    wanted = [(list(range(5, 14)), "mlp8", MAX_NEW)]
    llm = build(base, folders, MODES["plain"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = llm.generate([wanted[0][0]], params, adapters=["mlp8"])[0].token_ids
    assert got == oracle(base, folders, wanted)[0]
    graphs = llm.engine.runner.graphs
    assert set(graphs.sizes) == {(1, 1)}
    assert graphs._uses_segments(1) == (kernels == "triton")


def test_enforce_eager_captures_nothing(setup):
    base, _ = setup
    options = dict(dtype="float32", max_model_len=64, device=DEVICE, enforce_eager=True)
    if DEVICE == "cuda":
        options["kv_cache_memory_bytes"] = 16 << 20
    llm = LLM(str(base), **options)
    assert llm.engine.runner.graphs is None
    assert llm.engine.graph_pool_bytes == 0


def test_buckets():
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(64)[-3:] == (32, 48, 64)
    assert buckets_up_to(50)[-2:] == (48, 50)
    assert set(buckets_up_to(BUCKETS[-1])) == set(BUCKETS)
