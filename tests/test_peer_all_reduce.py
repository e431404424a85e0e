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


class _FusingRanks(_TwoEqualRanks):
    """Two equal ranks whose peer memory also takes the fused all-reduce + add + norm (the reference's maths)."""

    def __init__(self, nbytes: int, fused_bytes: int):
        super().__init__(nbytes)
        self.slot_elems, self.fused = fused_bytes // 2, 0

    def add_rms_norm_(self, part, h, weight, eps):
        from treegen.kernels.peer_add_norm import peer_add_rms_norm_reference

        self.fused += 1
        new_h, x = peer_add_rms_norm_reference(h, [part, part], weight, eps)
        h.copy_(new_h)
        return x


def test_a_row_parallel_product_is_left_for_the_fused_add_and_norm_where_it_fits():
    from treegen.runtime.distributed import PartialSum, TensorParallel
    from treegen.runtime.shard import Shard

    peer = _FusingRanks(4096, fused_bytes=512)
    tp = TensorParallel(shard=Shard(0, 2), group=None, peer=peer)
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    y = tp.row_parallel(x, w)  # [4, 32] bf16: 256 bytes, fits the slots
    assert isinstance(y, PartialSum) and torch.equal(y.part, torch.nn.functional.linear(x, w))
    h, norm = torch.randn(4, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    want = h.float() + (2 * y.part.float()).to(torch.bfloat16).float()
    y.add_rms_norm_(h, norm, 1e-6)
    assert peer.fused == 1 and torch.equal(h, want.to(torch.bfloat16)) and peer.sums == 0
    # too large for the slots, a dtype the slots do not take, or the knob off: the sum itself, as before
    for args, knob in (((torch.randn(9, 16, dtype=torch.bfloat16), w), True), ((x.float(), w.float()), True),
                       ((x, w), False)):
        tp.fused_norm = knob
        out = tp.row_parallel(*args)
        assert isinstance(out, torch.Tensor) and torch.equal(out, 2 * torch.nn.functional.linear(*args))
    assert peer.sums == 3 and peer.fused == 1
    # no rows: nothing for the fused kernel to wait for (the sum itself, through the collective)
    assert PeerAllReduce.fuses(peer, (4, 32), torch.bfloat16) and not PeerAllReduce.fuses(peer, (0, 32), torch.bfloat16)


def test_the_model_leaves_every_sum_but_the_last_to_the_fused_add_and_norm():
    """A split model (rank 0 of two equal ranks, fp16, its CUDA-path kernels run by Triton's interpreter): o of
    every layer and down of every layer but the last are read by the fused add + norm; the last down by the
    final norm, which is not fused, so it is summed alone. The logits are the unfused path's."""
    from transformers import LlamaConfig

    from treegen.runtime.distributed import TensorParallel
    from treegen.runtime.model import LlamaFamilyModel
    from treegen.runtime.shard import Shard

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    ids, pos = torch.tensor([3, 5, 7, 11]), torch.tensor([0, 1, 2, 3])
    logits, peers = {}, {}
    for fused_norm in (True, False):
        peer = peers[fused_norm] = _FusingRanks(1 << 16, fused_bytes=1 << 12)
        tp = TensorParallel(shard=Shard(0, 2), group=None, peer=peer, fused_norm=fused_norm)
        model = LlamaFamilyModel.random(cfg, dtype=torch.float16, device="cpu", tp=tp)
        model.fused = True  # the CUDA path's fused kernels (Triton's interpreter on the CPU)
        logits[fused_norm] = model.forward(ids, pos, lambda i, q, k, v: q)
    assert (peers[True].fused, peers[True].sums) == (3, 1)
    assert (peers[False].fused, peers[False].sums) == (0, 4)
    torch.testing.assert_close(logits[True], logits[False], rtol=2e-3, atol=2e-3)
