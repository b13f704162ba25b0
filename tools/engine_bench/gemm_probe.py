"""How fast this machine runs a model's projections: a GEMM-time probe per dtype.

The engine's time on a CPU is mostly its projections (q/k/v, o, gate/up, down, LM
head). `probe_gemm_times` times each of them, for one model's shapes, at the row counts
(tokens per step) a workload runs, in one dtype, with the engine's thread count and
the faster of the two matmuls the engine could use (MKL's `F.linear` and oneDNN's
prepacked linear). Decode-sized row counts are timed in the model's order over a
distinct weight per layer (and the LM head), so each call reads its weight from where a
real step finds it: a shape timed alone over its layer copies can stay in a large L3
cache and run faster than inside the model's pass.

With `quantization` (a `QuantizedProduct`) the decoder layers' projections are timed as
the engine runs them: under `quantization: int8` / `int8_weight_only` (mode 'dynamic'
or 'weight_only', kernels/int8_matmul.py) int8 weights per output channel with the
native ops, or, for an int4 checkpoint (mode 'int4', kernels/int4_matmul.py), int4
weights in groups; activations in `dtype`. The LM head stays in `dtype`, as the engine
keeps it by default, or is int8 too where the product says so (`quantize_lm_head`: W8A8
under an int4 checkpoint).

The times feed two things: the ceiling of `loraplex bench offline --ceiling`
(`tools/engine_bench/ceiling.py`) and `dtype: auto`, which picks the dtype whose projections
finish a reference workload first. Probes are cached as JSON under
`$LORAPLEX_CACHE_DIR/gemm_probe/`, keyed by the CPU model and flags, torch's version,
the thread count, the dtype and the shapes, like the native kernels' build: a cache
shared between machines never answers for another CPU.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.kernels.cache_dir import cache_base
from loraplex.kernels.cpu_matmul import PackedWeight, cpu_lacks_half_matmul
from loraplex.kernels.cpu_ops import cpu_identity
from loraplex.kernels.int4_matmul import Int4Weight, quantize_int4
from loraplex.kernels.int8_matmul import Int8Weight
from loraplex.platform.arch import ModelArch
from loraplex.platform.config import dtype_name
from loraplex.platform.models.compressed_tensors import INT4_LM_HEAD_MODE

logger = logging.getLogger(__name__)

CPU_DTYPE_CANDIDATES = (torch.float32, torch.bfloat16, torch.float16)
MAX_CHAIN_BYTES = 2 * 2**30
"""The streamed chain holds at most this many bytes of layer weights (a big model's
layers are not all allocated again; this is far past any CPU's last-level cache)."""
STREAMED_ROWS = 256
"""Up to this many rows a projection's time depends on where its weight is read from
(decode batches), so it is timed in the model's order over every layer's weights;
above it the product is compute-bound (prefill chunks) and timed alone."""
MIN_TIMED_S = 0.05
"""Each (shape, rows) measurement repeats passes over its copies for at least this long
in each of REPEATS windows (a quick probe, as `dtype: auto` runs, uses less)."""
REPEATS = 3
"""Timed windows per measurement; the fastest counts (the others met other load)."""


@dataclass(frozen=True)
class Projection:
    """One projection of the model: y [M, out] = x [M, in] @ W.T, run `count` times a
    forward (once per layer, or once for the LM head on the sampled rows)."""

    name: str
    out_features: int
    in_features: int
    count: int

    @property
    def per_layer(self) -> bool:
        return self.name != "lm_head"


def model_projections(arch: ModelArch) -> tuple[Projection, ...]:
    """The projections one forward runs, fused as the engine fuses them (q/k/v and
    gate/up are one matmul each on a CPU)."""
    qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    layers = arch.num_layers
    return (
        Projection("qkv", qkv_out, arch.hidden_size, layers),
        Projection("o", arch.hidden_size, arch.num_heads * arch.head_dim, layers),
        Projection("gate_up", 2 * arch.intermediate_size, arch.hidden_size, layers),
        Projection("down", arch.hidden_size, arch.intermediate_size, layers),
        Projection("lm_head", arch.vocab_size, arch.hidden_size, 1),
    )


def candidate_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes worth probing on this CPU: fp32, and bf16 / fp16 where the CPU has a
    native matmul for them (an emulated one is ~5x slower than fp32)."""
    if device.type != "cpu":
        raise ValueError("the GEMM probe runs on a CPU")
    return tuple(d for d in CPU_DTYPE_CANDIDATES if not cpu_lacks_half_matmul(d))


@dataclass(frozen=True)
class GemmTimes:
    """Seconds one call of each projection takes at each probed row count, plus which
    matmul was faster there ('mkl' or 'onednn')."""

    dtype: str
    num_threads: int
    seconds: dict[str, dict[int, float]]
    backend: dict[str, dict[int, str]]

    def time(self, projection: str, rows: int) -> float:
        return self.seconds[projection][rows]

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "num_threads": self.num_threads,
            "seconds": {p: {str(m): s for m, s in t.items()} for p, t in self.seconds.items()},
            "backend": {p: {str(m): b for m, b in t.items()} for p, t in self.backend.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> GemmTimes:
        return cls(
            dtype=data["dtype"],
            num_threads=int(data["num_threads"]),
            seconds={
                p: {int(m): float(s) for m, s in t.items()} for p, t in data["seconds"].items()
            },
            backend={p: {int(m): str(b) for m, b in t.items()} for p, t in data["backend"].items()},
        )


def _fastest_window(run_pass, calls_per_pass: int, min_timed_s: float) -> float:
    """Seconds per call: passes repeat for `min_timed_s`, the fastest of REPEATS windows."""
    run_pass()
    best = float("inf")
    for _ in range(REPEATS):
        passes = 0
        started = time.perf_counter()
        while True:
            run_pass()
            passes += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_timed_s and passes >= 2:
                break
        best = min(best, elapsed / (passes * calls_per_pass))
    return best


def _weights(projection: Projection, dtype: torch.dtype, copies: int) -> list[torch.Tensor]:
    """`copies` distinct weights of the projection's shape (one random draw, copied)."""
    generator = torch.Generator().manual_seed(projection.out_features * 7919 + copies)
    shape = (projection.out_features, projection.in_features)
    base = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
    return [base] + [base.clone() for _ in range(copies - 1)]


INT8_BACKEND = "int8"
INT4_BACKEND = "int4"
QUANTIZED_BACKENDS = (INT8_BACKEND, INT4_BACKEND)
INT4 = "int4"
"""`QuantizedProduct.mode` of an int4 checkpoint's engine."""


@dataclass(frozen=True)
class QuantizedProduct:
    """How a quantized engine multiplies: its decoder layers' mode ('dynamic' or
    'weight_only' int8, kernels/int8_matmul.py; INT4, kernels/int4_matmul.py, in groups
    of `group_size` inputs, None: one group per output channel), and whether its LM head
    is int8 too (the engine option `quantize_lm_head`: the layers' int8 mode, or W8A8
    beside int4 layers)."""

    mode: str
    lm_head: bool = False
    group_size: int | None = 128

    @property
    def name(self) -> str:
        groups = f"g{self.group_size}" if self.group_size is not None else "channel"
        layers = f"int4_{groups}" if self.mode == INT4 else f"int8_{self.mode}"
        return layers + ("+lm_head" if self.lm_head else "")


def _backends(
    weights: list[torch.Tensor], mode: str | None = None, group_size: int | None = 128
) -> dict[str, list[Callable[[torch.Tensor], object]]]:
    """The matmuls to compare: MKL's F.linear, and oneDNN's prepacked linear where the
    weights can be packed; with `mode`, the one quantized product of that mode (int4 in
    groups of `group_size`, None: per output channel). Each call maps x -> x @ W.T."""
    if mode == INT4:
        int4 = []
        for w in weights:
            size = group_size or w.shape[1]
            int4.append(Int4Weight(*quantize_int4(w, size, True), size, w.dtype, native=True))
        return {INT4_BACKEND: [functools.partial(_onednn_linear, weight=w) for w in int4]}
    if mode is not None:
        int8 = [Int8Weight.from_float(w, mode, native=True) for w in weights]
        return {INT8_BACKEND: [functools.partial(_onednn_linear, weight=w) for w in int8]}
    found: dict[str, list[Callable[[torch.Tensor], object]]] = {
        "mkl": [functools.partial(_mkl_linear, weight=w) for w in weights]
    }
    packed = [PackedWeight.maybe(weight) for weight in weights]
    if all(p is not None for p in packed):
        found["onednn"] = [functools.partial(_onednn_linear, weight=p) for p in packed]
    return found


def _mkl_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _onednn_linear(x: torch.Tensor, weight: PackedWeight | Int8Weight | Int4Weight) -> torch.Tensor:
    return weight(x, None)


def _quantized(projection: Projection, quantization: QuantizedProduct | None) -> str | None:
    """The mode `projection` runs in: the decoder layers' under `quantization`; the LM
    head stays in the engine's dtype unless the product quantizes it too (int8, W8A8
    beside int4 layers)."""
    if quantization is None or not (projection.per_layer or quantization.lm_head):
        return None
    if not projection.per_layer and quantization.mode == INT4:
        return INT4_LM_HEAD_MODE
    return quantization.mode


def _options(
    projection: Projection,
    weights: list[torch.Tensor],
    quantization: QuantizedProduct | None,
) -> dict[str, list[Callable[[torch.Tensor], object]]]:
    group_size = quantization.group_size if quantization is not None else None
    return _backends(weights, _quantized(projection, quantization), group_size)


def _time_compute_bound(
    projection: Projection,
    rows: int,
    dtype: torch.dtype,
    min_timed_s: float,
    quantization: QuantizedProduct | None = None,
) -> tuple[float, str]:
    """One projection alone over two weight copies (its weights' reads do not matter)."""
    copies = min(2, projection.count)
    weights = _weights(projection, dtype, copies)
    x = torch.randn(rows, projection.in_features).to(dtype)
    results: dict[str, float] = {}
    for name, calls in _options(projection, weights, quantization).items():

        def run_pass(calls=calls) -> None:
            for call in calls:
                call(x)

        results[name] = _fastest_window(run_pass, copies, min_timed_s)
    backend = min(results, key=results.__getitem__)
    return results[backend], backend


def chain_layers(projections: tuple[Projection, ...], dtype: torch.dtype) -> int:
    """Layers the streamed chain holds: the model's, up to MAX_CHAIN_BYTES of weights."""
    per_layer = [p for p in projections if p.per_layer]
    if not per_layer:
        return 0
    layer_bytes = sum(p.out_features * p.in_features for p in per_layer) * dtype.itemsize
    return max(1, min(per_layer[0].count, MAX_CHAIN_BYTES // layer_bytes))


def _quantized_only(found: dict[str, object]) -> bool:
    """Whether a projection's backends are its one quantized product."""
    return set(found) <= set(QUANTIZED_BACKENDS)


def _time_streamed(
    projections: tuple[Projection, ...],
    rows: int,
    dtype: torch.dtype,
    min_timed_s: float,
    quantization: QuantizedProduct | None = None,
) -> dict[str, tuple[float, str]]:
    """Every projection at `rows`, called in the model's order (layer by layer, then the
    LM head) over distinct per-layer weights, so each call reads its weight from where a
    real step finds it. Returns name -> (seconds per call, faster backend), from each
    backend's fastest full pass (an int8 projection has one backend, in every pass)."""
    layers = chain_layers(projections, dtype)
    counts = {p.name: (layers if p.per_layer else 1) for p in projections}
    inputs = {p.name: torch.randn(rows, p.in_features).to(dtype) for p in projections}
    options = {
        p.name: _options(p, _weights(p, dtype, counts[p.name]), quantization) for p in projections
    }
    order = [(p.name, layer) for layer in range(layers) for p in projections if p.per_layer]
    order += [(p.name, 0) for p in projections if not p.per_layer]
    float_backends = [set(found) for found in options.values() if not _quantized_only(found)]
    best: dict[str, tuple[float, str]] = {}
    for backend in set.intersection(*float_backends) if float_backends else {INT8_BACKEND}:

        def pick(name: str, backend: str = backend) -> str:
            found = options[name]
            return next(iter(found)) if _quantized_only(found) else backend

        calls = [(name, options[name][pick(name)][index], inputs[name]) for name, index in order]

        def run_pass(calls=calls) -> dict[str, float]:
            spent = dict.fromkeys(counts, 0.0)
            for name, call, x in calls:
                started = time.perf_counter()
                call(x)
                spent[name] += time.perf_counter() - started
            return spent

        run_pass()
        fastest = run_pass()
        passes, deadline = 1, time.perf_counter() + min_timed_s * REPEATS
        while passes < REPEATS or time.perf_counter() < deadline:
            spent = run_pass()
            passes += 1
            if sum(spent.values()) < sum(fastest.values()):
                fastest = spent
        for name, total in fastest.items():
            per_call = total / counts[name]
            if name not in best or per_call < best[name][0]:
                best[name] = (per_call, pick(name))
    return best


def cache_key(
    projections: Iterable[Projection],
    rows: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    min_timed_s: float,
    quantization: QuantizedProduct | None = None,
) -> str:
    digest = hashlib.sha256()
    parts = [
        cpu_identity(),
        torch.__version__,
        str(torch.get_num_threads()),
        product_name(dtype, quantization),
        repr(sorted((p.name, p.out_features, p.in_features, p.count) for p in projections)),
        repr(sorted(rows.items())),
        repr(min_timed_s),
    ]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def product_name(dtype: torch.dtype, quantization: QuantizedProduct | None) -> str:
    """How a probe's projections multiply: the dtype, or e.g. 'int8_dynamic/bfloat16'
    (int8 decoder layers, activations and LM head in bf16), 'int8_dynamic+lm_head/bfloat16'
    (the LM head in int8 too)."""
    if quantization is None:
        return dtype_name(dtype)
    return f"{quantization.name}/{dtype_name(dtype)}"


def probe_cache_dir() -> Path:
    return cache_base() / "gemm_probe"


def probe_gemm_times(
    projections: tuple[Projection, ...],
    rows: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    *,
    min_timed_s: float | None = None,
    use_cache: bool = True,
    quantization: QuantizedProduct | None = None,
) -> GemmTimes:
    """Times every projection at its row counts (`rows[name]`) in `dtype` with torch's
    current thread count, on the calling thread (the engine's compute thread: a probe
    on another thread would open a second OpenMP pool, see compute_threads.py).

    Semantics: result.time(name, m) = seconds for one y = x @ W.T with x [m, in] and W
    [out, in] in `dtype`; for m <= STREAMED_ROWS measured among every layer's weights in
    the model's order (W is in cache only where the whole model's weights fit); with
    `quantization`, the decoder layers' products are int8 in that mode (see the module
    docstring). `min_timed_s` None means MIN_TIMED_S. Reads and writes the cache unless
    `use_cache` is False."""
    min_timed_s = MIN_TIMED_S if min_timed_s is None else min_timed_s
    key = cache_key(projections, rows, dtype, min_timed_s, quantization)
    path = probe_cache_dir() / f"{key}.json"
    if use_cache and path.is_file():
        try:
            return GemmTimes.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring unreadable GEMM probe cache %s", path)
    started = time.monotonic()
    seconds: dict[str, dict[int, float]] = {}
    backend: dict[str, dict[int, str]] = {}
    for m in sorted({m for counts in rows.values() for m in counts if m <= STREAMED_ROWS}):
        streamed = _time_streamed(projections, m, dtype, min_timed_s, quantization)
        for name, (t, which) in streamed.items():
            if m in rows[name]:
                seconds.setdefault(name, {})[m] = t
                backend.setdefault(name, {})[m] = which
    for projection in projections:
        for m in rows[projection.name]:
            if m > STREAMED_ROWS:
                t, which = _time_compute_bound(projection, m, dtype, min_timed_s, quantization)
                seconds.setdefault(projection.name, {})[m] = t
                backend.setdefault(projection.name, {})[m] = which
    times = GemmTimes(product_name(dtype, quantization), torch.get_num_threads(), seconds, backend)
    logger.info(
        "GEMM probe %s on %d threads: %d shapes in %.1fs",
        times.dtype,
        times.num_threads,
        sum(len(r) for r in rows.values()),
        time.monotonic() - started,
    )
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(times.to_json(), indent=1))
        tmp.replace(path)
    return times
