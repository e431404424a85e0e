"""Two GPUs (torchrun, NCCL): tp=2 logits match tp=1 within bf16 tolerance on a random model of real
layer shape and decode identically on both ranks through CUDA graphs; dp=2 tokens equal one process's.
The checks themselves are in tests/distributed_gpu_worker.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_tensor_and_data_parallel_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TRITON_INTERPRET="0",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("distributed_gpu_worker.py"))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # (not an assert: pytest would shorten the workers' output to a line)
        pytest.fail(f"the workers exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n"
                    f"{done.stderr[-8000:]}", pytrace=False)
    assert "distributed GPU checks passed" in done.stdout
