"""Several processes, one engine: process groups for tensor and data parallel on ``torch.distributed``.

The world of ``tp * dp`` ranks (one process per GPU; gloo on the CPU) is laid out replica-major:
rank ``r`` is tensor-parallel rank ``r % tp`` of replica ``r // tp``. Every rank of a replica holds
its shard of the model (:mod:`treegen.runtime.shard`) and runs the same program code on the same
sharing tree; the model all-reduces over the replica's **tensor-parallel group**. Replicas run
different programs of a batch (:mod:`treegen.lang.data_parallel`) and exchange only their results,
over the **data-parallel group** of each tensor-parallel rank.

Processes come from ``torchrun`` (its environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...;
any number of nodes through its rendezvous), or, for tensor parallel on one host, from a plain Python
process or a notebook, which becomes rank 0 and starts the others itself (:func:`join_local_group`,
:mod:`treegen.runtime.workers`). Groups are made once, with a timeout, so a collective whose peer died
fails within ``timeout_s`` instead of hanging (NCCL's watchdog aborts the process; gloo raises).
NVLink multicast (NVLS) is switched off in every process (``NCCL_NVLS_ENABLE=0``). On GPUs of one host
the model's all-reduces go over peer memory (:mod:`treegen.runtime.peer_all_reduce`), else NCCL.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from treegen.runtime.peer_all_reduce import PeerAllReduce, peer_all_reduce_for
from treegen.runtime.shard import Shard

DEFAULT_TIMEOUT_S = 300.0
JOIN_POLL_S = 0.05  # how often rank 0 looks for the ranks joining its group (and checks they live)
SMALL_GATHER_BYTES = 1 << 20  # all-gathers up to this size (all ranks' parts) go over peer memory where it serves


class DistributedError(ValueError):
    """The processes cannot be set up as asked (ranks, GPUs, backend)."""


@dataclass(eq=False)
class TensorParallel:
    """This rank's place in its replica's tensor-parallel group: what the model needs."""

    shard: Shard
    group: object | None  # the ProcessGroup (None when shard.size == 1)
    peer: PeerAllReduce | None = None  # the all-reduce over peer GPU memory, where the group can use it
    all_reduce_path: str = "none (one rank)"  # which all-reduce serves, or why NCCL does
    vocab_parallel: bool = False  # the LM head split by vocabulary over the group (see shard.py), else whole
    peer_output: bool = True  # o and down write their products into the peer buffer (False: copied in and out)
    fused_norm: bool = True  # o and down's sums, the residual add and the next norm in one kernel (peer memory)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place (every rank gets the same bits); returns ``t``."""
        if self.shard.size > 1:
            if self.peer is not None and self.peer.fits(t):
                return self.peer.all_reduce_(t)
            dist.all_reduce(t, group=self.group)
        return t

    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A row-parallel linear: ``F.linear(x, weight, bias)`` of this rank's slice, summed over the group.
        Over peer memory the product is written straight into the symmetric buffer and summed there, and
        the buffer itself is returned (no copy in or out: two of a decode step's kernels per all-reduce);
        it holds the sum until the group's next collective, so its reader must come first (the model adds
        it to the residual stream at once). Otherwise a new tensor, summed by :meth:`all_reduce`."""
        out = None
        if self.peer is not None and self.peer_output and x.dim() == 2:  # (a peer buffer: a group of ranks)
            out = self.peer.output((x.shape[0], weight.shape[0]), x.dtype)
        if out is None:
            return self.all_reduce(F.linear(x, weight, bias))
        if bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)
        return self.peer.sum_(out)

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> "torch.Tensor | PartialSum":
        """A row-parallel linear whose sum its reader may take together with what it does next: a
        :class:`PartialSum` of this rank's product where the group's peer memory can sum it in the fused
        add + RMSNorm kernel (``fused_norm``), else the sum itself (:meth:`linear_all_reduce`)."""
        if self.peer is not None and self.fused_norm and x.dim() == 2 \
                and self.peer.fuses((x.shape[0], weight.shape[0]), x.dtype):
            return PartialSum(F.linear(x, weight, bias), self)
        return self.linear_all_reduce(x, weight, bias)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t``, stacked in rank order: ``[size, *t.shape]`` (the same on every rank).
        Captured in CUDA graphs like :meth:`all_reduce`. A small one (at most ``SMALL_GATHER_BYTES`` in all)
        over peer memory where the group has it, as the all-reduce of a zeroed stack holding ``t`` in
        this rank's row (``x + 0`` is ``x``: exact; the peer all-reduce's latency is NCCL's at a third),
        else NCCL's (gloo's) all-gather."""
        size = self.shard.size
        if size == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        out = t.new_empty((size, *t.shape))
        if self.peer is not None and self.peer.fits(out) and out.numel() * out.element_size() <= SMALL_GATHER_BYTES:
            out.zero_()
            out[self.shard.rank].copy_(t)
            return self.peer.all_reduce_(out)
        if out.device.type == "cuda":
            dist.all_gather_into_tensor(out, t, group=self.group)
        else:  # (gloo)
            dist.all_gather(list(out.unbind(0)), t, group=self.group)
        return out

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` of any rank of the group (host decisions every rank must share)."""
        if self.shard.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


@dataclass(eq=False)
class PartialSum:
    """This rank's part of a sum over its tensor-parallel group, not summed yet (a row-parallel product,
    :meth:`TensorParallel.row_parallel`), for its reader to sum together with the residual add and the norm
    that come next, in one kernel (:meth:`add_rms_norm_`). Every rank of the group reads it the same way
    (they run the same model code)."""

    part: torch.Tensor
    tp: TensorParallel

    def add_rms_norm_(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``h += sum`` in place; returns ``RMSNorm(h) * weight`` (Llama's norm)."""
        return self.tp.peer.add_rms_norm_(self.part, h, weight, eps)


@dataclass(eq=False)
class Parallel:
    """The layout of the processes: ``tp`` ranks per replica, ``dp`` replicas, this rank's place."""

    tp: int
    dp: int
    rank: int
    device: torch.device
    tensor: TensorParallel
    dp_group: object | None  # this tensor-parallel rank's ranks across the replicas

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def leader(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    def gather(self, obj) -> list:
        """``obj`` of every replica, in replica order (on every rank); pickled."""
        if self.dp == 1:
            return [obj]
        out: list = [None] * self.dp
        dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def __repr__(self) -> str:
        path = (f", all-reduce: {self.tensor.all_reduce_path}, LM head "
                f"{'split by vocabulary' if self.tensor.vocab_parallel else 'whole'}") if self.tp > 1 else ""
        return (f"Parallel(rank {self.rank} of {self.world}: tp {self.tp_rank}/{self.tp}, "
                f"dp {self.dp_rank}/{self.dp}{path})")


def launched() -> bool:
    """This process is one of several started by torchrun."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def finish_launch() -> None:
    """This rank's part of a torchrun launch is done: wait for every rank, then end the process group
    (what torch asks of a script before it exits; without it, a rank that exits while its group's
    threads run may abort: "terminate called without an active exception"). Nothing to do outside
    torchrun or without a group."""
    if launched() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_layout(tensor_parallel, data_parallel, device: torch.device) -> None:
    """Clear errors for a layout that cannot run, before any process or weight is touched."""
    for name, value in (("tensor_parallel", tensor_parallel), ("data_parallel", data_parallel)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DistributedError(f"{name} must be an integer >= 1, got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedError(f"device {str(device)!r}: CUDA is not available here (torch {torch.__version__}, "
                                   f"{torch.cuda.device_count()} GPUs); use device='cpu'")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", (tensor_parallel or 1) * (data_parallel or 1)))
        if local > 1 and not dist.is_nccl_available():
            raise DistributedError("several GPUs need torch.distributed's NCCL backend, which this torch build lacks")
        have = torch.cuda.device_count()
        if local > have:
            raise DistributedError(f"{local} ranks on this host but only {have} GPU(s): one rank per GPU; "
                                   f"ask for fewer (tensor_parallel x data_parallel) or use more hosts")
    elif device.type != "cpu":
        raise DistributedError(f"several processes run on CUDA (NCCL) or the CPU (gloo), not {device.type}")
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")


def join_local_group(rank: int, world: int, port: int, device: str | torch.device,
                     timeout_s: float = DEFAULT_TIMEOUT_S, check_peers=None) -> None:
    """Make the process group of ``world`` processes of this host that meet at ``127.0.0.1:port``
    (a process started by :mod:`treegen.runtime.workers`, or the user's process as rank 0); rank ``r``
    runs on ``cuda:r`` (NCCL) or the CPU (gloo). Rank 0 hosts the rendezvous and waits until every
    other rank has announced itself before the group is made, calling ``check_peers()`` (which raises
    when a peer process died) while it waits: a worker that dies while starting fails the start within
    a fraction of a second, not after ``timeout_s``."""
    device = torch.device(device)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if dist.is_initialized():
        raise DistributedError("this process already belongs to a process group (one tensor-parallel engine at a "
                               "time per process: close the other with engine.close())")
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = torch.device("cuda", rank)
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=rank == 0, wait_for_workers=False,
                          timeout=timeout)
    if rank == 0:
        joined = [f"treegen/joined/{r}" for r in range(1, world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(joined):
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(joined, start=1) if not store.check([key])]
                raise DistributedError(f"ranks {missing} of {world} did not join the group at 127.0.0.1:{port} "
                                       f"within {timeout_s:.0f} s")
            time.sleep(JOIN_POLL_S)
    else:
        store.set(f"treegen/joined/{rank}", "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout, **kwargs)


def init_parallel(*, tensor_parallel: int = 1, data_parallel: int | None = None,
                  device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
                  vocab_parallel: bool = False) -> Parallel:
    """Join (or make) the process group of this launch and split it into replicas of
    ``tensor_parallel`` ranks; ``data_parallel`` (None: the world size / ``tensor_parallel``) must
    match. Each rank runs on its own GPU (``cuda:LOCAL_RANK``, or ``cuda:RANK`` in a group made by
    :func:`join_local_group`) or the CPU. ``vocab_parallel``: models built on this layout split their
    LM head by vocabulary (:attr:`TensorParallel.vocab_parallel`; ignored at ``tensor_parallel`` 1)."""
    device = torch.device(device)
    check_layout(tensor_parallel, data_parallel, device)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (also inherited by what this process starts)
    if device.type == "cuda":
        local = os.environ.get("LOCAL_RANK") if launched() else None
        device = torch.device("cuda", int(local) if local is not None else (dist.get_rank() if dist.is_initialized() else 0))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if not launched():
            raise DistributedError("no process group: run under torchrun (one process per GPU)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = data_parallel if data_parallel is not None else world // tensor_parallel
    if tensor_parallel * dp != world:
        raise DistributedError(f"tensor_parallel={tensor_parallel} x data_parallel={dp} needs {tensor_parallel * dp} "
                               f"processes; this launch has {world}")
    tp_group = dp_group = None
    for d in range(dp):  # every rank makes every group, in the same order
        ranks = [d * tensor_parallel + t for t in range(tensor_parallel)]
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s)) if tensor_parallel > 1 else None
        if rank in ranks:
            tp_group = group
    for t in range(tensor_parallel):
        ranks = [d * tensor_parallel + t for d in range(dp)]
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s)) if dp > 1 else None
        if rank in ranks:
            dp_group = group
    tensor = TensorParallel(Shard(rank % tensor_parallel, tensor_parallel), tp_group,
                            vocab_parallel=bool(vocab_parallel) and tensor_parallel > 1)
    if tp_group is not None and device.type == "cuda":
        tensor.peer, reason = peer_all_reduce_for(tp_group, device)
        tensor.all_reduce_path = reason if tensor.peer is not None else f"NCCL ({reason})"
    elif tp_group is not None:
        tensor.all_reduce_path = "gloo"
    return Parallel(tensor_parallel, dp, rank, device, tensor, dp_group)


__all__ = ["DEFAULT_TIMEOUT_S", "SMALL_GATHER_BYTES", "DistributedError", "Parallel", "PartialSum", "TensorParallel",
           "check_layout", "finish_launch", "init_parallel", "join_local_group", "launched"]
