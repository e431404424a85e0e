"""The sampling kernels compile for Hopper, on the CPU: the interpreter that runs them in the other CPU tests
does not check what the compiler does (a variable given another type in one branch of an ``if`` runs there and
fails to compile on the GPU), so every variant the runtime launches is compiled here for sm_90 (Triton's own
ptxas, no GPU), in a process without ``TRITON_INTERPRET`` (``tests/kernel_compile_worker.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_the_sampling_and_floor_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    worker = Path(__file__).with_name("kernel_compile_worker.py")
    done = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent.parent)
    lines = done.stdout.splitlines()
    failures = [line for line in lines if line.startswith("FAIL")]
    assert done.returncode == 0 and not failures, "\n".join(failures) or done.stderr[-3000:]
    assert sum(line.startswith("ok ") for line in lines) == 4 + 16 + 16 + 2  # (the variants listed there)
