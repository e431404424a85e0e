"""The Triton work-table planner as it was written first, one Python iteration per work item and per
partial a row merges: the reference :func:`treegen.kernels.triton_plan.plan_triton` (numpy over all
segments at once) is compared with, table for table, on random trees (``test_triton_plan.py``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from treegen.kernels import triton_plan as _planner
from treegen.kernels.library_attention import LibrarySegment, folds_heads
from treegen.kernels.triton_plan import (_FUSED_LEAF_MAX_KEYS,
                                         _LIBRARY_MIN_KEYS, _LIBRARY_MIN_ROWS,
                                         _LIBRARY_MIN_SHARE, _MIN_MID_PROGRAMS, _SMS, TritonPlan, WorkList,
                                         _launch_shape, _one_wave_chunk, _pdl_default, _tma_default)

# planning: marks a segment whose path is being walked (met again on the walk: a cycle)
_ON_CHAIN: list = []


def reference_paths(segment_parent, segment_pos, segment_len, query_segment, query_pos, window=None):
    """(rows_of, paths, path_local) as the planner built them before :mod:`treegen.kernels.row_paths`."""
    n = len(segment_parent)
    # every segment's root-to-segment path, checking the parents (in range, no cycle) on the way; a
    # segment's path is its parent's plus itself, so each segment is walked once (its depth: the length - 1)
    path_of: list[list[int] | None] = [None] * n
    for s in range(n):
        chain, cur = [], s
        while cur != -1 and path_of[cur] is None:
            parent = segment_parent[cur]
            if not -1 <= parent < n:
                raise ValueError(f"segment {cur} has parent {parent}, outside [-1, {n})")
            path_of[cur] = _ON_CHAIN
            chain.append(cur)
            cur = parent
        if cur != -1 and path_of[cur] is _ON_CHAIN:
            raise ValueError(f"segment_parent has a cycle through segment {cur}")
        path = [] if cur == -1 else path_of[cur]
        for c in reversed(chain):
            path = path_of[c] = [*path, c]

    rows_of: dict[int, list[int]] = {}
    paths: list[list[int]] = []
    path_local: list[list[int]] = []  # row q's index among rows_of[s], for each s on its path
    for row, seg in enumerate(query_segment):
        if not 0 <= seg < n:
            raise ValueError(f"query row {row} names segment {seg}, outside [0, {n})")
        path = path_of[seg]
        if window is not None:  # an ancestor whose last key is outside this row's window is not read at all
            oldest = query_pos[row] - window
            path = [s for s in path if s == seg or segment_pos[s] + segment_len[s] - 1 > oldest]
        local = []
        for s in path:
            below = rows_of.get(s)
            if below is None:
                below = rows_of[s] = []
            local.append(len(below))
            below.append(row)
        paths.append(path)
        path_local.append(local)
    return rows_of, paths, path_local


def _library_segment(segs, rows_of, paths, segment_start, segment_len, group, num_kv_heads, device, quantized=False):
    """The shared segment with the most work among those large enough for the library kernel, cut into
    chunks for ~one wave of 128-row tiles; None if there is none or it is not most of the shared work.
    Only ancestors of every row reading it qualify (no row's own segment: those need the causal mask).
    ``quantized``: an 8-bit cache (its own chunk size, no wave minimum)."""
    own = {path[-1] for path in paths}
    fits = [s for s in segs if s not in own and len(rows_of[s]) * group >= _LIBRARY_MIN_ROWS
            and segment_len[s] >= _LIBRARY_MIN_KEYS]
    if not fits:
        return None
    work = {s: len(rows_of[s]) * segment_len[s] for s in segs if s not in own}
    s = max(fits, key=lambda s: (work[s], -s))
    if work[s] < _LIBRARY_MIN_SHARE * sum(work.values()):
        return None  # the other shared segments' launch would run after it, not beside it
    tiles = -(-len(rows_of[s]) * group // 128) * num_kv_heads
    # (the limits read from the planner's module when called: tests may raise them)
    most = _planner._LIBRARY_MAX_FOLDED_CHUNKS if folds_heads(group) else _planner._LIBRARY_MAX_CHUNKS
    min_chunk = _planner._LIBRARY_MIN_CHUNK_8BIT if quantized else _planner._LIBRARY_MIN_CHUNK
    min_programs = 0 if quantized else _planner._LIBRARY_MIN_PROGRAMS
    rounded = (segment_len[s] + min_chunk // 2) // min_chunk
    by_length = most if rounded > most >= segment_len[s] // min_chunk else rounded
    chunks = max(1, min(round(_SMS / tiles), by_length))
    if chunks > most or chunks * tiles < min_programs:
        return None
    rows = rows_of[s]
    every = rows == list(range(len(paths)))
    return s, LibrarySegment(start=segment_start[s], chunk_len=segment_len[s] // chunks, chunks=chunks,
                             num_rows=len(rows),
                             rows=None if every else torch.tensor(rows, dtype=torch.int64, device=device))


def reference_plan_triton(
    *,
    segment_start: Sequence[int],
    segment_len: Sequence[int],
    segment_pos: Sequence[int],
    rows_of: dict[int, list[int]],
    paths: list[list[int]],
    path_local: list[list[int]],
    num_kv_heads: int,
    group: int,
    device,
    target_programs: int | None = None,
    block_n: int = 64,
    num_stages: int | None = None,
    use_tma: bool | None = None,
    warp_specialize: bool = False,
    fuse_merge: bool = True,
    library: bool = False,
    leaf_shape: tuple[int, int, int] | None = None,
    longest_first: bool = True,
    pdl: int | None = None,
    mid_tiles: bool | None = None,
    half_partials: bool = True,
    one_wave: bool = True,
    kv_quantized: bool = False,
) -> TritonPlan:
    """The planner before numpy: one Python iteration per item and per partial a row merges."""
    if group > 128:
        raise ValueError(f"{group} query heads per KV head is more than the 128 supported")
    segs = sorted(s for s in rows_of if segment_len[s] > 0)
    key_begin = {s: 0 for s in segs}  # keys before this are the library kernel's
    lib = _library_segment(segs, rows_of, paths, segment_start, segment_len, group, num_kv_heads, device,
                           kv_quantized) if library else None
    if lib is not None:
        key_begin[lib[0]] = lib[1].chunks * lib[1].chunk_len
        if key_begin[lib[0]] == segment_len[lib[0]]:
            segs.remove(lib[0])
    wide_m = 128 if max((len(r) for r in rows_of.values()), default=1) * group >= 128 else 64
    tile_m = {s: 16 if len(rows_of[s]) * group <= 16 else wide_m for s in segs}
    # segments with 128-row tiles read by at most 64 rows x heads: one 64-row tile each (4 warps) in a launch of
    # their own, when they make at least half a wave of programs (segments x KV heads, before key chunks;
    # fewer: the extra launch costs more than the emptier 128-row tiles)
    mid = [s for s, m in tile_m.items() if m == 128 and len(rows_of[s]) * group <= 64]
    if mid_tiles is None:
        mid_tiles = len(mid) * num_kv_heads >= _MIN_MID_PROGRAMS
    if mid_tiles:
        tile_m.update({s: 64 for s in mid})
    tiles = {s: -(-len(rows_of[s]) // (tile_m[s] // group)) for s in segs}
    # balance: cut keys into chunks so the total work is spread over ~target_programs programs
    total = sum(tiles[s] * tile_m[s] // 16 * (segment_len[s] - key_begin[s]) for s in segs) * num_kv_heads // (wide_m // 16)
    if target_programs is None:  # (see the docstring)
        target_programs = _SMS
    chunk = max(8 * block_n, -(-total // max(target_programs, 1)))
    chunk = -(-chunk // block_n) * block_n
    if one_wave:
        wide = [s for s in segs if tile_m[s] != 16]
        chunk = _one_wave_chunk(chunk, np.array([segment_len[s] - key_begin[s] for s in wide], dtype=np.int64),
                                np.array([tiles[s] * num_kv_heads for s in wide], dtype=np.int64), block_n)
    # few narrow (single-branch) segments cannot fill the GPU with one program each: cut them finer
    narrow = sum(1 for s in segs if tile_m[s] == 16) * num_kv_heads
    seg_chunk = {s: 2 * block_n if tile_m[s] == 16 and narrow < 2 * _SMS else chunk for s in segs}
    # fused merge: the narrow segments are exactly the queries' own ones (an ancestor in the narrow
    # launch would run alongside its descendants), each read by its own queries only and short enough
    # (or numerous enough) to be one unsplit work item
    own = {path[-1] for path in paths}
    narrow_segs = {s for s in segs if tile_m[s] == 16}
    fused = fuse_merge and narrow_segs == own and all(
        all(paths[q][-1] == s for q in rows_of[s]) and segment_len[s] <= max(seg_chunk[s], _FUSED_LEAF_MAX_KEYS)
        for s in own)
    if fused:
        for s in own:
            seg_chunk[s] = max(segment_len[s], 1)
    by_row = fused and lib is not None and lib[1].rows is None
    leaf_tail = (0, 0, 0)
    if by_row and lib[0] in segs:  # the library's keys past its chunks: every fused leaf attends them itself
        s, kb = lib[0], key_begin[lib[0]]
        leaf_tail = (segment_start[s] + kb, segment_pos[s] + kb, segment_len[s] - kb)
        segs.remove(s)
    work: dict[int, list] = {}
    rows = []
    # segment -> (its first partial, its rows, its key chunks): chunk c of row i's partial is first + c * rows + i
    partials_of: dict[int, tuple[int, int, int]] = {}
    num_partials = 0
    for s in segs:
        row_offset = len(rows)
        rows.extend(rows_of[s])
        count, rows_per_tile = len(rows_of[s]), tile_m[s] // group
        items = work.setdefault(tile_m[s], [])
        chunk_begins = range(key_begin[s], segment_len[s], seg_chunk[s])
        partials_of[s] = (num_partials, count, len(chunk_begins))
        for kb in chunk_begins:
            ke = min(segment_len[s], kb + seg_chunk[s])
            for t in range(tiles[s]):
                first = t * rows_per_tile
                items.append([segment_start[s], segment_pos[s], kb, ke, row_offset + first,
                              min(rows_per_tile, count - first), num_partials + first])
            num_partials += count
    merge_ptr, merge_idx = [0], []
    lib_seg = lib[0] if lib is not None and not by_row else None
    for path, local in zip(paths, path_local):
        for s, i in zip(path[:-1] if fused else path, local):  # fused: the own segment's item merges the rest itself
            if s == lib_seg:
                merge_idx.extend(-1 - (c * lib[1].num_rows + i) for c in range(lib[1].chunks))
            where = partials_of.get(s)
            if where is not None:
                first, count, chunks = where
                if chunks == 1:
                    merge_idx.append(first + i)
                else:
                    merge_idx.extend(range(first + i, first + i + chunks * count, count))
        merge_ptr.append(len(merge_idx))

    def i32(x) -> Tensor:  # (through numpy: torch.tensor of a Python list costs ~4x more host time)
        return torch.from_numpy(np.asarray(x, dtype=np.int32)).to(device)

    rows_at = np.asarray(rows, dtype=np.int64)

    def launch(m, items):
        table = np.asarray(items, dtype=np.int64).reshape(-1, 7)
        if longest_first:  # programs start in table order: the longest first, the short ones fill in after
            table = table[np.argsort(table[:, 2] - table[:, 3], kind="stable")]
        # rows [o, o + n) of ``rows`` consecutive query rows in every item: hand the kernel the first one
        # (a segment's rows increase: consecutive when the last is n - 1 past the first)
        first, count = table[:, 4], table[:, 5]
        direct = bool(np.all(rows_at[first + count - 1] - rows_at[first] == count - 1))
        if direct:
            table[:, 4] = rows_at[first]
        return WorkList(i32(table), m, *_launch_shape(m, table, num_kv_heads, block_n, num_stages or 3, leaf_shape),
                        direct_rows=direct)

    order = sorted(work.items(), key=lambda mi: (mi[0] == 16) if fused else mi[0])  # fused: own items last
    return TritonPlan(
        launches=tuple(launch(m, items) for m, items in order),
        rows=i32(rows or [0]),
        merge_ptr=i32(merge_ptr),
        merge_idx=i32(merge_idx or [0]),
        num_partials=num_partials,
        group=group,
        use_tma=_tma_default(device) if use_tma is None else use_tma,
        warp_specialize=warp_specialize,
        fused_merge=fused,
        library=lib[1] if lib else None,
        library_by_row=by_row,
        leaf_tail=leaf_tail,
        pdl=_pdl_default(device) if pdl is None else pdl,
        half_partials=half_partials,
    )


