"""A tensor-parallel all-reduce, the residual add and RMSNorm in one kernel, over peer GPU memory.

Under tensor parallel every decoder layer ends its attention and its MLP with a row-parallel product (o,
down) whose partial sums are summed over the group, added to the residual stream and normalised for the
next sub-layer. :func:`peer_add_rms_norm` does all three in one launch, with one cross-GPU
synchronisation where a separate all-reduce (PyTorch's two-shot) needs two and then a norm kernel:

1. *push*: each program copies its rows of this rank's partial ``y`` into this rank's slot of every peer's
   receive area (stores over NVLink into memory the peer mapped for us), then raises its flag at every
   peer (a release store of the operation's epoch, system scope);
2. *wait*: it waits until every peer's flag for this program has reached the epoch (acquire);
3. *reduce, add, norm*: for its rows it sums the partials in rank order (fp32, rounded to the model dtype
   once: on every rank the same bits), adds the sum to ``h`` in place and writes ``RMSNorm(h) * weight``
   to ``x``, rounding where Hugging Face's PyTorch code rounds (as :func:`~treegen.kernels.fused_ops.add_rms_norm`).

No barrier at the end: receive areas alternate between two parities by the epoch, so an operation writes
where the operation before the previous one was read, and a rank reaches operation k + 2 only after every
peer signalled operation k + 1, which it did after finishing operation k (stream order). The epochs are
device counters, one per program, advanced by the kernel itself: the same on every rank whatever mix of
eager launches and CUDA-graph replays runs, as long as every rank runs the same sequence of these
operations with the same number of programs (the grid is fixed: ``epochs.numel()``).

The peers' memory comes from the caller (:class:`~treegen.runtime.peer_all_reduce.PeerAllReduce`): tables of
addresses, in this process's address space, of every rank's receive area and flags. Only peer loads,
stores and atomics are used, never NVLink multicast. The reference (:func:`peer_add_rms_norm_reference`)
takes the ranks' partials as a list: the maths without the exchange.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treegen.kernels.fused_ops import rms_norm_reference
from treegen.kernels.launch import Launcher, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

MAX_HIDDEN = 16384  # widest row one program normalises at once (Llama-3-405B is 16,384)
TILE_ELEMS = 16384  # a program moves up to this many elements at once: as many whole rows as fit (at least one)
NUM_WARPS = 16


def peer_add_rms_norm_reference(h: Tensor, parts: list[Tensor], weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The maths of :func:`peer_add_rms_norm`: ``y = sum(parts)`` in rank order (fp32, rounded once to the
    model dtype), ``h + y`` rounded, and its RMSNorm. Returns (new h, normed); ``h`` is not changed."""
    acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for part in parts:
        acc += part.float()
    h = (h.float() + acc.to(h.dtype).float()).to(h.dtype)
    return h, rms_norm_reference(h, weight, eps)


if triton is not None:

    @triton.jit
    def _peer_add_rms_norm_kernel(Y, H, W, X, RECV, FLAGS, EPOCHS, rows, hidden, stride_y, stride_h, stride_x,
                                  slot_elems, eps, RANK: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr,
                                  BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        dt = Y.dtype.element_ty
        epoch = tl.load(EPOCHS + pid) + 1
        first_slot = (epoch % 2) * WORLD  # this operation's parity: slots [first_slot, first_slot + WORLD)
        per_program = tl.cdiv(rows, tl.num_programs(0))  # each program its own run of whole rows
        start = pid * per_program
        end = tl.minimum(start + per_program, rows)
        offs_r = tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        ok_c = offs < hidden
        # 1. push this program's rows of our partial into our slot at every peer, then raise our flags there
        for r0 in range(start, end, ROWS):
            r = r0 + offs_r
            ok = (r < end)[:, None] & ok_c[None, :]
            y = tl.load(Y + r[:, None] * stride_y + offs[None, :], mask=ok)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    peer_recv = tl.load(RECV + p).to(tl.pointer_type(dt))
                    tl.store(peer_recv + (first_slot + RANK) * slot_elems + r[:, None] * hidden + offs[None, :], y,
                             mask=ok)
        tl.debug_barrier()  # every thread's stores come before the release below
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer_flags = tl.load(FLAGS + p).to(tl.pointer_type(tl.int64))
                tl.atomic_xchg(peer_flags + pid * WORLD + RANK, epoch, sem="release", scope="sys")
        # 2. wait for every peer's rows of this program
        flags = tl.load(FLAGS + RANK).to(tl.pointer_type(tl.int64))
        for p in tl.static_range(WORLD):
            if p != RANK:
                while tl.atomic_add(flags + pid * WORLD + p, 0, sem="acquire", scope="sys") < epoch:
                    pass
        tl.debug_barrier()
        # 3. sum in rank order, add to the residual stream, normalise
        recv = tl.load(RECV + RANK).to(tl.pointer_type(dt))
        w = tl.load(W + offs, mask=ok_c, other=0.0).to(tl.float32)
        for r0 in range(start, end, ROWS):
            r = r0 + offs_r
            ok = (r < end)[:, None] & ok_c[None, :]
            acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):
                if p == RANK:
                    part = tl.load(Y + r[:, None] * stride_y + offs[None, :], mask=ok, other=0.0)
                else:  # (past the L1: the slot held other rows two operations ago)
                    part = tl.load(recv + (first_slot + p) * slot_elems + r[:, None] * hidden + offs[None, :],
                                   mask=ok, other=0.0, cache_modifier=".cg")
                acc += part.to(tl.float32)
            y = acc.to(dt).to(tl.float32)  # the all-reduce's sum, in the model dtype
            h_at = H + r[:, None] * stride_h + offs[None, :]
            h = (tl.load(h_at, mask=ok, other=0.0).to(tl.float32) + y).to(H.dtype.element_ty)
            tl.store(h_at, h, mask=ok)
            h32 = h.to(tl.float32)
            var = tl.sum(h32 * h32, axis=1) / hidden
            normed = (h32 * (1.0 / tl.sqrt(var + eps))[:, None]).to(X.dtype.element_ty).to(tl.float32)
            tl.store(X + r[:, None] * stride_x + offs[None, :], (w[None, :] * normed).to(X.dtype.element_ty), mask=ok)
        tl.store(EPOCHS + pid, epoch)


_LAUNCH = Launcher(_peer_add_rms_norm_kernel) if triton is not None else None


def peer_add_rms_norm(y: Tensor, h: Tensor, weight: Tensor, eps: float, *, rank: int, world: int, recv: Tensor,
                      flags: Tensor, epochs: Tensor, slot_elems: int) -> Tensor:
    """Sum ``y [rows, hidden]`` (this rank's partial) over the ``world`` ranks, add the sum to ``h`` in place
    and return ``RMSNorm(h) * weight``. Every rank of the group calls it alike (see the module doc).

    ``recv`` / ``flags``: int64 ``[world]`` tables of each rank's receive area (``2 * world`` slots of
    ``slot_elems`` elements of ``y.dtype``) and flags (``[epochs.numel(), world]`` int64, zero before the first
    operation); ``epochs``: this rank's int64 counters, one per program (the grid), zero at first."""
    for name, t in (("y", y), ("h", h)):
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"peer_add_rms_norm: {name} must be [rows, hidden] with contiguous rows, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
    rows, hidden = y.shape
    if h.shape != y.shape or h.dtype != y.dtype or weight.shape != (hidden,):
        raise ValueError(f"peer_add_rms_norm: y {tuple(y.shape)} {y.dtype}, h {tuple(h.shape)} {h.dtype} and weight "
                         f"{tuple(weight.shape)} must agree")
    if rows * hidden > slot_elems or hidden > MAX_HIDDEN:
        raise ValueError(f"peer_add_rms_norm: [{rows}, {hidden}] does not fit a receive slot of {slot_elems} "
                         f"elements (or is wider than {MAX_HIDDEN})")
    if not 0 <= rank < world or recv.shape != (world,) or flags.shape != (world,) or epochs.dim() != 1:
        raise ValueError(f"peer_add_rms_norm: rank {rank} of {world} needs recv and flags tables of {world} addresses "
                         f"and one epoch per program, got {tuple(recv.shape)}, {tuple(flags.shape)}, "
                         f"{tuple(epochs.shape)}")
    x = torch.empty_like(h)
    block = next_power_of_2(hidden)
    per_program = -(-rows // epochs.numel())
    tile_rows = min(next_power_of_2(max(per_program, 1)), max(1, TILE_ELEMS // block))
    _LAUNCH[(epochs.numel(),)](y, h, weight, x, recv, flags, epochs, rows, hidden, y.stride(0), h.stride(0),
                                x.stride(0), slot_elems, eps, RANK=rank, WORLD=world, ROWS=tile_rows, BLOCK=block,
                                num_warps=NUM_WARPS)
    return x


__all__ = ["MAX_HIDDEN", "peer_add_rms_norm", "peer_add_rms_norm_reference"]
