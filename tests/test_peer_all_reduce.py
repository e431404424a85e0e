"""The choice between the peer-memory all-reduce and NCCL (the all-reduce itself runs on two GPUs:
tests/distributed_gpu_worker.py compares it with NCCL's, also inside a CUDA graph)."""

import torch

from treegen.runtime.peer_all_reduce import PeerAllReduce, _unusable


def test_the_cpu_and_an_opt_out_use_the_collective_library(monkeypatch):
    assert _unusable(torch.device("cpu"), 2) == "not CUDA"
    monkeypatch.setenv("TREEGEN_ALL_REDUCE", "nccl")
    assert _unusable(torch.device("cuda", 0), 2) == "TREEGEN_ALL_REDUCE=nccl"


def test_only_aligned_float_tensors_that_fit_the_buffer_go_through_it():
    peer = PeerAllReduce.__new__(PeerAllReduce)  # (no buffer: fits() reads only its size)
    peer.nbytes = 1024
    assert peer.fits(torch.empty(4, 64, dtype=torch.bfloat16))  # 512 bytes
    assert peer.fits(torch.empty(256, dtype=torch.float32))  # exactly the buffer
    assert not peer.fits(torch.empty(257, dtype=torch.float32))  # larger: NCCL
    assert not peer.fits(torch.empty(3, dtype=torch.bfloat16))  # 6 bytes: not a multiple of 16
    assert not peer.fits(torch.empty(8, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not peer.fits(torch.empty(16, dtype=torch.int32))
    assert not peer.fits(torch.empty(0, dtype=torch.bfloat16))
