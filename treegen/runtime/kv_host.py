"""KV that leaves the device and comes back: a node's written KV copied to the host and back, or dropped to be
prefilled again — the part of :class:`~treegen.runtime.kv_store.KVStore` that moves KV between the pool and
the host (:class:`HostTransfers`, a base of the store; :mod:`treegen.runtime.offload` decides what moves).

:meth:`HostTransfers.offload` copies a node's written KV (every pool, the 8-bit formats' scales included; the
nodes one admission evicts gathered together on the device, then one copy per node and pool) into a span of a
:class:`~treegen.runtime.host_arena.HostArena` — pinned memory on CUDA, kept across runs by the engine — and
frees its slots; :meth:`HostTransfers.restore` gives it a segment again and copies it back, on a side stream on
CUDA, one event per group of layers (per layer when few nodes come back: :func:`layer_groups`), so a forward
pass's layer ``l`` waits only for its group's copies (:meth:`HostTransfers.wait_layer`) and the rest overlaps
its compute. :meth:`HostTransfers.drop` frees a node's slots keeping nothing: its tokens are prefilled again
when read.

The store's own parts it uses: ``segments``, ``free_spans``, ``offloaded``, ``to_recompute``, ``host_bytes``,
``arena``, ``counters``, the pools (``_pools``, ``_pool_rows``, ``_gather_slots``), ``_place`` (a new segment) and
``_indices_to_device``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from treegen.runtime.host_arena import ALIGN, HostSpan


class HostMemoryError(RuntimeError):
    """The host could not give (pin) memory for an offloaded node's KV; the nodes before it were offloaded."""


@dataclass
class HostCopy:
    """The written KV of an offloaded node: pool name → ``[num_layers, computed, ...]`` on the host,
    views of one ``span`` of the store's arena."""

    computed: int
    tensors: dict[str, torch.Tensor]
    span: HostSpan
    dropped: int = 0  # tokens before them whose KV sparse window attention dropped (Segment.dropped)


@dataclass
class OffloadCounters:
    """What left the pool and came back during one run (see :mod:`treegen.runtime.offload`).
    ``host_seconds``: host time spent issuing the copies; ``copy_seconds``: their device time (CUDA
    events; the host copies' own time on the CPU)."""

    bytes_offloaded: int = 0
    bytes_restored: int = 0
    nodes_offloaded: int = 0
    nodes_restored: int = 0
    nodes_dropped: int = 0
    tokens_dropped: int = 0
    nodes_recomputed: int = 0
    tokens_recomputed: int = 0
    host_bytes_peak: int = 0
    host_seconds: float = 0.0
    copy_seconds: float = 0.0
    pin_seconds: float = 0.0
    arena_bytes: int = 0
    _events: list = field(default_factory=list, repr=False)  # (start, end) CUDA events of copies not yet summed

    def as_dict(self) -> dict:
        for start, end in self._events:
            end.synchronize()
            self.copy_seconds += start.elapsed_time(end) / 1e3
        self._events.clear()
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


# a restore's copies: about this many at most (layers are copied in groups, one event a group, fewer groups
# the more nodes come back; see layer_groups)
RESTORE_COPIES = 512


def layer_groups(num_layers: int, copies_per_layer: int) -> list[tuple[int, int]]:
    """The ``[first, last)`` layer ranges a restore copies, one event after each: a forward pass's layer
    waits only for its group's copies. Per layer while the copies stay few (a few nodes back); as more
    nodes come back, fewer groups, so that the copies issued stay about ``RESTORE_COPIES`` — on an H100
    host, Llama-3-8B's restore of 207 nodes layer by layer was 13,248 copies, 0.29 s of host time while the GPU
    waited. (A group of several layers is a strided copy on the device: a staging copy and a kernel.)"""
    groups = max(1, min(num_layers, RESTORE_COPIES // max(1, copies_per_layer)))
    bounds = [round(i * num_layers / groups) for i in range(groups + 1)]
    return list(zip(bounds, bounds[1:]))


class HostTransfers:
    """Moving nodes' KV between the store's pool and the host (see module doc); a base of
    :class:`~treegen.runtime.kv_store.KVStore`."""

    def offload(self, nodes: int | list[int]) -> int:
        """Copy the written KV of ``nodes`` (one node or a list) into spans of the host arena and free
        their slots; on CUDA ordered on the current stream after the steps that wrote it. Per pool, the
        nodes' KV is gathered on the device into one buffer (in batches of at most ``COMPACT_BYTES``),
        each node's range of every layer laid out as its host copy is, then copied to the host with one
        copy per node — not a strided copy (a temporary, a kernel and a transfer) per node and pool.
        Returns the bytes moved."""
        nodes = [nodes] if isinstance(nodes, int) else list(nodes)
        if not nodes:
            return 0
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        events = self._events() if cuda else None
        pools = self._pool_rows()
        batch_limit = self._gather_slots()
        batch, batch_slots, done = [], 0, []
        try:
            for node in nodes:
                seg = self.segments[node]
                batch.append((node, seg, self._host_copy(node, seg)))
                batch_slots += seg.computed
                if batch_slots >= batch_limit:
                    self._copy_out(batch, pools, cuda)
                    done += batch
                    batch, batch_slots = [], 0
        finally:  # (when the host has no room for a node, those before it are offloaded all the same)
            self._copy_out(batch, pools, cuda)
            done += batch
            self._end_copy(events, started)
            moved = 0
            for node, seg, _ in done:
                del self.segments[node]
                self.free_spans.release(seg.start, seg.capacity)
                moved += seg.computed * self.bytes_per_token
            n = self.counters
            self.host_bytes += moved
            n.bytes_offloaded += moved
            n.nodes_offloaded += len(done)
            n.host_bytes_peak = max(n.host_bytes_peak, self.host_bytes)
            n.arena_bytes = self.arena.chunk_bytes
            n.host_seconds += time.perf_counter() - started
        return moved

    def _host_copy(self, node: int, seg) -> HostCopy:
        """A span of the host arena for ``node``'s written KV (its segment ``seg``), with every pool's view of it."""
        c = seg.computed
        shapes, offsets, total = {}, {}, 0
        for name in self._pools():
            pool = getattr(self, name)
            shapes[name] = (pool.shape[0], c, *pool.shape[2:])
            offsets[name] = total
            total += -(-torch.Size(shapes[name]).numel() * pool.element_size() // ALIGN) * ALIGN
        grown = self.arena.grow_seconds
        try:
            span = self.arena.take(max(total, 1))
        except RuntimeError as e:
            raise HostMemoryError(f"offloading node {node}'s KV ({c * self.bytes_per_token / 2**20:.1f} MiB) needs host "
                               f"memory: {e}; run with Engine(offload='recompute') or offload='off', or lower "
                               "offload_bytes") from e
        self.counters.pin_seconds += self.arena.grow_seconds - grown
        tensors = {name: self.arena.view(span, offsets[name], getattr(self, name).dtype, shapes[name])
                   for name in self._pools()}
        host = HostCopy(c, tensors, span, seg.dropped)
        self.offloaded[node] = host
        return host

    def _copy_out(self, batch: list, pools: dict[str, torch.Tensor], cuda: bool) -> None:
        """One batch of :meth:`offload`: per pool, one gather of the nodes' written slots of every layer
        (node by node, layer by layer: each node's part is its host copy's layout), then one copy per node."""
        batch = [(node, seg, host) for node, seg, host in batch if seg.computed]
        if not batch:
            return
        num_slots = self.num_slots
        layer_base = np.arange(self.num_layers, dtype=np.int64)[:, None] * num_slots
        index = np.concatenate([(layer_base + np.arange(seg.start, seg.start + seg.computed)).ravel()
                                for _, seg, _ in batch])
        index = self._indices_to_device(index)
        for name, rows in pools.items():
            gathered = rows.view(-1, rows.shape[-1]).index_select(0, index)
            at = 0
            for _, seg, host in batch:
                n = self.num_layers * seg.computed
                host.tensors[name].view(n, -1).view(rows.dtype).copy_(gathered[at : at + n], non_blocking=cuda)
                at += n

    def drop(self, node: int) -> int:
        """Free ``node``'s slots keeping nothing; its tokens are prefilled again when a job reads it.
        Returns the tokens of KV dropped."""
        seg = self.segments[node]
        if seg.dropped:
            raise RuntimeError(f"node {node}'s KV was compacted by sparse window attention; a prefill cannot make it "
                               "again (offload it to the host instead)")
        del self.segments[node]
        self.free_spans.release(seg.start, seg.capacity)
        self.to_recompute[node] = seg.computed
        self.counters.nodes_dropped += 1
        self.counters.tokens_dropped += seg.computed
        return seg.computed

    def restore(self, lengths: dict[int, int]) -> int:
        """Give each offloaded node (``node → slots``, at least its written tokens) a segment again
        and copy its KV back. On CUDA the copies run on a side stream after everything already queued
        on the current one, and a forward pass waits per group of layers (:meth:`wait_layer`, :func:`layer_groups`); call this after
        the step's other reservations (a later move or compaction first waits for these copies).
        Returns the bytes copied."""
        started = time.perf_counter()
        placed = []
        for node, length in sorted(lengths.items(), key=lambda x: -x[1]):  # longest first: the holes fit the most
            host = self.offloaded[node]
            seg = self._place(node, max(length, host.computed, 1), host.computed, host.dropped)  # (may compact)
            del self.offloaded[node]
            placed.append((seg, host))
        if not placed:
            return 0
        cuda = self.device.type == "cuda"
        if cuda:
            self.wait_restores()
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            side = self._copy_stream
            side.wait_stream(torch.cuda.current_stream(self.device))  # after the offloads and moves queued there
            ready = []
            with torch.cuda.stream(side):
                events = self._events()
                for first, last in layer_groups(self.num_layers, len(placed) * len(self._pools())):
                    for seg, host in placed:
                        for name, t in host.tensors.items():
                            getattr(self, name)[first:last, seg.start : seg.start + host.computed].copy_(
                                t[first:last], non_blocking=True)
                    ready += [torch.cuda.Event()] * (last - first)
                    ready[-1].record(side)
                self._end_copy(events, started)
            self._layer_ready = ready
            for _, host in placed:  # reused for another node once the copies reading it have run
                self.arena.give(host.span, after=ready[-1])
        else:
            for seg, host in placed:
                for name, t in host.tensors.items():
                    getattr(self, name)[:, seg.start : seg.start + host.computed] = t
                self.arena.give(host.span)
            self._end_copy(None, started)
        nbytes = sum(host.computed for _, host in placed) * self.bytes_per_token
        self.host_bytes -= nbytes
        self.counters.bytes_restored += nbytes
        self.counters.nodes_restored += len(placed)
        self.counters.host_seconds += time.perf_counter() - started
        return nbytes

    def wait_layer(self, layer: int) -> None:
        """The current stream waits for the pending restores' copies of ``layer`` (CUDA; else nothing)."""
        if self._layer_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._layer_ready[layer])

    def wait_restores(self) -> None:
        """The current stream waits for every pending restore copy; none is pending afterwards."""
        if self._layer_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._layer_ready[-1])
            self._layer_ready = None

    def _events(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _end_copy(self, events, started: float) -> None:
        if events is None:
            self.counters.copy_seconds += time.perf_counter() - started
        else:
            events[1].record()
            self.counters._events.append(events)
