"""The tensor-parallel all-reduce over peer GPU memory: PyTorch symmetric memory's two-shot all-reduce, and the fused
all-reduce + residual add + RMSNorm of :mod:`treegen.kernels.peer_add_norm`.

A decode step of a split model all-reduces two small activations per layer ([batch, hidden]: 0.5 MB
at batch 64 of the Llama-3-8B shape). NCCL spends ~20-35 µs on each on two H200s, latency rather than
bandwidth, which at 64 of them a step is 1.3-2.3 ms, a quarter of the step (``benchmarks/
profile_multi_gpu.py``). Here each rank puts its partial sum into a buffer that every rank of the
group has mapped (``torch.distributed._symmetric_memory``, CUDA IPC over NVLink): the row-parallel GEMMs
write theirs there directly and the model reads the sum from there (:meth:`PeerAllReduce.output`,
``TensorParallel.linear_all_reduce``); other tensors are copied in and out. The two-shot kernel then
has each rank sum its share of the elements from every peer's buffer and gather the others' shares,
with a barrier on signal pads at both ends. Measured on two H200s, 64 all-reduces captured in
a CUDA graph, copies included: 0.66 / 1.06 / 2.59 ms at batch 64 / 256 / 1024 against NCCL's 1.36 /
2.32 / 3.52 ms; one-shot measured 0.69 / 1.30 / 3.58 ms. Every rank ends with the same bits (each
element is summed on one rank and copied to the others), as NCCL's all-reduce guarantees. Without the
copies (products written in place), tp=2 at batch 256 went from 1.26x to 1.40x one GPU and was unchanged
at 1,024 (1.50x) on two H200s (``bench_multi_gpu.py --peer-output both``, multi_gpu_peer_output_h200_x2.json).

The row-parallel products' sums are mostly taken by another kernel of this buffer: the residual add and
the next RMSNorm come right after them, and :meth:`PeerAllReduce.add_rms_norm_` does the three in one
launch with no barrier (:mod:`treegen.kernels.peer_add_norm`; up to ``FUSED_MAX_BYTES`` pushed to the peers):
0.72 ms for a step's 64 of them at batch 256 on two H200s, against 1.03 ms for the two-shot all-reduce
and then the norm kernel; tp=2 1.41 / 1.42x one GPU at batch 256 against 1.32 / 1.32x
(``multi_gpu_fused_norm_vector_h200_x2.json``).

Only peer loads and stores are used: never NVLink multicast (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is
set before the buffer is made, and no ``multimem`` operation is called). Tensors larger than the
buffer (long prefill chunks), of other dtypes than it can view, or misaligned go to NCCL. Set
``TREEGEN_ALL_REDUCE=nccl`` to use NCCL for everything.

One buffer per process: a rendezvous in a process that already made one, with peers that did not
(a notebook's second tensor-parallel engine, whose workers are new processes), hangs — PyTorch keeps
per-process exchange counters (pytorch/pytorch#196082); seen on two H200s. So only the first
tensor-parallel group of each process uses peer memory, the ranks agreeing before any buffer is made;
later groups of the same process use NCCL.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from treegen.kernels.peer_add_norm import DTYPES as FUSED_DTYPES
from treegen.kernels.peer_add_norm import EMPTY, MAX_HIDDEN, check_exchange, peer_add_rms_norm

BUFFER_BYTES = 64 * 2**20  # per rank, PyTorch's two-shot all-reduce: [8192, 4096] bf16 activations
# the most bytes the fused all-reduce + add + norm kernel pushes out of each GPU in one operation: its partial to
# every peer, (world - 1) x the partial ([256, 4,096] bf16 at two GPUs), so each slot of its receive area holds
# FUSED_MAX_BYTES / (world - 1). On two H200s (64 operations, 16-byte vectors) it beats the two-shot all-reduce and
# the norm kernel there (0.72 vs 1.03 ms at 2 MiB) and up to 8 MiB (2.27 vs 2.49 ms; end to end tp=2 1.57 / 1.58x one
# GPU at batch 512 against 1.50 / 1.51x), and loses at 16 MiB (5.13 vs 4.80 ms). Not raised past 2 MiB: with 8 MiB
# the two-GPU worker's greedy tokens of the fused and the unfused model (random weights, a 300-token prompt summed
# in tiles of two rows) agreed on 86% against over 90% at 2 MiB, with h the same bits and x within its tolerance
# in the kernel's own checks at 700 and 1,024 rows — near-ties of a random model or not, not settled (stop 62; the
# worker now compares the two teacher-forced, which near-ties cannot fail: to be run at 2 and 8 MiB).
# The two-shot moves 2 (world - 1) / world x the partial, so at more GPUs the one-shot's bytes grow faster and the
# limit is counted in bytes pushed
FUSED_MAX_BYTES = 2 * 2**20
FUSED_PROGRAMS = 128  # the fused kernel's grid, fixed for the buffer's life (its epochs count per program)
_MAPPED = False  # this process has made a symmetric buffer (see the module doc: one per process)
ALIGN = 16  # bytes: the kernels' vector width
FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes the buffer is summed as


class PeerAllReduce:
    """A symmetric buffer mapped by every rank of ``group`` and the all-reduce through it.

    Its layout: ``nbytes`` for PyTorch's two-shot all-reduce (:meth:`sum_`), then the receive area of the
    fused all-reduce + residual add + RMSNorm (:meth:`add_rms_norm_`, :mod:`treegen.kernels.peer_add_norm`:
    two parities x ``world`` slots of ``fused_bytes / (world - 1)``: ``fused_bytes`` (default
    ``FUSED_MAX_BYTES``) is the most one operation pushes to the peers in all), marked empty here
    before any rank can write)."""

    def __init__(self, group, device: torch.device, nbytes: int = BUFFER_BYTES, fused_bytes: int | None = None,
                 programs: int = FUSED_PROGRAMS):
        import torch.distributed._symmetric_memory as symm_mem

        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch; a no-op (deprecated) after
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        pushed = FUSED_MAX_BYTES if fused_bytes is None else fused_bytes
        self.slot_elems = pushed // max(self.world - 1, 1) // ALIGN * ALIGN // 2  # (16-bit elements: FUSED_DTYPES)
        recv_bytes = 2 * self.world * self.slot_elems * 2
        self.buffer = symm_mem.empty(nbytes + recv_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if int(getattr(handle, "multicast_ptr", 0)) != 0:
            raise RuntimeError("symmetric memory mapped a multicast object; treegen never uses NVLink multicast")
        self.nbytes = nbytes
        if handle.rank != self.rank or handle.world_size != self.world:
            raise RuntimeError(f"symmetric memory numbers this rank {handle.rank} of {handle.world_size}; "
                               f"the group, {self.rank} of {self.world}")
        # (the buffer tensor may start inside its symmetric allocation: at the same offset on every rank)
        start = self.buffer.data_ptr() - handle.buffer_ptrs[self.rank]
        self.recv_ptrs = torch.tensor([p + start + nbytes for p in handle.buffer_ptrs], dtype=torch.int64,
                                      device=device)
        self.buffer[nbytes:].view(torch.int16).fill_(EMPTY)
        self.epochs = torch.zeros(programs, dtype=torch.int64, device=device)
        check_exchange(self.rank, self.world, self.recv_ptrs, self.epochs, self.slot_elems)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's slots are marked empty before any rank's first push
        global _MAPPED
        _MAPPED = True

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be summed through the buffer (copied in and out: :meth:`all_reduce_`)."""
        return t.is_contiguous() and self._bytes(t.shape, t.dtype) is not None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place (``fits(t)`` must hold); returns ``t``."""
        view = self.output(t.shape, t.dtype)
        view.copy_(t)
        return t.copy_(self.sum_(view))

    def output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The start of the buffer as a tensor of ``shape`` and ``dtype``, for a kernel to write its partial
        sum into before :meth:`sum_` (no copy in); None where such a tensor does not fit (then NCCL serves).
        It is the buffer itself: what it holds is valid until the group's next collective through it."""
        nbytes = self._bytes(shape, dtype)
        return None if nbytes is None else self.buffer[:nbytes].view(dtype).view(shape)

    def _bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        """The bytes a tensor of ``shape`` and ``dtype`` takes of the buffer; None where it cannot go through it
        (not a float the kernel sums, empty, larger than the buffer, or not a multiple of its vector width)."""
        if dtype not in FLOATS:
            return None
        nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
        return nbytes if 0 < nbytes <= self.nbytes and nbytes % ALIGN == 0 else None

    def sum_(self, view: torch.Tensor) -> torch.Tensor:
        """Sum an :meth:`output` tensor over the group in place, on every rank the same bits; returns it."""
        torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", self.group_name)
        return view

    def fuses(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a ``[rows, hidden]`` partial of ``dtype`` can be summed by :meth:`add_rms_norm_`."""
        return dtype in FUSED_DTYPES and len(shape) == 2 and shape[0] > 0 and 0 < shape[1] <= MAX_HIDDEN \
            and shape[0] * shape[1] <= self.slot_elems

    def add_rms_norm_(self, part: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Sum ``part`` (``fuses`` holds) over the group, add the sum to ``h`` in place and return
        ``RMSNorm(h) * weight``, in one kernel (:func:`~treegen.kernels.peer_add_norm.peer_add_rms_norm`)."""
        return peer_add_rms_norm(part, h, weight, eps, rank=self.rank, world=self.world, recv=self.recv_ptrs,
                                 epochs=self.epochs, slot_elems=self.slot_elems)


def peer_all_reduce_for(group, device: torch.device) -> tuple[PeerAllReduce | None, str]:
    """The peer all-reduce for ``group`` (a tensor-parallel NCCL group, every rank calls this), or None
    and why NCCL serves instead. The ranks agree before any buffer is made, so none waits for a peer
    that declined."""
    reason = _unusable(device, dist.get_world_size(group))
    ok = torch.tensor([reason is None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        return None, reason or "another rank cannot use peer memory"
    return PeerAllReduce(group, device), ("symmetric memory (two-shot; the sum, add and norm fused up to "
                                          f"{FUSED_MAX_BYTES / 2**20:g} MiB pushed)")


def _unusable(device: torch.device, size: int) -> str | None:
    """Why this rank cannot use the peer all-reduce in a group of ``size`` ranks (None: it can)."""
    if os.environ.get("TREEGEN_ALL_REDUCE", "").lower() == "nccl":
        return "TREEGEN_ALL_REDUCE=nccl"
    if device.type != "cuda":
        return "not CUDA"
    if _MAPPED:
        return "this process mapped peer memory for an earlier group (one per process)"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
        return "this torch has no symm_mem.two_shot_all_reduce_"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    if local % size:  # torchrun numbers a host's ranks contiguously: a group of size | local is on one host
        return f"the group's {size} ranks are not all on this host ({local} ranks here)"
    others = [d for d in range(min(local, torch.cuda.device_count())) if d != device.index]
    if not all(torch.cuda.can_device_access_peer(device.index, d) for d in others):
        return "GPUs without peer access"
    return None


__all__ = ["BUFFER_BYTES", "FUSED_MAX_BYTES", "FUSED_PROGRAMS", "PeerAllReduce", "peer_all_reduce_for"]
