"""The free spans of an address range, for best-fit allocation: the KV pool's slots and the host arena's bytes.

Kept twice: sorted by start (``by_start``: a span given back merges with the free spans it touches) and by
length (``by_length``: the smallest span that holds a request, found by bisection), with their ``total``.
Every change goes through :meth:`take_front`, :meth:`release` or :meth:`reset`, so the three agree.
"""

from __future__ import annotations

import bisect


class FreeSpans:
    """Free ``(start, length)`` spans, none empty, none touching another (they would have merged)."""

    def __init__(self, spans=()) -> None:
        self.reset(spans)

    def reset(self, spans) -> None:
        """The free spans are these ``(start, length)``, sorted by start, none empty."""
        self.by_start: list[tuple[int, int]] = list(spans)
        self.by_length: list[tuple[int, int]] = sorted((n, s) for s, n in self.by_start)
        self.total = sum(n for _, n in self.by_start)

    def best_fit(self, length: int) -> int | None:
        """Take ``length`` from the front of the smallest span that holds it (the first such: large spans
        stay whole for large requests); its start, or None when no span is that long."""
        j = bisect.bisect_left(self.by_length, (length, -1))
        if j == len(self.by_length):
            return None
        start = self.by_length[j][1]
        self.take_front(bisect.bisect_left(self.by_start, (start, 0)), length)
        return start

    def extend(self, end: int, length: int) -> bool:
        """Take ``length`` from the front of the free span starting at ``end``, if there is one that long
        (what ends at ``end`` grows in place)."""
        i = bisect.bisect_left(self.by_start, (end, 0))
        if i < len(self.by_start) and self.by_start[i][0] == end and self.by_start[i][1] >= length:
            self.take_front(i, length)
            return True
        return False

    def take_front(self, i: int, length: int) -> None:
        """Take ``length`` from the front of span ``i`` (by start): what is left stays free."""
        start, n = self.by_start[i]
        del self.by_length[bisect.bisect_left(self.by_length, (n, start))]
        self.total -= length
        if n > length:
            self.by_start[i] = (start + length, n - length)
            bisect.insort(self.by_length, (n - length, start + length))
        else:
            del self.by_start[i]

    def release(self, start: int, length: int) -> None:
        """Give a span back, merged with the free spans it touches: O(log n) to find its place."""
        free = self.by_start
        i = bisect.bisect_left(free, (start, 0))
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # joins the span before it
            i -= 1
            start, before = free[i]
            length += before
            self.take_front(i, before)
        if i < len(free) and start + length == free[i][0]:  # and the span after it
            after = free[i][1]
            length += after
            self.take_front(i, after)
        free.insert(i, (start, length))
        bisect.insort(self.by_length, (length, start))
        self.total += length

    def largest(self) -> int:
        return self.by_length[-1][0] if self.by_length else 0
