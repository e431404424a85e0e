"""KV cache stored once per tree node, in one flat pool of slots per layer.

``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads, head_dim]`` in the KV format's storage
dtype; an 8-bit format (:mod:`treegen.kernels.kv_quant`) adds ``k_scale[layer]`` and ``v_scale[layer]``,
``[num_slots, num_kv_heads]`` fp32. Each tree node owns one contiguous slot range (its *segment*), so
attention reads a node's keys as one block for every branch below it. A node's range is reserved with room to grow (a branch generating into it); when it must
grow past its range it moves, once, to a larger one. Nothing is ever copied per branch.

A node's KV can also leave the pool while no job reads it — copied to the host and back, or dropped to be
prefilled again: :mod:`treegen.runtime.kv_host` (:class:`~treegen.runtime.kv_host.HostTransfers`, a base of
the store).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from treegen.kernels.kv_quant import KVFormat, kv_format, quantize_reference
from treegen.kernels.row_paths import expand
from treegen.runtime.device_memory import device_free, expandable_segments, growth_on_device
from treegen.runtime.free_spans import FreeSpans
from treegen.runtime.host_arena import HostArena
from treegen.runtime.kv_host import HostCopy, HostTransfers, OffloadCounters


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


# the most a compaction's or offload's gather of one pool holds at once (see KVStore._compact, offload): they run
# between forward passes, within the activations' margin; on an H100, Llama-3-8B's compactions in batches of
# 64 MiB were ~3,800 batches of ~0.5 ms host time each in a tree-of-thought run short of memory
COMPACT_BYTES = 256 * 2**20


class KVStore(HostTransfers):
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
        new = self._place(node, length, *((seg.computed, seg.dropped) if seg is not None else ()))
        if seg is not None:
            if seg.computed:
                src, dst = slice(seg.start, seg.start + seg.computed), slice(new.start, new.start + seg.computed)
                for pool in (getattr(self, name) for name in self._pools()):
                    pool[:, dst] = pool[:, src]
            self.free_spans.release(seg.start, seg.capacity)
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

    def _place(self, node: int, length: int, computed: int = 0, dropped: int = 0) -> Segment:
        """A new segment of ``length`` slots for ``node`` (placing it may compact: other segments move), holding
        ``computed`` written slots and ``dropped`` tokens (a restored node's)."""
        seg = self.segments[node] = Segment(self._allocate(length), length, computed, dropped)
        return seg

    def _pool_rows(self) -> dict[str, torch.Tensor]:
        """Each pool as rows of whole slots of the widest integer type (:func:`_as_rows`): what moves copy."""
        return {name: _as_rows(getattr(self, name)) for name in self._pools()}

    def _gather_slots(self) -> int:
        """Slots a compaction's or offload's gather of one pool takes at once (``COMPACT_BYTES`` of it)."""
        return self._slots_in(COMPACT_BYTES)

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
            chunk = max(256, self._gather_slots())
        which, offsets = expand(counts)  # each moved slot's segment and its offset in it
        src = np.asarray(src_starts, dtype=np.int64)[which] + offsets
        dst = np.asarray(dst_starts, dtype=np.int64)[which] + offsets
        self.slots_moved += len(src)
        rows = list(self._pool_rows().values())
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
