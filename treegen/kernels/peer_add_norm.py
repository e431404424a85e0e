"""A tensor-parallel all-reduce, the residual add and RMSNorm in one kernel, over peer GPU memory.

Under tensor parallel every decoder layer ends its attention and its MLP with a row-parallel product (o,
down) whose partial sums are summed over the group, added to the residual stream and normalised for the
next sub-layer. :func:`peer_add_rms_norm` does all three in one launch, and with no barrier: the data is
its own signal.

1. *push*: each program copies its rows of this rank's partial ``y`` into this rank's slot of every peer's
   receive area (stores over NVLink into memory the peer mapped for us). A slot's elements read ``-0.0``
   (:data:`EMPTY`) until written, so a ``-0.0`` of the partial is sent as ``+0.0`` (the same in the sum,
   which starts from ``+0.0``: the ranks keep the same bits);
2. *wait, reduce, add, norm*: for each tile of its rows it reads its slots until no element is ``-0.0``
   (volatile loads: each peer's tile has arrived whole), marks them empty again, sums the partials in rank
   order (fp32, rounded to the model dtype once: on every rank the same bits), adds the sum to ``h`` in
   place and writes ``RMSNorm(h) * weight`` to ``x``, rounding where Hugging Face's PyTorch code rounds
   (as :func:`~treegen.kernels.fused_ops.add_rms_norm`).

This is the "Lamport" one-shot all-reduce of low-latency inference libraries: no flags, no memory fences,
no round trip before the data moves. Receive areas alternate between two parities by an epoch, so an
operation writes where the operation before the previous one was read (and marked empty): a rank pushes
operation k + 2 only after it has read every peer's operation k + 1, which that peer pushed after finishing
operation k (stream order). The epochs are device counters, one per program, advanced by the kernel
itself: the same on every rank whatever mix of eager launches and CUDA-graph replays runs, as long as every
rank runs the same sequence of these operations with the same number of programs (the grid is fixed:
``epochs.numel()``). The slots move in 16-byte vectors (their addresses are checked aligned once, by
:func:`check_exchange`). Measured on two H200s (``benchmarks/profile_multi_gpu.py``,
``multi_gpu_profile_fused_norm_vector_h200.json``), 64 operations of [rows, 4096] bf16 captured in a graph: 0.35 /
0.46 / 0.72 / 1.18 / 2.27 / 5.13 ms at 64 / 128 / 256 / 512 / 1,024 / 2,048 rows against 0.63 / 0.82 / 1.03 / 1.53 /
2.49 / 4.80 ms for PyTorch's two-shot all-reduce (two barriers) and then the add + norm kernel: ahead up to 1,024
rows, behind at 2,048, where the bytes over NVLink rather than the latency set the time (the caller takes the fused
path up to 2 MiB pushed: see ``peer_all_reduce.FUSED_MAX_BYTES``). Element by element (16-bit stores and polls,
one row a tile) it took 0.45 / 0.57 / 0.82 / 1.49 / 3.28 / 8.41 ms in the same run; with a flag per program and a
release / acquire handshake instead of the marks, 0.52 / 0.64 / 0.93 ms at 64 / 128 / 256 (an earlier run).

The peers' memory comes from the caller (:class:`~treegen.runtime.peer_all_reduce.PeerAllReduce`): a table
of the addresses, in this process's address space, of every rank's receive area. Only peer loads and
stores are used, never NVLink multicast. The reference (:func:`peer_add_rms_norm_reference`) takes the
ranks' partials as a list: the maths without the exchange.
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
# a program's rows are taken in two tiles (each waits for its peers' parts while the other's are on the way), of
# at most this many elements, 1,024 a warp. Two H200s, 64 operations of [rows, 4,096] bf16 (rows / 128 a program)
# in 16-byte vectors: 1.18 / 2.30 ms at 512 / 1,024 rows against 1.29 / 2.88 in tiles of one row (2.50 ms for the
# two-shot all-reduce and the norm kernel at 1,024); 64 to 256 rows alike either way (0.71 ms at 256)
TILE_ELEMS = 16384
DTYPES = (torch.bfloat16, torch.float16)  # the partials it sums: 16-bit, so that -0.0 can mark empty
EMPTY = -32768  # -0.0 in bf16 and fp16 (0x8000) as int16: a receive slot's element not written yet


def peer_add_rms_norm_reference(h: Tensor, parts: list[Tensor], weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The maths of :func:`peer_add_rms_norm`: ``y = sum(parts)`` in rank order (fp32, rounded once to the
    model dtype), ``h + y`` rounded, and its RMSNorm. Returns (new h, normed); ``h`` is not changed."""
    acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for part in parts:
        acc += part.float()
    h = (h.float() + acc.to(h.dtype).float()).to(h.dtype)
    return h, rms_norm_reference(h, weight, eps)


if triton is not None:
    EMPTY_MARK = tl.constexpr(EMPTY)

    @triton.jit
    def _peer_add_rms_norm_kernel(Y, H, W, X, RECV, EPOCHS, rows, hidden, stride_y, stride_h, stride_x,
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
        # 1. push this program's rows of our partial into our slot at every peer (-0.0 sent as +0.0: it marks empty)
        for r0 in range(start, end, ROWS):
            r = r0 + offs_r
            ok = (r < end)[:, None] & ok_c[None, :]
            y = tl.load(Y + r[:, None] * stride_y + offs[None, :], mask=ok)
            y = tl.where(y == 0, tl.zeros_like(y), y)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    peer_recv = tl.multiple_of(tl.load(RECV + p).to(tl.pointer_type(dt)), 16)  # check_exchange
                    tl.store(peer_recv + (first_slot + RANK) * slot_elems + r[:, None] * hidden + offs[None, :], y,
                             mask=ok)
        # 2. per tile: wait until every peer's part is in, sum in rank order, add to the residual stream,
        # normalise; mark the slots empty again (written next two operations on)
        recv = tl.multiple_of(tl.load(RECV + RANK).to(tl.pointer_type(tl.int16)), 16)
        w = tl.load(W + offs, mask=ok_c, other=0.0).to(tl.float32)
        for r0 in range(start, end, ROWS):
            r = r0 + offs_r
            ok = (r < end)[:, None] & ok_c[None, :]
            acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):
                if p == RANK:
                    acc += tl.load(Y + r[:, None] * stride_y + offs[None, :], mask=ok, other=0.0).to(tl.float32)
                else:
                    at = recv + (first_slot + p) * slot_elems + r[:, None] * hidden + offs[None, :]
                    bits = tl.load(at, mask=ok, other=0, volatile=True)
                    while tl.sum((bits == EMPTY_MARK).to(tl.int32)) > 0:
                        bits = tl.load(at, mask=ok, other=0, volatile=True)
                    tl.store(at, tl.full([ROWS, BLOCK], EMPTY_MARK, tl.int16), mask=ok)
                    acc += bits.to(dt, bitcast=True).to(tl.float32)
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


def check_exchange(rank: int, world: int, recv: Tensor, epochs: Tensor, slot_elems: int) -> None:
    """Refuse an exchange :func:`peer_add_rms_norm` cannot use (it does not check these on every call: they are
    fixed for a buffer's life, and :class:`~treegen.runtime.peer_all_reduce.PeerAllReduce` checks them once).
    ``recv``: int64 ``[world]``, the address of each rank's receive area (``2 * world`` slots of ``slot_elems``
    16-bit elements, every element ``EMPTY`` before the first operation); ``epochs``: this rank's int64
    counters, one per program (the grid), zero at first, on the device of the partials. Reads the table once."""
    if not 0 <= rank < world or recv.shape != (world,) or epochs.dim() != 1 \
            or recv.dtype != torch.int64 or epochs.dtype != torch.int64 or recv.device != epochs.device:
        raise ValueError(f"peer_add_rms_norm: rank {rank} of {world} needs an int64 table of {world} receive areas and "
                         f"int64 epochs, one per program, on one device, got {recv.dtype} {tuple(recv.shape)} on "
                         f"{recv.device} and {epochs.dtype} {tuple(epochs.shape)} on {epochs.device}")
    if slot_elems <= 0 or slot_elems % 8:
        raise ValueError(f"peer_add_rms_norm: a slot of {slot_elems} elements; it must hold whole 16-byte vectors")
    misaligned = [hex(address) for address in recv.tolist() if address % 16]
    if misaligned:  # the kernel moves the slots in 16-byte vectors (tl.multiple_of on these addresses)
        raise ValueError(f"peer_add_rms_norm: receive areas at {misaligned} are not 16-byte aligned")


def peer_add_rms_norm(y: Tensor, h: Tensor, weight: Tensor, eps: float, *, rank: int, world: int, recv: Tensor,
                      epochs: Tensor, slot_elems: int) -> Tensor:
    """Sum ``y [rows, hidden]`` (this rank's partial, bf16 or fp16) over the ``world`` ranks, add the sum to
    ``h`` in place and return ``RMSNorm(h) * weight``. Every rank of the group calls it alike (module doc).
    The exchange (``rank``, ``world``, ``recv``, ``epochs``, ``slot_elems``) is :func:`check_exchange`'s; this
    checks what changes from call to call (a decode step makes 63 of them at 32 layers)."""
    if y.dim() != 2 or y.stride(1) != 1 or h.shape != y.shape or h.stride(1) != 1 or h.dtype != y.dtype \
            or weight.shape != (y.shape[1],) or weight.stride(0) != 1 or not weight.is_floating_point():
        raise ValueError(f"peer_add_rms_norm: y {tuple(y.shape)} strides {y.stride()} {y.dtype}, h {tuple(h.shape)} "
                         f"strides {h.stride()} {h.dtype} and weight {tuple(weight.shape)} strides {weight.stride()} "
                         "must agree: [rows, hidden] with contiguous rows, and a contiguous float [hidden] weight")
    rows, hidden = y.shape
    if y.dtype not in DTYPES:
        raise ValueError(f"peer_add_rms_norm: {y.dtype} partials; the receive slots mark empty as 16-bit -0.0, "
                         f"so only {DTYPES} go through them")
    if rows * hidden > slot_elems or hidden > MAX_HIDDEN:
        raise ValueError(f"peer_add_rms_norm: [{rows}, {hidden}] does not fit a receive slot of {slot_elems} "
                         f"elements (or is wider than {MAX_HIDDEN})")
    if max(y.stride(0), h.stride(0)) * rows >= 2**31:
        raise ValueError(f"peer_add_rms_norm: {rows} rows of stride {max(y.stride(0), h.stride(0))} overflow the "
                         "kernel's 32-bit row offsets")
    x = torch.empty_like(h)
    if rows == 0:  # nothing to sum, on every rank alike: no launch (an operation without rows would wait for
        return x  # nothing, and the one after it could overwrite a slot a peer has not read yet)
    block = next_power_of_2(hidden)
    programs = epochs.numel()
    tile_rows = min(next_power_of_2(-(-rows // (2 * programs))), max(1, TILE_ELEMS // block))
    _LAUNCH[(programs,)](y, h, weight, x, recv, epochs, rows, hidden, y.stride(0), h.stride(0), x.stride(0),
                         slot_elems, eps, RANK=rank, WORLD=world, ROWS=tile_rows, BLOCK=block,
                         num_warps=max(4, min(16, tile_rows * block // 1024)))
    return x


__all__ = ["DTYPES", "EMPTY", "MAX_HIDDEN", "check_exchange", "peer_add_rms_norm", "peer_add_rms_norm_reference"]
