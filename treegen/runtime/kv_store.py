"""KV cache stored once per tree node, in one flat pool of slots per layer.

``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads, head_dim]``; each tree node owns one
contiguous slot range (its *segment*), so attention reads a node's keys as one block for every branch
below it. A node's range is reserved with room to grow (a branch generating into it); when it must
grow past its range it moves, once, to a larger one. Nothing is ever copied per branch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """Slots ``[start, start + capacity)`` of one node; the first ``computed`` hold written KV."""

    start: int
    capacity: int
    computed: int = 0


class KVStore:
    """A growable slot pool with first-fit allocation of per-node segments."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, initial_slots: int = 1024) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, initial_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.segments: dict[int, Segment] = {}
        self._free: list[tuple[int, int]] = [(0, initial_slots)]  # (start, length), sorted by start
        self.allocations = self.compactions = 0  # counters: segments placed, pool compactions

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    def computed(self, node: int) -> int:
        seg = self.segments.get(node)
        return seg.computed if seg else 0

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
                self.k[:, dst] = self.k[:, src]
                self.v[:, dst] = self.v[:, src]
            new.computed = seg.computed
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
                    self.k[:, dst] = self.k[:, src].clone()
                    self.v[:, dst] = self.v[:, src].clone()
                seg.start = pos
            pos += seg.capacity
        self._free = [(pos, self.num_slots - pos)] if pos < self.num_slots else []

    def _grow(self, length: int) -> None:
        old = self.num_slots
        new = old + length if self.device.type == "cuda" else max(2 * old, old + length)
        if not self.written():
            # nothing written yet: drop the old pool first instead of copying it (no transient 2x)
            shape = (self.num_layers, new, self.num_kv_heads, self.head_dim)
            self.k = self.v = None
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._release(old, new - old)
            return
        extra = (self.num_layers, new - old, self.num_kv_heads, self.head_dim)
        self.k = torch.cat([self.k, torch.zeros(extra, dtype=self.dtype, device=self.device)], dim=1)
        self.v = torch.cat([self.v, torch.zeros(extra, dtype=self.dtype, device=self.device)], dim=1)
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
