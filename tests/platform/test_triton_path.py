"""The engine's Triton path (fused RMSNorm, fused rotary + cache write, paged attention,
LoRA kernels; run by the interpreter off CUDA) and its native CPU path (kernels/cpu_ops)
each give the same greedy fp32 outputs as its plain torch path, token for token, with
prefix hits, chunked prefill mixed with decodes, and preemption. Tiny models keep the
interpreter's cost down. The Triton path and its torch reference run on
LORAPLEX_TEST_DEVICE (tests/conftest.py: 'cuda' on a GPU, else 'cpu' under the
interpreter); the native CPU path always runs on the CPU."""

from __future__ import annotations

import os
import random

import pytest

from loraplex.kernels.backends import CpuBackend, TritonBackend
from loraplex.kernels.selection import KERNEL_BACKEND_ENV, kernel_backend
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

MODES = {
    "prefix_hits": dict(),
    "chunked": dict(max_num_batched_tokens=20, enable_chunked_prefill=True),
    "preempt": dict(num_blocks_override=10, block_size=8, max_model_len=64),
}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8 prompts of 1..40 tokens; three share a 17-token prefix (a hit past one block)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(17)]
    out = []
    for i, length in enumerate((1, 3, 8, 15, 16, 17, 23, 40)):
        tail = [rng.randrange(vocab) for _ in range(length)]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


def generate(folder, backend: str, mode: dict, monkeypatch, device: str) -> list[list[int]]:
    monkeypatch.setenv(KERNEL_BACKEND_ENV, backend)
    options = {"dtype": "float32", "max_model_len": 128, "device": device, **mode}
    if device == "cuda":
        options.setdefault("kv_cache_memory_bytes", 256 << 20)  # not 10% of the GPU per engine
    llm = LLM(str(folder), **options)
    assert llm.engine.kernel_backend == backend
    uses_triton = isinstance(llm.engine.runner.model.norm.kernels, TritonBackend)
    assert uses_triton == (backend == "triton")
    uses_native = isinstance(llm.engine.runner.model.norm.kernels, CpuBackend)
    assert uses_native == (backend == "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts(512), params)
    llm.engine.kv_cache.check_invariants()
    if "num_blocks_override" in mode:
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kernel_path_equals_torch_path(tiny_model_factory, kind, mode, backend, monkeypatch):
    """Triton kernels (compiled on a GPU, else interpreted) and the native CPU kernels each
    against torch on the same device."""
    folder = tiny_model_factory(kind)
    device = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu") if backend == "triton" else "cpu"
    expected = generate(folder, "torch", MODES[mode], monkeypatch, device)
    assert generate(folder, backend, MODES[mode], monkeypatch, device) == expected


def test_backend_selection(monkeypatch):
    import torch

    monkeypatch.delenv(KERNEL_BACKEND_ENV, raising=False)
    assert kernel_backend(torch.device("cpu")) == "cpu"
    assert kernel_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv(KERNEL_BACKEND_ENV, "triton")
    assert kernel_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv(KERNEL_BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="torch"):
        kernel_backend(torch.device("cpu"))
