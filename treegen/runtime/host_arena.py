"""Host memory for offloaded KV, kept for an engine's lifetime: pinned chunks carved into spans.

Pinning host memory is slow: on an H100 host (``benchmarks/probe_offload_host.py``), 0.3-0.7 ms a MiB,
about 22 ms for one 130-token node of Llama-3-8B's KV (16 MiB), against ~1 ms to issue its copies, and
a thread pinning in the background stalls the CUDA calls of the one driving the GPU. PyTorch's caching
pinned allocator rounds every request up to a power of two and reuses a freed block only for requests
of the same rounded size, so a run whose node sizes vary kept pinning fresh memory: Llama-3-8B's
tree-of-thought at 1,024 branches, short of KV memory, spent 35 s of its 90 s in offload host work.

:class:`HostArena` pins memory in large chunks (growing geometrically, ``MIN_CHUNK`` to ``MAX_CHUNK``
bytes), never gives a chunk back while it lives, and hands out exact-size spans (best fit; neighbours
merge when freed). A span a pending device copy still reads (a restore's host-to-device copies run on a
side stream) comes back with the event after those copies and is reused only once it has passed. The
engine keeps one arena across its runs, so only the memory its largest offload needs is ever pinned,
once.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

MIN_CHUNK = 64 * 2**20
MAX_CHUNK = 2**30
ALIGN = 512  # bytes: every span starts on this boundary (any dtype's view of it is aligned)


@dataclass(frozen=True)
class HostSpan:
    """``nbytes`` bytes at ``offset`` in chunk ``chunk`` of a :class:`HostArena`."""

    chunk: int
    offset: int
    nbytes: int


class HostArena:
    """Spans of host memory (pinned when ``pinned``) carved from chunks kept until the arena is dropped.

    Counters: ``chunk_bytes`` (memory held), ``grow_seconds`` (host time spent allocating it) and
    ``span_bytes`` (bytes in spans handed out and not given back)."""

    def __init__(self, pinned: bool, min_chunk: int = MIN_CHUNK, max_chunk: int = MAX_CHUNK) -> None:
        if not 0 < min_chunk <= max_chunk:
            raise ValueError(f"HostArena needs 0 < min_chunk <= max_chunk, got {min_chunk} and {max_chunk}")
        self.pinned = pinned
        self.min_chunk, self.max_chunk = min_chunk, max_chunk
        self.chunks: list[torch.Tensor] = []  # uint8, one per chunk
        # free spans: (chunk, offset) -> nbytes, the same sorted by (nbytes, chunk, offset) for best fit, and
        # (chunk, end) -> offset to find the free span just before one given back
        self._free: dict[tuple[int, int], int] = {}
        self._by_size: list[tuple[int, int, int]] = []
        self._ends: dict[tuple[int, int], int] = {}
        self._pending: list[tuple[object, HostSpan]] = []  # given back behind an event not yet passed
        self.chunk_bytes = 0
        self.grow_seconds = 0.0
        self.span_bytes = 0

    # ------------------------------------------------------------------------------------------------
    def take(self, nbytes: int) -> HostSpan:
        """A span of at least ``nbytes`` bytes (rounded up to ``ALIGN``), allocating a chunk when no free
        span holds it. Raises RuntimeError naming the size when the host cannot allocate it."""
        if nbytes <= 0:
            raise ValueError(f"HostArena.take needs a positive size, got {nbytes}")
        size = -(-nbytes // ALIGN) * ALIGN
        self._collect_passed()
        j = bisect.bisect_left(self._by_size, (size, -1, -1))
        if j == len(self._by_size) and self._pending:
            self._wait_pending(size)  # a span behind an unfinished copy may hold it: wait rather than pin more
            j = bisect.bisect_left(self._by_size, (size, -1, -1))
        if j == len(self._by_size):
            self._grow(size)
            j = bisect.bisect_left(self._by_size, (size, -1, -1))
        free_size, chunk, offset = self._by_size[j]
        self._unlist(chunk, offset, free_size)
        if free_size > size:
            self._list(chunk, offset + size, free_size - size)
        self.span_bytes += size
        return HostSpan(chunk, offset, size)

    def view(self, span: HostSpan, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` over ``span``'s bytes from ``start`` (a multiple of the dtype's size)."""
        n = torch.Size(shape).numel() * dtype.itemsize
        if start < 0 or start + n > span.nbytes:
            raise ValueError(f"a view of {n} bytes at {start} does not fit a span of {span.nbytes}")
        base = span.offset + start
        return self.chunks[span.chunk][base : base + n].view(dtype).view(shape)

    def give(self, span: HostSpan, after=None) -> None:
        """Give ``span`` back; ``after``: an event (``query()``, ``synchronize()``) that a device copy still
        reading or writing it records — the span is reused only once it has passed."""
        self.span_bytes -= span.nbytes
        if after is not None and not after.query():
            self._pending.append((after, span))
            return
        self._release(span)

    # ------------------------------------------------------------------------------------------------
    def _collect_passed(self) -> None:
        if self._pending:
            waiting = []
            for event, span in self._pending:
                if event.query():
                    self._release(span)
                else:
                    waiting.append((event, span))
            self._pending = waiting

    def _wait_pending(self, size: int) -> None:
        """Wait for pending spans, oldest first, until a free span holds ``size`` bytes or none is pending."""
        while self._pending:
            event, span = self._pending.pop(0)
            event.synchronize()
            self._release(span)
            if self._by_size and self._by_size[-1][0] >= size:
                return

    def _grow(self, size: int) -> None:
        nbytes = max(size, min(self.max_chunk, max(self.min_chunk, self.chunk_bytes)))
        started = time.perf_counter()
        try:
            chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError as e:
            raise RuntimeError(f"could not allocate {nbytes / 2**20:.0f} MiB of {'pinned ' if self.pinned else ''}"
                               f"host memory for offloaded KV ({self.chunk_bytes / 2**20:.0f} MiB held already): "
                               f"{e}") from e
        self.grow_seconds += time.perf_counter() - started
        self.chunks.append(chunk)
        self.chunk_bytes += nbytes
        self._list(len(self.chunks) - 1, 0, nbytes)

    def _release(self, span: HostSpan) -> None:
        chunk, offset, size = span.chunk, span.offset, span.nbytes
        after = self._free.get((chunk, offset + size))
        if after is not None:  # the free span right after it joins
            self._unlist(chunk, offset + size, after)
            size += after
        before = self._ends.get((chunk, offset))
        if before is not None:  # and the one right before it
            before_size = offset - before
            self._unlist(chunk, before, before_size)
            offset, size = before, size + before_size
        self._list(chunk, offset, size)

    def _list(self, chunk: int, offset: int, size: int) -> None:
        self._free[(chunk, offset)] = size
        self._ends[(chunk, offset + size)] = offset
        bisect.insort(self._by_size, (size, chunk, offset))

    def _unlist(self, chunk: int, offset: int, size: int) -> None:
        del self._free[(chunk, offset)]
        del self._ends[(chunk, offset + size)]
        del self._by_size[bisect.bisect_left(self._by_size, (size, chunk, offset))]

    def free_bytes(self) -> int:
        """Bytes in free spans (pending ones not counted)."""
        return sum(self._free.values())
