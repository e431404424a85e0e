"""Which segments each query row of a tree-attention plan reads: its path, as flat arrays.

A plan's rows and segments come as ``segment_parent`` (a forest) and ``query_segment`` (each row's own
segment); a row reads every segment on its root-to-own path (with a sliding window, only those whose
last key is inside its window, and always its own). The planners need that relation many ways round
(the rows below each segment, each row's partials in path order), for a thousand rows and thousands of
segments on every decode phase and mixed step: :func:`row_paths` builds it once as numpy arrays of
(row, segment) *pairs*, in one pass per tree level rather than per pair.

Pairs are ordered by row, and each row's pairs root first, ending with its own segment. ``local[p]``
is pair ``p``'s row's index among the rows that read its segment (rows in increasing order): the row's
slot in that segment's partials.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class RowPaths:
    """``row, seg, local: [num_pairs] int64`` — the (row, segment) pairs and each row's index among
    its segment's rows; ``own: [num_rows] int64`` — each row's own segment; ``depth: [num_segments]
    int64`` — each segment's depth (0: a root). ``count: [num_segments]`` — rows reading each segment."""

    row: np.ndarray
    seg: np.ndarray
    local: np.ndarray
    own: np.ndarray
    depth: np.ndarray
    count: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.own)

    def by_segment(self) -> np.ndarray:
        """Pair indices ordered by segment, rows ascending within each (the order of ``local``)."""
        return np.argsort(self.seg, kind="stable")

    def rows_of(self) -> dict[int, list[int]]:
        """Segment -> the rows that read it, ascending (segments no row reads are absent)."""
        order = self.by_segment()
        segs, rows = self.seg[order].tolist(), self.row[order].tolist()
        out: dict[int, list[int]] = {}
        for s, q in zip(segs, rows):
            out.setdefault(s, []).append(q)
        return out


def expand(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of ``sizes`` elements laid end to end: each element's group and its index in the group
    (``[2, 0, 3]`` -> ``[0, 0, 2, 2, 2]``, ``[0, 1, 0, 1, 2]``)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    return group, np.arange(len(group)) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def row_paths(segment_parent: Sequence[int], query_segment: Sequence[int], *, query_pos: Sequence[int] | None = None,
              segment_pos: Sequence[int] | None = None, segment_len: Sequence[int] | None = None,
              window: int | None = None) -> RowPaths:
    """The pairs of a plan (see the module doc), checking its inputs: a parent outside ``[-1, n)``, a
    cycle of parents, or a row naming a segment outside ``[0, n)`` raise ValueError naming it. With
    ``window`` W, a row at position p skips the ancestors whose last key (``segment_pos + segment_len
    - 1``) is at or before ``p - W``."""
    parent = np.asarray(segment_parent, dtype=np.int64).reshape(-1)
    n = len(parent)
    bad = np.flatnonzero((parent < -1) | (parent >= n))
    if len(bad):
        raise ValueError(f"segment {int(bad[0])} has parent {int(parent[bad[0]])}, outside [-1, {n})")
    own = np.asarray(query_segment, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((own < 0) | (own >= n))
    if len(bad):
        raise ValueError(f"query row {int(bad[0])} names segment {int(own[bad[0]])}, outside [0, {n})")
    # ancestors[k][s]: the k-th ancestor of s (-1 past the root), one array per level
    ancestors = [np.arange(n, dtype=np.int64)]
    cur = parent
    depth = np.zeros(n, dtype=np.int64)
    while (cur >= 0).any():
        if len(ancestors) > n:  # a chain longer than the segments: some segment is its own ancestor
            on_cycle = int(cur[np.flatnonzero(cur >= 0)[0]])  # (n steps up from anywhere: on the cycle)
            raise ValueError(f"segment_parent has a cycle through segment {on_cycle}")
        ancestors.append(cur)
        depth += cur >= 0
        cur = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
    table = np.stack(ancestors)  # [levels, n]
    # each row's path, root first: column j holds ancestor (depth - j) of its own segment
    d = depth[own]
    width = int(d.max()) + 1 if len(own) else 1
    k = d[:, None] - np.arange(width)[None, :]  # [rows, width]
    valid = k >= 0
    path = np.where(valid, table[np.maximum(k, 0), own[:, None]], -1)
    if window is not None:
        start = np.asarray(segment_pos, dtype=np.int64)
        last = start + np.asarray(segment_len, dtype=np.int64) - 1
        oldest = np.asarray(query_pos, dtype=np.int64) - window
        inside = last[np.maximum(path, 0)] > oldest[:, None]
        valid &= inside | (path == own[:, None])
    rows = np.broadcast_to(np.arange(len(own), dtype=np.int64)[:, None], path.shape)
    row, seg = rows[valid], path[valid]  # row-major: rows ascending, each root first
    count = np.bincount(seg, minlength=n).astype(np.int64)
    local = np.empty(len(seg), dtype=np.int64)
    local[np.argsort(seg, kind="stable")] = expand(count)[1]  # in segment order, each segment's rows count up
    return RowPaths(row=row, seg=seg, local=local, own=own, depth=depth, count=count)
