"""KV cache stored once per tree node, in one flat pool of slots per layer.

``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads, head_dim]`` in the KV format's storage
dtype; an 8-bit format (:mod:`treegen.kernels.kv_quant`) adds ``k_scale[layer]`` and ``v_scale[layer]``,
``[num_slots, num_kv_heads]`` fp32. Each tree node owns one contiguous slot range (its *segment*), so
attention reads a node's keys as one block for every branch below it. A node's range is reserved with room to grow (a branch generating into it); when it must
grow past its range it moves, once, to a larger one. Nothing is ever copied per branch.

A node's KV can also leave the pool while no job reads it (see :mod:`treegen.runtime.offload`):
:meth:`KVStore.offload` copies its written KV (every pool, the 8-bit formats' scales included; the nodes
one admission evicts gathered together on the device, then one copy per node and pool) into a span of a :class:`~treegen.runtime.host_arena.HostArena` — pinned memory on CUDA, kept
across runs by the engine — and frees its slots; :meth:`KVStore.restore` gives it a segment again
and copies it back, on a side stream on CUDA, one event per group of layers (per layer when few nodes come
back: :func:`layer_groups`), so a forward pass's layer ``l`` waits only for its group's copies
(:meth:`KVStore.wait_layer`) and the rest overlaps its compute.
:meth:`KVStore.drop` frees a node's slots keeping nothing: its tokens are prefilled again when read.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from treegen.kernels.kv_quant import KVFormat, kv_format, quantize_reference
from treegen.kernels.row_paths import expand
from treegen.runtime.device_memory import device_free, expandable_segments, growth_on_device
from treegen.runtime.free_spans import FreeSpans
from treegen.runtime.host_arena import ALIGN, HostArena, HostSpan


class HostMemoryError(RuntimeError):
    """The host could not give (pin) memory for an offloaded node's KV; the nodes before it were offloaded."""


@dataclass
class Segment:
    """Slots ``[start, start + capacity)`` of one node; the first ``computed`` hold written KV.

    ``dropped``: tokens of the node whose KV sparse window attention dropped (:mod:`treegen.runtime.swa`;
    0 otherwise). Such a segment was *compacted*: its first slots hold the kept tokens' KV, in token
    order, and slot ``j`` past them holds token ``dropped + j``. ``tokens`` (= ``computed + dropped``)
    of the node's tokens are then accounted for; slot of a token written after the last compaction:
    ``start + index - dropped``. Attention plans give the segment the position ``node position +
    dropped``, so its written keys sit just before the next query (see ``TreeRun.plan_rows``)."""

    start: int
    capacity: int
    computed: int = 0
    dropped: int = 0

    @property
    def tokens(self) -> int:
        """The node's tokens accounted for: written (``computed`` slots) or dropped."""
        return self.computed + self.dropped


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


# the most a compaction's or offload's gather of one pool holds at once (see KVStore._compact, offload): they run
# between forward passes, within the activations' margin; on an H100, Llama-3-8B's compactions in batches of
# 64 MiB were ~3,800 batches of ~0.5 ms host time each in a tree-of-thought run short of memory
COMPACT_BYTES = 256 * 2**20
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


class KVStore:
    """A growable slot pool with best-fit allocation of per-node segments."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, initial_slots: int = 1024, fmt: KVFormat | None = None,
                 arena: HostArena | None = None) -> None:
        """``dtype``: the model's dtype; ``fmt``: the KV format (None: the model's dtype, no scales);
        ``arena``: where offloaded KV goes (None: an arena of this store's own, pinned on CUDA)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.format = fmt or kv_format(None, dtype)
        self.dtype, self.device = self.format.storage, torch.device(device)
        self.k = self.v = self.k_scale = self.v_scale = None
        self._layer_views: list[tuple] | None = None  # layer(i)'s tensors, made once per pool (see layer)
        # counts the pools this store has had: work captured against one pool (a CUDA graph holds its
        # addresses) is valid while this is unchanged
        self.pool_generation = 0
        self._allocate_pool(initial_slots)
        self.segments: dict[int, Segment] = {}
        self.free_spans = FreeSpans([(0, initial_slots)])  # the pool's free slots (best fit; neighbours merge)
        # counters: segments placed, pool compactions, written slots those moved
        self.allocations = self.compactions = self.slots_moved = 0
        self.offloaded: dict[int, HostCopy] = {}  # nodes whose KV is on the host
        self.to_recompute: dict[int, int] = {}  # nodes whose KV offload dropped → its tokens (prefilled again when read)
        self.host_bytes = 0  # KV bytes held on the host
        # slots ensure_free announced that reserve / restore have not placed yet: with the node that fits no
        # hole, the room a compaction makes (see _allocate)
        self.upcoming = 0
        self.arena = arena if arena is not None else HostArena(pinned=self.device.type == "cuda")
        self.counters = OffloadCounters()
        self._copy_stream = None  # CUDA: the side stream restores run on
        self._layer_ready: list | None = None  # CUDA: per layer, the event after the pending restores' copies

    _POOLS = ("k", "v", "k_scale", "v_scale")  # the tensors indexed [layer, slot, ...] (scales: 8-bit only)

    def _pools(self) -> list[str]:
        return [name for name in self._POOLS if getattr(self, name) is not None]

    def grow_copy_bytes(self) -> int:
        """What growing a written pool holds on top of the pools and the new slots: a copy of its largest
        tensor (keys, values or a scale pool; they are copied one at a time, each old one given back before
        the next is grown) — or of all of them under the allocator's expandable segments, which keep a freed
        tensor's pages in the middle of their segment (seen on an H200: the keys' old 21.5 GiB stayed
        reserved, unusable, while the values' grown 42.9 GiB did not fit)."""
        sizes = [getattr(self, n).numel() * getattr(self, n).element_size() for n in self._pools()]
        if not sizes:
            return 0
        return sum(sizes) if self.device.type == "cuda" and expandable_segments() else max(sizes)

    def _zeros(self, name: str, slots: int) -> torch.Tensor:
        if name in ("k", "v"):
            return torch.zeros((self.num_layers, slots, self.num_kv_heads, self.head_dim), dtype=self.dtype,
                               device=self.device)
        return torch.zeros((self.num_layers, slots, self.num_kv_heads), dtype=torch.float32, device=self.device)

    def _allocate_pool(self, slots: int) -> None:
        self._layer_views = None
        self.pool_generation += 1
        for name in ("k", "v", *(("k_scale", "v_scale") if self.format.quantized else ())):
            setattr(self, name, self._zeros(name, slots))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers: keys and values, plus their scales in an 8-bit format."""
        per_head = self.head_dim * self.format.bytes_per_value + self.format.scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def layer(self, layer: int) -> tuple:
        """``(k, v, k_scale, v_scale)`` of one layer (scales None for an unquantized format). The views are
        made once per pool (a decode step asks for every layer's twice; indexing costs host time) and
        dropped whenever the pool is replaced."""
        if self._layer_views is None:
            pools = (self.k, self.v, self.k_scale, self.v_scale)
            self._layer_views = [tuple(None if t is None else t[i] for t in pools) for i in range(self.num_layers)]
        return self._layer_views[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values ``[T, kv_heads, head_dim]`` (model dtype) at ``slots [T]``, quantizing
        them for an 8-bit format (the PyTorch path; on CUDA the fused RoPE kernel writes them itself)."""
        if not self.format.quantized:
            self.k[layer].index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.dtype))
            return
        for x, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            stored, scale = quantize_reference(x, self.format)
            cache[layer][slots] = stored  # (index_copy_ has no float8 kernel on the CPU)
            scales[layer].index_copy_(0, slots, scale)

    def computed(self, node: int) -> int:
        """Tokens of ``node`` whose KV was computed (held, or dropped by sparse window attention)."""
        seg = self.segments.get(node)
        return seg.tokens if seg else 0

    def dropped(self, node: int) -> int:
        """Tokens of ``node`` whose KV sparse window attention dropped (0: a dense segment), on the
        device or offloaded."""
        held = self.segments.get(node) or self.offloaded.get(node)
        return held.dropped if held else 0

    def keep(self, node: int, kept: torch.Tensor) -> None:
        """Compact ``node``'s segment to the written slots ``kept`` (offsets in the segment, ascending,
        int64 on the KV's device): their KV (every layer, scales too) moves to the segment's first
        ``len(kept)`` slots in that order, the rest of its written KV is dropped and its slots are
        free for new tokens. The capacity is unchanged.
        ``kept [layers, kv_heads, m]``: each layer and KV head keeps its own ``m`` slots (slot ``i`` of
        layer ``l``, head ``h`` then holds the token at offset ``kept[l, h, i]``) — the attention reads a
        compacted segment's keys as one set, all before its rows' queries, so which token a slot holds
        may differ between layers and heads."""
        self.keep_many({node: kept})

    def keep_many(self, kept: dict[int, torch.Tensor]) -> None:
        """:meth:`keep` of several nodes at once (one gather and one scatter per pool for all of them);
        every node's ``kept`` is ``[m]`` or every one is ``[layers, kv_heads, m]``."""
        if not kept:
            return
        per_head = None
        src, dst = [], []
        for node, rows in kept.items():
            seg = self.segments[node]
            n = rows.shape[-1]
            if rows.dim() not in (1, 3) or rows.dim() == 3 and tuple(rows.shape[:2]) != (self.num_layers, self.num_kv_heads):
                raise ValueError(f"node {node}: kept must be [m] or [{self.num_layers}, {self.num_kv_heads}, m], got "
                                 f"{tuple(rows.shape)}")
            if per_head is not None and per_head != (rows.dim() == 3):
                raise ValueError(f"node {node}: kept sets of one call must all be [m] or all per layer and head")
            per_head = rows.dim() == 3
            if n > seg.computed:
                raise ValueError(f"node {node}: keeping {n} of {seg.computed} written slots")
            src.append(rows.to(device=self.device, dtype=torch.int64) + seg.start)
            dst.append(torch.arange(seg.start, seg.start + n, device=self.device))
        src, dst = torch.cat(src, dim=-1), torch.cat(dst)
        if per_head:  # per layer and head: [layers, m, kv_heads] advanced indices
            layer = torch.arange(self.num_layers, device=self.device)[:, None, None]
            head = torch.arange(self.num_kv_heads, device=self.device)[None, None, :]
            src = src.transpose(1, 2)
        for pool in (getattr(self, name) for name in self._pools()):
            # (the gather copies first: no overlap hazard, segments never overlap; advanced indexing works
            # for float8 too)
            pool[:, dst] = pool[layer, src, head] if per_head else pool[:, src]
        for node, rows in kept.items():
            seg = self.segments[node]
            seg.dropped += seg.computed - rows.shape[-1]
            seg.computed = rows.shape[-1]

    def written(self) -> bool:
        """Some node holds written KV (growing the pool then copies it)."""
        return any(s.computed for s in self.segments.values())

    def slots_free(self) -> int:
        return self.free_spans.total

    def bytes_held(self) -> int:
        """Bytes of KV actually written, summed over nodes (each shared node counted once)."""
        return sum(s.computed for s in self.segments.values()) * self.bytes_per_token

    def slots_reserved(self) -> int:
        """Slots owned by nodes (written or reserved for generation)."""
        return sum(s.capacity for s in self.segments.values())

    def bytes_reserved(self) -> int:
        """Bytes of the slot ranges owned by nodes (written or reserved for generation)."""
        return self.slots_reserved() * self.bytes_per_token

    def reserve(self, node: int, length: int) -> Segment:
        """Make sure ``node`` owns at least ``length`` (> 0) slots, moving its written KV if it must grow."""
        if length < 1:  # (an empty range has no start to read from; the scheduler gives an empty node one slot)
            raise ValueError(f"KVStore.reserve(node {node}) needs a positive length, got {length}")
        seg = self.segments.get(node)
        if seg is not None and seg.capacity >= length:
            return seg
        if seg is None and node in self.offloaded:
            raise RuntimeError(f"node {node}'s KV is on the host: restore() it before reading it (a scheduling bug)")
        if seg is None and node in self.to_recompute:  # its tokens will be prefilled again
            self.counters.nodes_recomputed += 1
            self.counters.tokens_recomputed += self.to_recompute.pop(node)
        self.wait_restores()  # a move or compaction below must come after pending restore copies
        if seg is not None:  # the free span right after it, when long enough, lets it grow in place
            if self.free_spans.extend(seg.start + seg.capacity, length - seg.capacity):
                seg.capacity = length
                return seg
        start = self._allocate(length)
        new = Segment(start, length, 0)
        if seg is not None:
            if seg.computed:
                src, dst = slice(seg.start, seg.start + seg.computed), slice(start, start + seg.computed)
                for pool in (getattr(self, name) for name in self._pools()):
                    pool[:, dst] = pool[:, src]
            new.computed, new.dropped = seg.computed, seg.dropped
            self.free_spans.release(seg.start, seg.capacity)
        self.segments[node] = new
        return new

    def ensure_free(self, slots: int, limit: int | None = None, want: int = 0) -> None:
        """Grow the pool once, if needed, so that ``slots`` more slots are free (freed spans reused).

        ``limit``: the most slots the pool may hold (the KV budget); when given, the pool grows
        geometrically (to twice its size, or to ``want`` free slots while nothing is written and
        growing copies nothing, within the limit and the device's free memory) so that a run
        admitting work little by little copies its pool a logarithmic number of times, not once per
        admission. Checks device memory first: raises MemoryError naming the bytes needed and
        available."""
        self.upcoming = slots
        free_slots = self.slots_free()
        if free_slots >= slots:
            return
        short = slots - free_slots  # the new span joins a free tail; freed spans inside the pool are reused
        copying = self.written()  # then the grown pool is a copy, made while the old one is still held
        extra = short
        if limit is not None:
            extra = max(short, min(max(self.num_slots, 0 if copying else want - free_slots), limit - self.num_slots))
        copy = self.grow_copy_bytes() if copying else 0  # _grow copies one pool at a time
        if self.device.type == "cuda":
            free, total = device_free(self.device)
            extra = growth_on_device(short, extra, per_token=self.bytes_per_token, copy=copy, free=free,
                                     device_total=total, where=str(self.device))
        self._grow(extra)

    def can_split(self, node: int, length: int) -> bool:
        """Whether :meth:`split` can divide ``node``'s KV after ``length`` tokens: it is wholly on the device (or
        has none), dense (sparse window attention's compacted slots are not in token order), and its segment
        holds slots past ``length`` (a node extended past its range has tokens without slots)."""
        seg = self.segments.get(node)
        if node in self.offloaded or node in self.to_recompute:
            return False
        return seg is None or not seg.dropped and 0 < length < seg.capacity

    def split(self, node: int, head: int, length: int) -> None:
        """The tree put ``head`` above ``node`` with ``node``'s first ``length`` tokens
        (:meth:`SharingTree.split <treegen.tree.sharing_tree.SharingTree.split>`): the first ``length``
        slots of ``node``'s segment become ``head``'s, nothing is copied (a segment's slots hold its
        tokens in order)."""
        if not self.can_split(node, length):
            raise RuntimeError(f"node {node}'s KV cannot be split after {length} tokens (on the host, dropped, sparse, "
                               f"or no slots there): see can_split")
        if head in self.segments or head in self.offloaded:
            raise RuntimeError(f"node {head} already holds KV; split needs a new node")
        seg = self.segments.get(node)
        if seg is None:
            return
        self.segments[head] = Segment(seg.start, length, min(seg.computed, length))
        seg.start, seg.capacity, seg.computed = seg.start + length, seg.capacity - length, max(0, seg.computed - length)

    def free(self, node: int) -> None:
        seg = self.segments.pop(node, None)
        if seg is not None:
            self.free_spans.release(seg.start, seg.capacity)
        host = self.offloaded.pop(node, None)
        if host is not None:  # (a pending copy into the span is on the current stream, before any later one)
            self.host_bytes -= host.computed * self.bytes_per_token
            self.arena.give(host.span)
        self.to_recompute.pop(node, None)

    def release(self) -> None:
        """Give the pools' memory back now, every node freed (a finished run: its results, which hold the
        run, may live on — a run of Llama-3-8B holds ~55 GB of pool); the store has no slots afterwards
        (a later reservation grows it again)."""
        if self.segments or self.offloaded:
            raise RuntimeError(f"release() frees the pools of an empty store; {len(self.segments)} nodes still hold "
                               f"slots and {len(self.offloaded)} host copies")
        self.wait_restores()
        for name in self._pools():  # (whoever still holds a view of it: see _grow)
            getattr(self, name).untyped_storage().resize_(0)
        self._allocate_pool(0)
        self.free_spans.reset([])
        self.to_recompute.clear()

    # offload / restore / drop ---------------------------------------------------------------------
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
        pools = {name: _as_rows(getattr(self, name)) for name in self._pools()}
        batch_limit = self._slots_in(COMPACT_BYTES)
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

    def _host_copy(self, node: int, seg: Segment) -> HostCopy:
        """A span of the host arena for ``node``'s written KV, with every pool's view of it."""
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
            start = self._allocate(max(length, host.computed, 1))  # (may compact: moves placed segments too)
            del self.offloaded[node]
            self.segments[node] = Segment(start, max(length, host.computed, 1), host.computed, host.dropped)
            placed.append((self.segments[node], host))
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

    def _allocate(self, length: int) -> int:
        start = self.free_spans.best_fit(length)
        if start is not None:
            self.allocations += 1
            self.upcoming = max(0, self.upcoming - length)
            return start
        if self.free_spans.total >= length:
            # enough room, but in pieces: close holes rather than grow (no second pool), as many as give
            # one span for this node and the rest of what ensure_free announced (one compaction a pass)
            self._compact(room=max(length, min(self.upcoming, self.free_spans.total)))
        else:
            self._grow(length)
        return self._allocate(length)

    def _compact(self, chunk: int | None = None, room: int | None = None) -> None:
        """Close free holes by moving segments down, in place: every hole (``room`` None), or those of the
        cheapest run of the pool — from a free span to a free span, the fewest written slots between
        them — whose free spans add up to ``room`` slots (short of memory, a pass needs a few nodes' room,
        not every hole closed: the segments below and above that run stay). The moved segments keep their
        order; the run's free slots end as one span at its end.

        The written slots that move are gathered and scattered in index batches of at most ``chunk`` slots
        (one gather and one scatter per pool and batch, not per segment: a pool of thousands of small
        nodes compacted segment by segment cost thousands of copy launches; default: as many as make a
        gather of ``COMPACT_BYTES``). The batches' indices reach the device without waiting for it.
        Batches run front to back and every slot moves down, so a batch's sources lie at or above its
        destinations and above every earlier batch's: no batch overwrites a slot a later one reads.
        Segment starts change: only call this while no attention plan built on the old starts is still in
        use (plans are made after reserving). ``slots_moved`` counts the written slots moved."""
        spans = self.free_spans.by_start
        if not spans:
            return
        self.wait_restores()
        self.compactions += 1
        segs = sorted(self.segments.values(), key=lambda seg: seg.start)
        if room is None or room > self.free_spans.total:
            first, last = 0, len(spans) - 1  # every hole, the free slots after the last segment included
        else:
            first, last = _cheapest_run(spans, segs, room)
        begin, end = spans[first][0], spans[last][0] + spans[last][1]
        pos = begin
        src_starts, dst_starts, counts = [], [], []
        for seg in segs[bisect.bisect_left(segs, begin, key=lambda seg: seg.start):]:
            if seg.start >= end:
                break
            if seg.computed:
                src_starts.append(seg.start)
                dst_starts.append(pos)
                counts.append(seg.computed)
            seg.start = pos
            pos += seg.capacity
        self._move_slots(src_starts, dst_starts, counts, chunk)
        self.free_spans.reset([*spans[:first], (pos, end - pos), *spans[last + 1:]])

    def _move_slots(self, src_starts: list[int], dst_starts: list[int], counts: list[int], chunk: int | None) -> None:
        """Copy ``counts[i]`` slots from ``src_starts[i]`` to ``dst_starts[i]`` in every pool, in index
        batches of at most ``chunk`` slots, each batch gathered before it is scattered. Each pool is moved
        as rows of the widest integer type its slot's bytes divide into (fewer elements to index)."""
        if not counts:
            return
        if chunk is None:
            chunk = max(256, self._slots_in(COMPACT_BYTES))
        which, offsets = expand(counts)  # each moved slot's segment and its offset in it
        src = np.asarray(src_starts, dtype=np.int64)[which] + offsets
        dst = np.asarray(dst_starts, dtype=np.int64)[which] + offsets
        self.slots_moved += len(src)
        rows = [_as_rows(getattr(self, name)) for name in self._pools()]
        for begin in range(0, len(src), chunk):
            s, d = self._indices_to_device(np.stack([src[begin:begin + chunk], dst[begin:begin + chunk]]))
            for pool in rows:
                pool[:, d] = pool[:, s]  # (the gather copies first)

    def _slots_in(self, nbytes: int) -> int:
        """How many slots of the largest pool (keys, values or a scale pool) make ``nbytes`` (at least 1):
        a gather's batch."""
        per_slot = max(getattr(self, n)[:, 0].numel() * getattr(self, n).element_size() for n in self._pools())
        return max(1, nbytes // per_slot)

    def _indices_to_device(self, index: np.ndarray) -> torch.Tensor:
        """Slot indices on the store's device without waiting for it: from pinned memory on CUDA (a copy from
        pageable memory would wait for everything queued before it)."""
        index = torch.from_numpy(index)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _grow(self, length: int) -> None:
        self.wait_restores()
        old = self.num_slots
        new = old + length if self.device.type == "cuda" else max(2 * old, old + length)
        if not self.written():
            # nothing written yet: drop the old pool first instead of copying it (no transient 2x)
            for name in self._pools():
                getattr(self, name).untyped_storage().resize_(0)  # (its memory, whoever holds it: see below)
            self.k = self.v = self.k_scale = self.v_scale = self._layer_views = None
            self._give_back_cache()
            self._allocate_pool(new)
            self.free_spans.release(old, new - old)
            return
        self._layer_views = None
        self.pool_generation += 1
        # One pool at a time is copied into a grown tensor and the old one dropped: the memory held on top of
        # the old pools peaks at the new slots plus one old pool, within what ensure_free checks (the new
        # slots plus a copy of the largest pool). (torch.cat with a zero tail also held that tail: growing the
        # pool of an 8B model at 256 branches ran out of memory.)
        for name in self._pools():
            pool = getattr(self, name)
            grown = pool.new_empty((pool.shape[0], new, *pool.shape[2:]))
            grown[:, :old].copy_(pool)
            grown[:, old:].zero_()
            setattr(self, name, grown)
            # free the old pool's memory now, whoever still holds the tensor: a kept phase's plan does, through
            # the TMA descriptors of its layer views (tree_attention_triton's PassPlan.descriptors), until the
            # next phase is kept (seen on an H100: both old pools of a 64 x 4,096 run stayed allocated, the
            # second copy ran out of memory); all of that is stale now (kept graphs are keyed by pool_generation)
            pool.untyped_storage().resize_(0)
            del pool, grown
            # its memory back to the device before the next grown pool is allocated: a block smaller than that
            # pool, no use to it in the allocator's cache (seen on an H200 under expandable segments: the
            # values' grown pool, 38.9 GiB, found 20.2 GiB free beside 32.6 GiB cached and unused)
            self._give_back_cache()
        self.free_spans.release(old, new - old)

    def _give_back_cache(self) -> None:
        """Hand a dropped pool's memory back to the device (CUDA), before smaller allocations are carved
        from it: segments partly reused stay with the allocator, where no later, larger pool can use them."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _as_rows(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` (``[layers, slots, ...]``, contiguous) as ``[layers, slots, words]`` of the widest integer
    type that a slot's bytes divide into: the same memory, moved without regard to its dtype."""
    nbytes = pool[0, 0].numel() * pool.element_size()
    word = next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % t.itemsize == 0)
    return pool.view(pool.shape[0], pool.shape[1], -1).view(word)


def _cheapest_run(spans: list[tuple[int, int]], segs: list[Segment], room: int) -> tuple[int, int]:
    """The free spans ``first..last`` (indices into ``spans``, sorted by start) that add up to at least
    ``room`` slots with the fewest written slots of ``segs`` (sorted by start) between them."""
    # written slots of the segments before each free span (prefix sums over the pool's order)
    before, j, written = [], 0, 0
    for start, _ in spans:
        while j < len(segs) and segs[j].start < start:
            written += segs[j].computed
            j += 1
        before.append(written)
    best, first, free = None, 0, 0
    for last, (_, length) in enumerate(spans):  # two pointers: the shortest run ending at each span
        free += length
        while free - spans[first][1] >= room:
            free -= spans[first][1]
            first += 1
        if free >= room and (best is None or before[last] - before[first] < best[0]):
            best = (before[last] - before[first], first, last)
    return best[1], best[2]
