"""KV cache stored once per tree node, in one flat pool of slots per layer.

``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads, head_dim]`` in the KV format's storage
dtype; an 8-bit format (:mod:`treegen.kernels.kv_quant`) adds ``k_scale[layer]`` and ``v_scale[layer]``,
``[num_slots, num_kv_heads]`` fp32. Each tree node owns one contiguous slot range (its *segment*), so
attention reads a node's keys as one block for every branch below it. A node's range is reserved with room to grow (a branch generating into it); when it must
grow past its range it moves, once, to a larger one. Nothing is ever copied per branch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from treegen.kernels.kv_quant import KVFormat, kv_format, quantize_reference


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


class KVStore:
    """A growable slot pool with best-fit allocation of per-node segments."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, initial_slots: int = 1024, fmt: KVFormat | None = None) -> None:
        """``dtype``: the model's dtype; ``fmt``: the KV format (None: the model's dtype, no scales)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.format = fmt or kv_format(None, dtype)
        self.dtype, self.device = self.format.storage, torch.device(device)
        self.k = self.v = self.k_scale = self.v_scale = None
        self._allocate_pool(initial_slots)
        self.segments: dict[int, Segment] = {}
        self._free: list[tuple[int, int]] = [(0, initial_slots)]  # (start, length), sorted by start
        self.allocations = self.compactions = 0  # counters: segments placed, pool compactions

    _POOLS = ("k", "v", "k_scale", "v_scale")  # the tensors indexed [layer, slot, ...] (scales: 8-bit only)

    def _pools(self) -> list[str]:
        return [name for name in self._POOLS if getattr(self, name) is not None]

    def _zeros(self, name: str, slots: int) -> torch.Tensor:
        if name in ("k", "v"):
            return torch.zeros((self.num_layers, slots, self.num_kv_heads, self.head_dim), dtype=self.dtype,
                               device=self.device)
        return torch.zeros((self.num_layers, slots, self.num_kv_heads), dtype=torch.float32, device=self.device)

    def _allocate_pool(self, slots: int) -> None:
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
        """``(k, v, k_scale, v_scale)`` of one layer (scales None for an unquantized format)."""
        return tuple(None if t is None else t[layer] for t in (self.k, self.v, self.k_scale, self.v_scale))

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
        """Tokens of ``node`` whose KV sparse window attention dropped (0: a dense segment)."""
        seg = self.segments.get(node)
        return seg.dropped if seg else 0

    def keep(self, node: int, kept: torch.Tensor) -> None:
        """Compact ``node``'s segment to the written slots ``kept`` (offsets in the segment, ascending,
        int64 on the KV's device): their KV (every layer, scales too) moves to the segment's first
        ``len(kept)`` slots in that order, the rest of its written KV is dropped and its slots are
        free for new tokens. One gather and one scatter per pool; the capacity is unchanged."""
        seg = self.segments[node]
        n = kept.numel()
        if n > seg.computed:
            raise ValueError(f"node {node}: keeping {n} of {seg.computed} written slots")
        src = kept.to(device=self.device, dtype=torch.int64) + seg.start
        dst = torch.arange(seg.start, seg.start + n, device=self.device)
        for pool in (getattr(self, name) for name in self._pools()):
            pool[:, dst] = pool[:, src]  # (the gather copies first: no overlap hazard; works for float8 too)
        seg.dropped += seg.computed - n
        seg.computed = n

    def written(self) -> bool:
        """Some node holds written KV (growing the pool then copies it)."""
        return any(s.computed for s in self.segments.values())

    def slots_free(self) -> int:
        return sum(n for _, n in self._free)

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
        """Make sure ``node`` owns at least ``length`` slots, moving its written KV if it must grow."""
        seg = self.segments.get(node)
        if seg is not None and seg.capacity >= length:
            return seg
        if seg is not None:  # the free span right after it, when long enough, lets it grow in place
            end = seg.start + seg.capacity
            i = bisect.bisect_left(self._free, (end, 0))
            if i < len(self._free) and self._free[i][0] == end and self._free[i][1] >= length - seg.capacity:
                taken = length - seg.capacity
                rest = self._free[i][1] - taken
                if rest:
                    self._free[i] = (end + taken, rest)
                else:
                    del self._free[i]
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
            self._release(seg.start, seg.capacity)
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
        free_slots = self.slots_free()
        if free_slots >= slots:
            return
        short = slots - free_slots  # the new span joins a free tail; freed spans inside the pool are reused
        copying = self.written()  # then the grown pool is a copy, made while the old one is still held
        extra = short
        if limit is not None:
            extra = max(short, min(max(self.num_slots, 0 if copying else want - free_slots), limit - self.num_slots))
        per = self.bytes_per_token
        copy = self.num_slots * per if copying else 0
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # cached
            if short * per + copy > free:
                raise MemoryError(f"the KV cache needs {(short * per + copy) / 2**30:.2f} GiB more for {short} token slots "
                                  f"({per} bytes each{', plus a copy of the pool it grows' if copying else ''}), "
                                  f"{free / 2**30:.2f} GiB is free on {self.device}")
            extra = max(short, min(extra, (free - copy) // per - 1024))  # leave the device some room
        self._grow(extra)

    def free(self, node: int) -> None:
        seg = self.segments.pop(node, None)
        if seg is not None:
            self._release(seg.start, seg.capacity)

    def _allocate(self, length: int) -> int:
        fits = [i for i, (_, free_len) in enumerate(self._free) if free_len >= length]
        if fits:  # best fit: the smallest span that holds it, so large spans stay whole for large nodes
            i = min(fits, key=lambda i: self._free[i][1])
            start, free_len = self._free[i]
            self._free[i] = (start + length, free_len - length)
            if self._free[i][1] == 0:
                del self._free[i]
            self.allocations += 1
            return start
        if sum(n for _, n in self._free) >= length:
            self._compact()  # enough room, but in pieces: close the holes rather than grow (no second pool)
        else:
            self._grow(length)
        return self._allocate(length)

    def _compact(self, chunk: int = 16384) -> None:
        """Move every segment down to close the free holes between them, in place (a copy of at most
        ``chunk`` slots at a time, never a second pool). Segment starts change: only call this while
        no attention plan built on the old starts is still in use (plans are made after reserving)."""
        self.compactions += 1
        pos = 0
        for seg in sorted(self.segments.values(), key=lambda seg: seg.start):
            if seg.start != pos:
                for begin in range(0, seg.computed, chunk):  # front to back: a chunk never overwrites its source
                    n = min(chunk, seg.computed - begin)
                    src, dst = slice(seg.start + begin, seg.start + begin + n), slice(pos + begin, pos + begin + n)
                    for pool in (getattr(self, name) for name in self._pools()):
                        pool[:, dst] = pool[:, src].clone()
                seg.start = pos
            pos += seg.capacity
        self._free = [(pos, self.num_slots - pos)] if pos < self.num_slots else []

    def _grow(self, length: int) -> None:
        old = self.num_slots
        new = old + length if self.device.type == "cuda" else max(2 * old, old + length)
        if not self.written():
            # nothing written yet: drop the old pool first instead of copying it (no transient 2x)
            self.k = self.v = self.k_scale = self.v_scale = None
            self._allocate_pool(new)
            self._release(old, new - old)
            return
        for name in self._pools():
            setattr(self, name, torch.cat([getattr(self, name), self._zeros(name, new - old)], dim=1))
        self._release(old, new - old)

    def _release(self, start: int, length: int) -> None:
        """Return a span to the free list (kept sorted, neighbours merged): O(log n) to find its place."""
        free = self._free
        i = bisect.bisect_left(free, (start, 0))
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # joins the span before it
            i -= 1
            start, length = free[i][0], free[i][1] + length
            del free[i]
        if i < len(free) and start + length == free[i][0]:  # and the span after it
            length += free[i][1]
            del free[i]
        free.insert(i, (start, length))
