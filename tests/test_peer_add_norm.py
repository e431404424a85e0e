"""The fused all-reduce + residual add + RMSNorm kernel, one rank of a group played on the CPU (Triton's
interpreter): the test plays the peers — their partials already in this rank's receive slots, the rest of
the slots marked empty — and checks what the kernel computes, what it pushes into the peers' slots and that
it marks the slots it read empty again. Two GPUs run it for real in tests/distributed_gpu_worker.py
(against the two-shot all-reduce and the norm kernel)."""

import os
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from treegen.kernels import peer_add_norm
from treegen.kernels.peer_add_norm import EMPTY, check_exchange, peer_add_rms_norm, peer_add_rms_norm_reference


class _Rank:
    """One rank's receive area (2 parities x world slots), as plain CPU memory, every element marked empty."""

    def __init__(self, world: int, slot_elems: int, dtype: torch.dtype):
        self.recv = torch.empty(2 * world, slot_elems, dtype=dtype)
        self.recv.view(torch.int16).fill_(EMPTY)

    def slot(self, epoch: int, src: int, rows: int, hidden: int) -> torch.Tensor:
        world = self.recv.shape[0] // 2
        return self.recv[(epoch % 2) * world + src, : rows * hidden].view(rows, hidden)


def _empty(t: torch.Tensor) -> bool:
    return bool((t.view(torch.int16) == EMPTY).all())


@pytest.mark.parametrize("world,rank,rows,tile", [(2, 0, 5, None), (2, 1, 5, None), (3, 1, 5, None), (3, 2, 5, None),
                                                  (2, 1, 13, 64), (2, 0, 13, None)])
def test_one_rank_sums_the_peers_partials_adds_normalises_and_marks_its_slots_empty(world, rank, rows, tile,
                                                                                     monkeypatch):
    # (fp16: Triton's interpreter rounds bf16 otherwise than a GPU does; two GPUs run bf16 in the worker)
    # (13 rows: five a program, in two tiles of up to four rows; with tiles capped at 64 elements, three of two)
    if tile is not None:  # tiles of two rows: a program's five rows take three of them, the last one part-full
        monkeypatch.setattr(peer_add_norm, "TILE_ELEMS", tile)
    hidden, programs, slot_elems, eps, dtype = 24, 3, 400, 1e-5, torch.float16
    gen = torch.Generator().manual_seed(world * 10 + rank)
    ranks = [_Rank(world, slot_elems, dtype) for _ in range(world)]
    recv = torch.tensor([r.recv.data_ptr() for r in ranks], dtype=torch.int64)
    epochs = torch.zeros(programs, dtype=torch.int64)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    me = ranks[rank]
    for epoch in (1, 2, 3):  # both parities, and the first again
        parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
        parts[rank][0, :3] = torch.tensor([-0.0, 0.0, 1.0])  # a -0.0 of ours is sent as +0.0 (-0.0 marks empty)
        for p in range(world):  # the peers have pushed their partials here
            if p != rank:
                assert _empty(me.slot(epoch, p, rows, hidden)), "a slot was not marked empty after its last read"
                me.slot(epoch, p, rows, hidden).copy_(parts[p])
        want_h, want_x = peer_add_rms_norm_reference(h, parts, weight, eps)
        x = peer_add_rms_norm(parts[rank], h, weight, eps, rank=rank, world=world, recv=recv, epochs=epochs,
                              slot_elems=slot_elems)
        assert torch.equal(h, want_h), epoch  # the sum and the add round as the reference does
        torch.testing.assert_close(x, want_x)  # (the norm's mean: fp32 summation order)
        assert torch.equal(epochs, torch.full((programs,), epoch))
        for p in range(world):
            if p != rank:  # our partial is in our slot at every peer, -0.0 as +0.0; the slots we read are empty
                sent = ranks[p].slot(epoch, rank, rows, hidden)
                assert torch.equal(sent, parts[rank]) and not _empty(sent[0, :1]) and sent[0, 0].item() == 0.0
                assert _empty(me.slot(epoch, p, rows, hidden))
                ranks[p].slot(epoch, rank, rows, hidden).view(torch.int16).fill_(EMPTY)  # (the peer read it)


def test_a_rank_waits_for_a_peer_partial_that_arrives_late():
    """The peer's rows land in the slot only while the kernel runs (another thread writes them): the kernel
    waits for them, then sums them — it neither takes the empty marks as data nor finishes without them."""
    rows, hidden, programs, slot_elems, eps, dtype = 4, 16, 2, 128, 1e-5, torch.float16
    gen = torch.Generator().manual_seed(7)
    ranks = [_Rank(2, slot_elems, dtype) for _ in range(2)]
    recv = torch.tensor([r.recv.data_ptr() for r in ranks], dtype=torch.int64)
    epochs = torch.zeros(programs, dtype=torch.int64)
    weight, h = torch.randn(hidden, generator=gen).to(dtype), torch.randn(rows, hidden, generator=gen).to(dtype)
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2)]
    want_h, want_x = peer_add_rms_norm_reference(h, parts, weight, eps)
    out = {}
    kernel = threading.Thread(target=lambda: out.update(x=peer_add_rms_norm(
        parts[0], h, weight, eps, rank=0, world=2, recv=recv, epochs=epochs, slot_elems=slot_elems)), daemon=True)
    kernel.start()
    time.sleep(1.0)
    waited = kernel.is_alive()
    ranks[0].slot(1, 1, rows, hidden).copy_(parts[1])  # (also frees the kernel should it fail below)
    kernel.join(timeout=60)
    assert waited, "the kernel finished before its peer's partial arrived"
    assert not kernel.is_alive(), "the kernel did not see its peer's partial arrive"
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out["x"], want_x)


def test_no_rows_launch_nothing():
    epochs = torch.zeros(2, dtype=torch.int64)
    y = torch.zeros(0, 8, dtype=torch.float16)
    x = peer_add_rms_norm(y, y.clone(), torch.ones(8, dtype=torch.float16), 1e-5, rank=0, world=2,
                          recv=torch.zeros(2, dtype=torch.int64), epochs=epochs, slot_elems=64)
    assert x.shape == (0, 8) and not epochs.any()  # (the epochs stay in step with the peers', who skip alike)


def test_the_reference_rounds_the_sum_once_then_the_residual_add():
    # 1 + 2^-8 is a tie in bf16 (8 significant bits) and rounds to 1: summed first and rounded, the partials
    # give 1 and h + 1 = 1 + 2^-8 rounds to 1 again; all three added in fp32 would give 1 + 2^-7
    h = torch.tensor([[2**-8]], dtype=torch.bfloat16)
    parts = [torch.tensor([[1.0]], dtype=torch.bfloat16), torch.tensor([[2**-8]], dtype=torch.bfloat16)]
    new_h, x = peer_add_rms_norm_reference(h, parts, torch.ones(1, dtype=torch.bfloat16), 1e-6)
    assert new_h.item() == 1.0 and x.item() == 1.0
    assert h.item() == 2**-8, "the reference changed its input"


def test_bad_input_is_refused_before_any_launch():
    y = torch.zeros(4, 8, dtype=torch.float16)
    common = dict(rank=0, world=2, recv=torch.zeros(2, dtype=torch.int64), epochs=torch.zeros(2, dtype=torch.int64))
    w = torch.ones(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="must agree"):
        peer_add_rms_norm(y, torch.zeros(4, 9, dtype=torch.float16), w, 1e-5, slot_elems=64, **common)
    with pytest.raises(ValueError, match="float32 partials"):
        peer_add_rms_norm(y.float(), torch.zeros(4, 8), w.float(), 1e-5, slot_elems=64, **common)
    with pytest.raises(ValueError, match="does not fit a receive slot"):
        peer_add_rms_norm(y, y.clone(), w, 1e-5, slot_elems=16, **common)
    with pytest.raises(ValueError, match="contiguous float"):
        peer_add_rms_norm(y, y.clone(), torch.ones(16, dtype=torch.float16)[::2], 1e-5, slot_elems=64, **common)
    # the exchange itself is checked once, where its buffer is made (PeerAllReduce)
    check_exchange(slot_elems=64, **common)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        check_exchange(slot_elems=64, **{**common, "rank": 2})
    with pytest.raises(ValueError, match="int64 epochs"):
        check_exchange(slot_elems=64, **{**common, "epochs": torch.zeros(2)})
    with pytest.raises(ValueError, match="16-byte vectors"):
        check_exchange(slot_elems=60, **common)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        check_exchange(slot_elems=64, **{**common, "recv": torch.tensor([0, 8], dtype=torch.int64)})
