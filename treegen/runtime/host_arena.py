"""Host memory for offloaded KV, kept for an engine's lifetime: pinned chunks carved into spans.

Pinning host memory is slow: on an H100 host (``benchmarks/probe_offload_host.py``), 0.3-0.7 ms a MiB,
about 22 ms for one 130-token node of Llama-3-8B's KV (16 MiB), against ~1 ms to issue its copies, and
a thread pinning in the background stalls the CUDA calls of the one driving the GPU. PyTorch's caching
pinned allocator rounds every request up to a power of two and reuses a freed block only for requests
of the same rounded size, so a run whose node sizes vary kept pinning fresh memory: Llama-3-8B's
tree-of-thought at 1,024 branches, short of KV memory, spent 35 s of its 90 s in offload host work.

:class:`HostArena` pins memory in large chunks (growing geometrically, ``MIN_CHUNK`` to ``MAX_CHUNK``
bytes), never gives a chunk back while it lives, and hands out exact-size spans (best fit; neighbours
merge when freed: :class:`~treegen.runtime.free_spans.FreeSpans`, as the KV pool's slots). A span a pending device copy still reads (a restore's host-to-device copies run on a
side stream) comes back with the event after those copies and is reused only once it has passed. The
engine keeps one arena across its runs, so only the memory its largest offload needs is ever pinned,
once — or at start-up: ``Engine(host_reserve_bytes=)`` (:meth:`HostArena.reserve`) pins that much when the
engine is made, so that no run pays for it (on an H100 host, 10-17 s for the 23-25 GiB Llama-3-8B's
64 x 4,096 benchmark offloads: a tenth of that run).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from treegen.runtime.free_spans import FreeSpans

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
        # the chunks laid end to end in one address range, ALIGN bytes apart (so that free spans of two
        # chunks never merge): chunk k's bytes are [bases[k], bases[k] + its size)
        self._bases: list[int] = []
        self._spans = FreeSpans()
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
        if self._spans.largest() < size and self._pending:
            self._wait_pending(size)  # a span behind an unfinished copy may hold it: wait rather than pin more
        if self._spans.largest() < size:
            self._grow(size)
        start = self._spans.best_fit(size)
        chunk = bisect.bisect_right(self._bases, start) - 1
        self.span_bytes += size
        return HostSpan(chunk, start - self._bases[chunk], size)

    def reserve(self, nbytes: int) -> float:
        """Hold at least ``nbytes`` bytes in chunks now (of at most ``max_chunk`` each), so that offloads up to
        that much allocate nothing (but a node's span larger than a chunk: spans never cross chunks) — pinning
        paid at start-up, as vLLM allocates its swap space; returns the seconds it took. RuntimeError naming the sizes when the host cannot allocate it."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"HostArena.reserve needs a number of bytes >= 0, got {nbytes!r}")
        started = self.grow_seconds
        while self.chunk_bytes < nbytes:
            self._grow(min(self.max_chunk, -(-(nbytes - self.chunk_bytes) // ALIGN) * ALIGN), exact=True)
        return self.grow_seconds - started

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
            if self._spans.largest() >= size:
                return

    def _grow(self, size: int, exact: bool = False) -> None:
        """A new chunk of ``size`` bytes (``exact``) or, growing geometrically, of what the arena holds (from
        ``min_chunk`` to ``max_chunk``) when that is more."""
        nbytes = size if exact else max(size, min(self.max_chunk, max(self.min_chunk, self.chunk_bytes)))
        started = time.perf_counter()
        try:
            chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError as e:
            raise RuntimeError(f"could not allocate {nbytes / 2**20:.0f} MiB of {'pinned ' if self.pinned else ''}"
                               f"host memory for offloaded KV ({self.chunk_bytes / 2**20:.0f} MiB held already): "
                               f"{e}") from e
        self.grow_seconds += time.perf_counter() - started
        base = self._bases[-1] + self.chunks[-1].numel() + ALIGN if self.chunks else 0
        self.chunks.append(chunk)
        self._bases.append(base)
        self.chunk_bytes += nbytes
        self._spans.release(base, nbytes)

    def _release(self, span: HostSpan) -> None:
        self._spans.release(self._bases[span.chunk] + span.offset, span.nbytes)

    def free_bytes(self) -> int:
        """Bytes in free spans (pending ones not counted)."""
        return self._spans.total
