"""`python -m loraplex.tools.kernel_compile`: the Triton kernels the CPU tests only
interpret compile for sm_90 (H100, H200) without a GPU, with no register spills; and a
kernel the compiler rejects fails the check. Subprocesses: the test session interprets
the kernels (TRITON_INTERPRET, tests/conftest.py), which leaves nothing to compile."""

from __future__ import annotations

import os
import subprocess
import sys

from loraplex.tools.kernel_compile import CASES


def compile_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_every_case_compiles_for_sm90_without_spills():
    result = subprocess.run(
        [sys.executable, "-m", "loraplex.tools.kernel_compile", "--arch", "90"],
        capture_output=True,
        text=True,
        env=compile_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("ok ")]
    assert len(lines) == len(CASES), result.stderr
    assert all(", 0 bytes spilled" in line for line in lines), lines


def test_a_kernel_the_compiler_rejects_fails_the_check():
    """A tile of 100 columns (tl.arange needs a power of two): the interpreter would run
    it, the compiler refuses it."""
    script = (
        "from loraplex.tools.kernel_compile import KernelCase, compile_case\n"
        "case = KernelCase('odd tile', 'loraplex.kernels.rms_norm:_rms_norm_kernel',"
        " {'HAS_RESIDUAL': True, 'BLOCK': 100}, 4)\n"
        "try:\n"
        "    compile_case(case, 90)\n"
        "except Exception as error:\n"
        "    print('refused:', type(error).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=compile_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout, result.stdout + result.stderr


def test_the_check_refuses_to_run_interpreted():
    env = {**compile_env(), "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "loraplex.tools.kernel_compile"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2 and "TRITON_INTERPRET" in result.stderr
