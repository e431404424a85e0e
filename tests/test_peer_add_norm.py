"""The fused all-reduce + residual add + RMSNorm kernel, one rank of a group played on the CPU (Triton's
interpreter): the test plays the peers — their partials already in this rank's receive slots and their
flags raised — and checks what the kernel computes, what it pushes into the peers' slots and the flags it
raises there. Two GPUs run it for real in tests/distributed_gpu_worker.py (against the unfused path)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from treegen.kernels import peer_add_norm
from treegen.kernels.peer_add_norm import peer_add_rms_norm, peer_add_rms_norm_reference


class _Rank:
    """One rank's receive area (2 parities x world slots) and flags, as plain CPU memory."""

    def __init__(self, world: int, programs: int, slot_elems: int, dtype: torch.dtype):
        self.recv = torch.zeros(2 * world, slot_elems, dtype=dtype)
        self.flags = torch.zeros(programs, world, dtype=torch.int64)

    def slot(self, epoch: int, src: int, rows: int, hidden: int) -> torch.Tensor:
        world = self.recv.shape[0] // 2
        return self.recv[(epoch % 2) * world + src, : rows * hidden].view(rows, hidden)


@pytest.mark.parametrize("dtype,world,rank,rows,tile", [(torch.float32, 2, 0, 5, None), (torch.float16, 2, 1, 5, None),
                                                       (torch.float32, 3, 1, 5, None), (torch.float32, 2, 1, 13, 64)])
def test_one_rank_sums_the_peers_partials_adds_normalises_and_signals(dtype, world, rank, rows, tile, monkeypatch):
    if tile is not None:  # tiles of two rows: a program's five rows take three of them, the last one part-full
        monkeypatch.setattr(peer_add_norm, "TILE_ELEMS", tile)
    hidden, programs, slot_elems, eps = 24, 3, 400, 1e-5
    gen = torch.Generator().manual_seed(world * 10 + rank)
    ranks = [_Rank(world, programs, slot_elems, dtype) for _ in range(world)]
    recv = torch.tensor([r.recv.data_ptr() for r in ranks], dtype=torch.int64)
    flags = torch.tensor([r.flags.data_ptr() for r in ranks], dtype=torch.int64)
    epochs = torch.zeros(programs, dtype=torch.int64)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    me = ranks[rank]
    for epoch in (1, 2, 3):  # both parities, and the first again
        parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
        for p in range(world):  # the peers have pushed their partials here and raised their flags
            if p != rank:
                me.slot(epoch, p, rows, hidden).copy_(parts[p])
                me.flags[:, p] = epoch
        want_h, want_x = peer_add_rms_norm_reference(h, parts, weight, eps)
        x = peer_add_rms_norm(parts[rank], h, weight, eps, rank=rank, world=world, recv=recv, flags=flags,
                              epochs=epochs, slot_elems=slot_elems)
        assert torch.equal(h, want_h), epoch  # the sum and the add round as the reference does
        torch.testing.assert_close(x, want_x)  # (the norm's mean: fp32 summation order)
        assert torch.equal(epochs, torch.full((programs,), epoch))
        for p in range(world):  # our partial is in our slot at every peer, and our flags are raised there
            if p != rank:
                assert torch.equal(ranks[p].slot(epoch, rank, rows, hidden), parts[rank])
                assert torch.equal(ranks[p].flags[:, rank], torch.full((programs,), epoch))


def test_the_reference_rounds_the_sum_once_then_the_residual_add():
    # 1 + 2^-8 is a tie in bf16 (8 significant bits) and rounds to 1: summed first and rounded, the partials
    # give 1 and h + 1 = 1 + 2^-8 rounds to 1 again; all three added in fp32 would give 1 + 2^-7
    h = torch.tensor([[2**-8]], dtype=torch.bfloat16)
    parts = [torch.tensor([[1.0]], dtype=torch.bfloat16), torch.tensor([[2**-8]], dtype=torch.bfloat16)]
    new_h, x = peer_add_rms_norm_reference(h, parts, torch.ones(1, dtype=torch.bfloat16), 1e-6)
    assert new_h.item() == 1.0 and x.item() == 1.0
    assert h.item() == 2**-8, "the reference changed its input"


def test_bad_shapes_are_refused_before_any_launch():
    y = torch.zeros(4, 8)
    common = dict(rank=0, world=2, recv=torch.zeros(2, dtype=torch.int64), flags=torch.zeros(2, dtype=torch.int64),
                  epochs=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="must agree"):
        peer_add_rms_norm(y, torch.zeros(4, 9), torch.ones(8), 1e-5, slot_elems=64, **common)
    with pytest.raises(ValueError, match="does not fit a receive slot"):
        peer_add_rms_norm(y, torch.zeros(4, 8), torch.ones(8), 1e-5, slot_elems=16, **common)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        peer_add_rms_norm(y, torch.zeros(4, 8), torch.ones(8), 1e-5, slot_elems=64, **{**common, "rank": 2})
