"""Compiles Triton kernels for an NVIDIA GPU on a machine without one, and reports each
one's registers and spills (ptxas -v).

The CPU tests run the Triton kernels under the interpreter, which executes their Python:
what only the compiler rejects (a construct Triton's code generator lacks, a tile too
large for the registers) first shows on a GPU, which most sessions and CI lack. This
compiles each case below for the target architecture (default sm_90: H100, H200) with
Triton's own ptxas, from its wheel, and fails on a compile error or a spill.

    python -m loraplex.tools.kernel_compile [--arch 90] [--only NAME]

Run it without TRITON_INTERPRET (under the interpreter `triton.jit` builds no
compilable kernels).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelCase:
    """One kernel at one configuration, as a launcher would start it."""

    name: str
    kernel: str
    """'module:attribute' of the @triton.jit function."""
    constexprs: dict[str, object]
    num_warps: int
    types: dict[str, str] = field(default_factory=dict)
    """Argument types other than the defaults (`_default_type`)."""


CASES = (
    KernelCase(
        "rms_norm",
        "loraplex.kernels.rms_norm:_rms_norm_kernel",
        {"HAS_RESIDUAL": True, "BLOCK": 2048},
        4,
    ),
    KernelCase(
        "rms_norm with expand, one pass (hidden 2048, rank columns 16)",
        "loraplex.kernels.rms_norm:_rms_norm_expand_kernel",
        {"HAS_RESIDUAL": True, "CHUNK": 2048, "BLOCK_R": 16, "ONE_PASS": True},
        16,
        {"slots_ptr": "*i64"},
    ),
    KernelCase(
        "rms_norm with expand, two passes",
        "loraplex.kernels.rms_norm:_rms_norm_expand_kernel",
        {"HAS_RESIDUAL": True, "CHUNK": 256, "BLOCK_R": 16, "ONE_PASS": False},
        4,
        {"slots_ptr": "*i64"},
    ),
    KernelCase(
        "silu_and_mul",
        "loraplex.kernels.silu_and_mul:_silu_and_mul_kernel",
        {"HAS_LORA": False, "CHUNK": 1024, "BLOCK_R": 16},
        4,
        {"slots_ptr": "*i64"},
    ),
    KernelCase(
        "silu_and_mul with expand (rank columns 32)",
        "loraplex.kernels.silu_and_mul:_silu_and_mul_kernel",
        {"HAS_LORA": True, "CHUNK": 128, "BLOCK_R": 32},
        4,
        {"slots_ptr": "*i64"},
    ),
    KernelCase(
        "sgmv_expand of per-slot shrinks (a folded projection's q/k/v)",
        "loraplex.kernels.triton_lora:_sgmv_expand_kernel",
        {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_R": 64, "PRECISION": "tf32"},
        4,
        {"seg_starts_ptr": "*i32", "seg_lens_ptr": "*i32", "seg_slots_ptr": "*i32"},
    ),
)


@dataclass(frozen=True)
class CompileReport:
    name: str
    registers: int
    spilled_bytes: int
    shared_bytes: int


def _default_type(arg: str) -> str:
    """bf16 for pointers, fp32 for `eps`, int32 for sizes and strides."""
    if arg.endswith("_ptr"):
        return "*bf16"
    return "fp32" if arg == "eps" else "i32"


def _load(path: str):
    module, attribute = path.split(":")
    return getattr(importlib.import_module(module), attribute)


def compile_case(case: KernelCase, arch: int) -> CompileReport:
    """Compiles `case` for sm_`arch` and reads ptxas's resource report of it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _load(case.kernel)
    if not hasattr(kernel, "arg_names"):
        raise RuntimeError(
            "the kernels are interpreted (TRITON_INTERPRET is set): nothing to compile"
        )
    signature = {
        arg: "constexpr" if arg in case.constexprs else case.types.get(arg, _default_type(arg))
        for arg in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=case.constexprs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": case.num_warps}
    )
    registers, spilled = _ptxas_usage(compiled.asm["ptx"])
    return CompileReport(case.name, registers, spilled, compiled.metadata.shared)


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) from `ptxas -v` on `ptx`, for the
    architecture its `.target` line names."""
    import triton

    target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
    if target is None:
        raise RuntimeError("the PTX names no .target")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [str(ptxas), "-v", "--gpu-name", target.group(1), str(source)]
        result = subprocess.run(
            [*command, "-o", str(Path(folder) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed: {result.stderr.strip()}")
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"no resource report from ptxas: {result.stderr.strip()}")
    return int(registers.group(1)), int(spills.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--only", default=None, help="cases whose name contains this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        logger.error("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
        return 2
    failed = 0
    for case in CASES:
        if args.only is not None and args.only not in case.name:
            continue
        try:
            report = compile_case(case, args.arch)
        except Exception as error:  # a compile error of one case; the others still run
            failed += 1
            logger.error("FAIL %s: %s", case.name, error)
            continue
        spilled = report.spilled_bytes > 0
        failed += spilled
        logger.info(
            "%s %s: %d registers, %d bytes spilled, %d bytes shared (sm_%d, %d warps)",
            "FAIL" if spilled else "ok  ",
            report.name,
            report.registers,
            report.spilled_bytes,
            report.shared_bytes,
            args.arch,
            case.num_warps,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
