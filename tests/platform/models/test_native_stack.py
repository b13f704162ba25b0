"""The CPU engine's native decoder stack (platform/models/native_stack.py) against the
Python layer loop it replaces: the same requests through one engine with the stack and
one with `enforce_eager` (the loop) give the same tokens and bit-identical logprobs.

The steps mix decodes with prefill chunks (a 24-token budget splits the long prompts),
base-model rows with two PEFT adapters of different ranks and targets, and a model with
q/k/v biases (Qwen2); fp32 always, bf16 where this CPU multiplies it natively, and the
int8 projections (W8A8 on the prefill steps' rows, weight-only on the small decode
batches).
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels.cpu_matmul import cpu_lacks_half_matmul
from loraplex.kernels.int4_matmul import INT4_GEMV_ROWS, Int4Weight
from loraplex.kernels.int8_matmul import DYNAMIC_MIN_ROWS, VNNI_WIDE_ROWS
from loraplex.kernels.selection import KERNEL_BACKEND_ENV
from loraplex.platform.llm import LLM
from loraplex.platform.models.native_stack import NativeDecoderStack, unsupported_reason
from loraplex.platform.request import SamplingParams
from loraplex.tools.quantize import quantize_folder

ADAPTERS = {
    "attn4": dict(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "o_proj"), seed=21),
    "mlp8": dict(rank=8, alpha=16.0, target_modules=("gate_proj", "up_proj", "down_proj"), seed=22),
}


@pytest.fixture(scope="module")
def adapters_for(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            base = tiny_model_factory(kind)
            root = tmp_path_factory.mktemp(f"stack-{kind}")
            cache[kind] = (
                base,
                {
                    name: peft_adapter_factory(base, root / name, **o)
                    for name, o in ADAPTERS.items()
                },
            )
        return cache[kind]

    return get


def build(base, folders, dtype: str, enforce_eager: bool, quantization: str | None = None) -> LLM:
    llm = LLM(
        str(base),
        dtype=dtype,
        quantization=quantization,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_lora_rank=8,
        max_loras=2,
        enforce_eager=enforce_eager,
    )
    for name, folder in folders.items():
        llm.register_adapter(name, str(folder))
    return llm


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    rng = random.Random(5)
    lengths = (3, 30, 11, 45, 1, 19)
    cycle = [None, "attn4", "mlp8"]
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outputs = llm.generate(
        prompts, [params] * len(prompts), adapters=[cycle[i % 3] for i in range(len(prompts))]
    )
    return [
        (list(o.token_ids), [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outputs
    ]


DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stack_equals_the_python_loop(adapters_for, kind, dtype):
    base, folders = adapters_for(kind)
    native = build(base, folders, dtype, enforce_eager=False)
    model = native.engine.runner.model
    if dtype == "bfloat16" and cpu_lacks_half_matmul(torch.bfloat16):
        assert model.native_stack is None
        assert "widened" in unsupported_reason(model)
        return
    assert isinstance(model.native_stack, NativeDecoderStack)
    calls = []
    stack = model.native_stack
    model.native_stack = lambda *args: calls.append(args[4].num_prefills) or stack(*args)
    got = generate(native)
    eager = build(base, folders, dtype, enforce_eager=True)
    assert eager.engine.runner.model.native_stack is None
    want = generate(eager)
    assert got == want
    assert any(calls) and not all(calls), "steps with and without prefill chunks ran"
    assert all(len(tokens) == 10 for tokens, _ in got)


@pytest.mark.parametrize("quantization", ["int8", "int8_weight_only"])
def test_int8_stack_equals_the_python_loop(adapters_for, quantization):
    base, folders = adapters_for("llama")
    native = build(base, folders, "float32", enforce_eager=False, quantization=quantization)
    model = native.engine.runner.model
    assert model.native_stack is not None
    rows = []
    stack = model.native_stack
    model.native_stack = lambda *args: rows.append(args[0].shape[0]) or stack(*args)
    got = generate(native)
    want = generate(build(base, folders, "float32", True, quantization))
    assert got == want
    assert max(rows) > DYNAMIC_MIN_ROWS and min(rows) < VNNI_WIDE_ROWS, (
        "both int8 products (torch's, padded and not; the VNNI kernel's two tile shapes) ran"
    )


@pytest.mark.parametrize(
    ("group_size", "symmetric"), [(32, False), (48, True)], ids=["torch-kernel", "dequantize-only"]
)
def test_int4_stack_equals_the_python_loop(adapters_for, tmp_path, group_size, symmetric):
    """An int4 checkpoint (kernels/int4_matmul.py) runs in the stack, bit for bit the
    Python loop's answers with adapters: torch's int4 kernel for steps up to
    INT4_GEMV_ROWS rows and dequantize + matmul past them (groups of 32, with zero
    points), or dequantize + matmul only (groups of 48, which torch's kernel cannot
    take)."""
    base, folders = adapters_for("llama")
    folder = quantize_folder(base, tmp_path / "w4", "W4A16", group_size, symmetric)
    native = build(folder, folders, "bfloat16", enforce_eager=False)
    model = native.engine.runner.model
    assert model.native_stack is not None
    projection = model.layers[0].mlp.down_proj.packed
    assert isinstance(projection, Int4Weight)
    assert (projection.gemv is not None) == (group_size == 32)
    rows = []
    stack = model.native_stack
    model.native_stack = lambda *args: rows.append(args[0].shape[0]) or stack(*args)
    got = generate(native)
    want = generate(build(folder, folders, "bfloat16", True))
    assert got == want
    assert max(rows) > INT4_GEMV_ROWS >= min(rows), "both int4 products ran"


def test_where_the_python_loop_stays(tiny_model_factory, monkeypatch):
    base = tiny_model_factory("llama")
    eager = LLM(str(base), dtype="float32", max_model_len=64, enforce_eager=True)
    assert eager.engine.runner.model.native_stack is None
    assert unsupported_reason(eager.engine.runner.model) is None
    monkeypatch.setenv(KERNEL_BACKEND_ENV, "torch")
    plain = LLM(str(base), dtype="float32", max_model_len=64)
    assert plain.engine.runner.model.native_stack is None
    assert "'torch' kernel backend" in unsupported_reason(plain.engine.runner.model)
