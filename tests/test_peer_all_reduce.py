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


class _TwoEqualRanks(PeerAllReduce):
    """A peer all-reduce without GPUs: a plain buffer, and a "sum" of two ranks that hold the same values."""

    def __init__(self, nbytes: int):
        self.buffer, self.nbytes, self.sums = torch.zeros(nbytes, dtype=torch.uint8), nbytes, 0

    def sum_(self, view):
        self.sums += 1
        return view.mul_(2)


def test_a_row_parallel_linear_is_written_into_the_peer_buffer_and_summed_there():
    from treegen.runtime.distributed import TensorParallel
    from treegen.runtime.shard import Shard

    peer = _TwoEqualRanks(4096)
    tp = TensorParallel(shard=Shard(0, 2), group=None, peer=peer)
    x, w, b = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)
    for bias in (None, b):
        y = tp.linear_all_reduce(x, w, bias)
        torch.testing.assert_close(y, 2 * torch.nn.functional.linear(x, w, bias))
        assert y.data_ptr() == peer.buffer.data_ptr(), "the product went elsewhere than the peer buffer"
    assert peer.sums == 2
    assert peer.output((8, 32), torch.int32) is None and peer.output((3,), torch.bfloat16) is None
    assert peer.output((33, 32), torch.float32) is None  # 4,224 bytes: larger than the buffer
    collective = []  # a product that does not fit goes to the collective library's all-reduce, as before
    tp.all_reduce = lambda t: collective.append(tuple(t.shape)) or t
    big = torch.randn(33, 16)
    torch.testing.assert_close(tp.linear_all_reduce(big, w), torch.nn.functional.linear(big, w))
    assert collective == [(33, 32)] and peer.sums == 2
