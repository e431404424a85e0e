"""Work tables of the Triton tree attention: which program reads which keys for which query rows.

:func:`plan_triton` turns a tree's segments and query rows into :class:`TritonPlan`: work items grouped
into launches by tile height (16 rows for a branch's own segment, 64/128 for shared ones), long segments
split along the key axis to fill the GPU, each launch's shape (:func:`_launch_shape`), the CSR list of
partials each query row merges, and optionally the one large shared segment given to cuDNN
(:func:`_library_segment`). The kernels that run these tables are in ``tree_attention_triton.py``.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from treegen.kernels.library_attention import LibrarySegment, folds_heads
from treegen.kernels.row_paths import RowPaths, expand

# the GPU the launch shapes were measured on: an H100's streaming multiprocessors
_SMS = 132
# a query's own segment up to this many keys is read by one program when that lets it merge the
# query's partials itself (fewer launches beat splitting so short a segment)
_FUSED_LEAF_MAX_KEYS = 512
# a shared segment goes to the library kernel (library_attention.py) when it is read by at least this many
# query rows x heads per KV head and has at least this many keys; its keys are cut into chunks of at least
# about _LIBRARY_MIN_CHUNK (the length over it, rounded: an 8,191-key prefix gets the 4 chunks of an 8,192-key
# one, not 3) so that ~one wave of 128-row tiles fills an H100's 132 SMs, and it goes there only when those
# chunks x tiles make at least _LIBRARY_MIN_PROGRAMS (half a wave). cuDNN beat the Triton kernels where its
# chunks held 2,048 keys or more and made a wave, and lost or tied with chunks of 512-1,024 or half a wave
# (one H100 and one H200, bf16, a call each; profile_attention_trees_decode_library_h100.json over a 2K prompt's
# decode tree, attention_h100/h200.json's paper grid, 8/1 heads unless named, cuDNN vs all-Triton us):
#   won: 1 chunk of 2K x 128-256 tiles (32/8 heads at 512 and 1,024 leaves 77.7 vs 81.0 and 133.0 vs 144.2;
#        16/4 at 1,024 77.6 vs 81.1; 32/32 at 512 155.0 vs 157.7); 2 of 2K or 8K x 64 tiles (1,024 x 4K
#        48.3 vs 52.7, x 16K 123 vs 149; 32/8 256 x 4K 59.6 vs 62.7); 8 of 2K x 16 tiles (256 x 16K 45.1 vs 48.2);
#   lost or tied: 2 of 1K x 64 tiles (32/8 at 256 leaves 54.0 vs 52.6), 4 of 512 (16/4 at 128 and 256 leaves
#        34.1 vs 31.1 and 42.4 vs 34.2; 32/8 at 128 42.5 vs 34.6; 8/1 at 64 and 128 22.9 vs 21.0, 23.8 vs 21.6),
#        8 of 512 x 4 and 16 tiles (64 and 256 x 4K 24.4 vs 21.0, 26.6 vs 26.0; H100: 24.1 vs 24.8, 27.5 vs 29.1).
# (The chunk was 512 and there was no wave rule before the leaves were packed and launched as dependents.)
_LIBRARY_MIN_ROWS = 512
_LIBRARY_MIN_KEYS = 1024
_LIBRARY_MIN_CHUNK = 2048
_LIBRARY_MIN_PROGRAMS = _SMS // 2
# ... but over an 8-bit cache, chunks of at least this many keys however few programs they make (the rule before the
# one above, kept for it): there cuDNN reads the segment dequantized once a phase while the Triton kernels convert
# every key they read, and all-Triton measured slower (Llama-3-8B shape, FP8, 2,047-key prompt, one H100: 10.91 vs
# 10.16 ms a decode step at 256 branches, 29.66 vs 26.43 at 1,024; not re-measured since)
_LIBRARY_MIN_CHUNK_8BIT = 512
# ... and only when it holds this share of all shared-segment work (rows x keys). Measured on an H100, 8/1
# heads: 16 roots of 2560 keys x 64 branches, one of them by cuDNN: 76 us vs 49 all-Triton; a 2K root over
# 16 problems of 512 keys (80% of the work): 56 vs 55 us
_LIBRARY_MIN_SHARE = 0.9
# ... and when at most this many chunks fill the GPU: each is a partial every row merges. 64 branches x 8/1
# heads under a 16K root needs 32: 38 us vs 32 all-Triton
_LIBRARY_MAX_CHUNKS = 8
# ... at most this many for a group cuDNN gets folded into its rows (library_attention.folds_heads), measured
# on Phi-4-mini (24/8) only, on an H200 (bench_library_ab.py, profile_step.py): at batch 256 x 2K its prefix
# takes 3 chunks, and the leaves' one-warp programs that merge them spill (their launch 57 us against 43
# without the library; 52 us with 52 spills reading the chunks one at a time) — cuDNN 26 us + a 7 us launch for the keys past the chunks: 33.0K tok/s
# end to end against 39.7K with the Triton kernels alone; at 1,024 it takes 1 chunk: 55.7K vs 54.0K (the run
# after this limit: 56.2K vs 54.8K, library_ab_phi-4-mini_folded_h200.json). Power-of-two groups keep the
# limit above, measured on them earlier (Llama-3-8B's leaves merge 2 chunks with 10 spills, 23 us)
_LIBRARY_MAX_FOLDED_CHUNKS = 2
# (Tried and not kept: a folded group that wants more chunks capped at 2 instead of declined. Phi-4-mini at 256
# branches x 2,047 keys, one H100, old/new interleaved: attention kernels 1,755 -> 1,468 us a step (cuDNN 18 us
# + leaves 30 against Triton's prefix 24 + leaves 33 a layer), yet the step's wall time 6.50-6.59 -> 6.81-6.98 ms,
# tree/none 0.76 -> 0.71-0.73; library_folded_cap_phi-4-mini_h100.json.)
# segments read by 17..64 rows x heads get 64-row tiles of their own launch when they make this many programs
# (half an H100/H200 wave). Measured on an H200 (profile_attention_trees.py, program-shaped trees, 256/1,024
# leaves, 32/8 x 128, 9/3 x 64, 16/8 x 256 heads, fp16 partials both ways): 66-736 such programs 0-11% less
# time a call (deep trees most), 33 and 48 programs 2% and 15% more (the multilevel tree, 9/3 heads, 256 leaves)
_MIN_MID_PROGRAMS = _SMS // 2
# a 16-row launch of this many programs or more (items x KV heads) of short items runs one-warp programs (see
# _launch_shape) ...
_MANY_PROGRAMS = 1024
# ... and fused leaves share 16-row tiles (several leaves a program) down to about this many programs (~8 an SM;
# see _leaf_pack)
_PACKED_PROGRAMS = 1024
# ... unless their items average more keys than this: long leaves run one a tile (see _leaf_pack)
_PACK_MAX_MEAN_KEYS = 192
# a shared-segment program's fixed work (its query tile, its partial's store, its start) in keys of its loop, for
# the estimate of :func:`_makespan`
_PROGRAM_OVERHEAD_KEYS = 128
# ... and how much longer than the plan's own chunks that estimate may be for chunks that fit one wave
# (see _one_wave_chunk: one wave lets the next launch start beside it)
_ONE_WAVE_SLACK = 1.1


@dataclass(frozen=True)
class WorkList:
    """Work items launched together with one tile height.

    ``work: [num_programs, 7 * pack] int32`` — per item: first cache slot of the segment, absolute position
    of the segment's first key, key range begin/end within the segment, offset into ``rows`` of the tile's
    first query row, number of query rows, first partial entry. E.g. a root of 40 keys at slots 0..39
    read by query rows [0, 1] in one chunk → ``[[0, 0, 0, 40, 0, 2, 0]]``. ``pack`` > 1 (fused leaves only):
    each program's tile holds the rows of ``pack`` items, one after another (``7 * pack`` columns; items
    with no rows fill a short last program), and attends each item's keys with that item's rows only.
    ``block_m`` — tile height (query rows x query heads per KV head); ``block_n`` — keys per block of the
    key loop (fp16/bf16; fp32 inputs use half); ``num_warps`` and ``num_stages`` (software-pipeline depth
    of the key loop) for the launch. ``direct_rows`` — every item's rows are consecutive query rows, and
    its column 4 holds the first query row itself (no lookup in ``rows``: one dependent load less).
    """

    work: Tensor
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    direct_rows: bool = False
    pack: int = 1


@dataclass(frozen=True)
class TritonPlan:
    """Work tables for the two kernels (int32 tensors on the plan's device).

    ``launches`` — one :class:`WorkList` per tile height: segments read by a handful of query rows
    (a branch's own leaf) get 16-row tiles, shared segments 64- or 128-row tiles, so a leaf with one
    query does not pay for a 128-row tile.
    ``rows: [sum of rows over segments]`` — query rows below each segment, segment after segment.
    ``merge_ptr: [num_queries + 1]`` and ``merge_idx`` — CSR: partial entries of each query row.
    ``fused_merge`` — every query's own segment is one unsplit 16-row work item and no ancestor is: the
    16-row launch runs last and merges its rows' ancestor partials (then ``merge_idx`` lists only
    those) into the output itself, so there is no merge launch.
    ``library`` — the shared segment attended by the library kernel first (None: none); a negative
    ``merge_idx`` entry names one of its partials (see :class:`LibrarySegment`).
    ``library_by_row`` — fused, and the library segment is read by every query row in order: each leaf
    item reads its row's library partials directly (chunk ``c``, row ``q``), not through ``merge_idx``.
    ``leaf_tail`` — ``(first cache slot, first position, keys)`` of the library segment's keys past its
    chunks (fewer than ``library.chunks``) when ``library_by_row``: every fused leaf program attends them
    itself, before its own keys (no launch of their own, no partial to merge); ``(0, 0, 0)``: none.
    ``pdl`` — programmatic dependent launch level of the call's kernels (see
    :func:`~treegen.kernels.tree_attention_triton.dependent_launches`; 0: none).
    ``half_partials`` — the partial outputs of 16-bit inputs are stored in fp16 (fp32 inputs keep fp32).
    """

    launches: tuple[WorkList, ...]
    rows: Tensor
    merge_ptr: Tensor
    merge_idx: Tensor
    num_partials: int
    group: int
    use_tma: bool
    warp_specialize: bool
    fused_merge: bool = False
    library: LibrarySegment | None = None
    library_by_row: bool = False
    leaf_tail: tuple[int, int, int] = (0, 0, 0)
    pdl: int = 0
    half_partials: bool = False
    # the kernels' TMA descriptors of the caches this plan has read, by (pointers, slots, stride, block):
    # made once per layer and plan, not per launch (host time of un-captured steps)
    descriptors: dict = field(default_factory=dict, compare=False, repr=False)

    def shape_key(self) -> tuple | None:
        """What a launch of this plan fixes besides its tables (a CUDA graph captures it): the kernels'
        variants. Plans with equal keys can run one captured launch sequence, each :meth:`load`-ed into
        the tables of one :meth:`padded` plan whose capacities hold its :meth:`sizes`. A plan with a
        library segment has none (None)."""
        if self.library is not None:
            return None
        return (self.group, self.use_tma, self.warp_specialize, self.fused_merge, self.pdl, self.half_partials,
                tuple((w.block_m, w.block_n, w.num_warps, w.num_stages, w.direct_rows, w.pack) for w in self.launches))

    def sizes(self) -> tuple:
        """The tables' lengths: ``(programs of each launch (work items, or packs of them), rows, merge_idx,
        partials)``."""
        return (tuple(w.work.shape[0] for w in self.launches), self.rows.numel(), self.merge_idx.numel(),
                self.num_partials)

    def padded(self, num_queries: int, capacity: tuple) -> "TritonPlan":
        """Empty tables for ``num_queries`` query rows (this plan's and more) at ``capacity`` (as
        :meth:`sizes`, each at least this plan's), to be filled by :meth:`load`. The extra work items
        are empty (no rows, no keys: their programs do nothing) and the extra query rows merge nothing;
        whatever the kernels write for those rows is never read."""
        if self.library is not None:  # (shape_key is None for them: they are never kept across phases)
            raise ValueError("a plan with a library segment cannot be padded: its segment's slots are fixed in it")
        items, rows, merge, partials = capacity

        def zeros(n, *shape):
            return torch.zeros(n, *shape, dtype=torch.int32, device=self.rows.device)

        return TritonPlan(
            launches=tuple(dataclasses.replace(w, work=zeros(n, w.work.shape[1])) for w, n in zip(self.launches, items)),
            rows=zeros(rows), merge_ptr=zeros(num_queries + 1), merge_idx=zeros(merge), num_partials=partials,
            group=self.group, use_tma=self.use_tma, warp_specialize=self.warp_specialize, fused_merge=self.fused_merge,
            pdl=self.pdl, half_partials=self.half_partials)

    def load(self, plan: "TritonPlan") -> None:
        """Copy ``plan``'s tables into this :meth:`padded` one's (equal shape keys, sizes within its
        capacities), in place: the rest of each work table is emptied, the extra query rows get empty
        merge ranges."""
        for mine, theirs in zip(self.launches, plan.launches):
            n = theirs.work.shape[0]
            mine.work[:n].copy_(theirs.work)
            mine.work[n:].zero_()
        self.rows[:plan.rows.numel()].copy_(plan.rows)
        self.merge_idx[:plan.merge_idx.numel()].copy_(plan.merge_idx)
        n = plan.merge_ptr.numel()
        self.merge_ptr[:n].copy_(plan.merge_ptr)
        self.merge_ptr[n:].copy_(plan.merge_ptr[-1:].expand(self.merge_ptr.numel() - n))


def _chunks_by_length(length: int, most: int, min_chunk: int) -> int:
    """The most chunks a library segment of ``length`` keys is cut into: about ``min_chunk`` keys each, the
    length over it rounded (2,048-key chunks: 8,191 keys get 4, as 8,192), but where rounding up passes the
    group's chunk limit ``most`` and the floor does not, the limit (rounding must not decline a segment the floor
    took)."""
    rounded = (length + min_chunk // 2) // min_chunk
    return most if rounded > most >= length // min_chunk else rounded


def _library_segment(segs, count, own, paths: RowPaths, segment_start, segment_len, group, num_kv_heads, device,
                     quantized: bool = False):
    """The shared segment with the most work among those large enough for the library kernel, cut into
    chunks for ~one wave of 128-row tiles; None if there is none, it is not most of the shared work, or its
    chunks x tiles do not make half a wave.
    Only ancestors of every row reading it qualify (no row's own segment: those need the causal mask).
    ``segs``: the segments with keys that rows read (ascending), ``count``: rows reading each, ``own``:
    whether it is some row's own segment (both [num_segments]). ``quantized``: the cache is 8-bit (chunks of
    ``_LIBRARY_MIN_CHUNK_8BIT``, no wave minimum)."""
    min_chunk, min_programs = (_LIBRARY_MIN_CHUNK_8BIT, 0) if quantized else (_LIBRARY_MIN_CHUNK, _LIBRARY_MIN_PROGRAMS)
    shared = segs[~own[segs]]
    rows = count[shared]
    fits = (rows * group >= _LIBRARY_MIN_ROWS) & (segment_len[shared] >= _LIBRARY_MIN_KEYS)
    if not fits.any():
        return None
    work = rows * segment_len[shared]
    best = work[fits].max()
    s = int(shared[fits & (work == best)].min())  # the most work, the lowest id of equals
    if best < _LIBRARY_MIN_SHARE * int(work.sum()):
        return None  # the other shared segments' launch would run after it, not beside it
    num_rows = int(count[s])
    tiles = -(-num_rows * group // 128) * num_kv_heads
    most = _LIBRARY_MAX_FOLDED_CHUNKS if folds_heads(group) else _LIBRARY_MAX_CHUNKS
    chunks = max(1, min(round(_SMS / tiles), _chunks_by_length(int(segment_len[s]), most, min_chunk)))
    if chunks > most or chunks * tiles < min_programs:
        return None
    every = num_rows == paths.num_rows  # (a segment's rows are distinct: all of them, in order)
    rows_of_s = None if every else torch.from_numpy(np.sort(paths.row[paths.seg == s])).to(device)
    return s, LibrarySegment(start=int(segment_start[s]), chunk_len=int(segment_len[s]) // chunks, chunks=chunks,
                             num_rows=num_rows, rows=rows_of_s)


def _ceil_div(a, b):
    return -(-a // b)


def plan_triton(
    *,
    segment_start: Sequence[int],
    segment_len: Sequence[int],
    segment_pos: Sequence[int],
    paths: RowPaths,
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
    pack_leaves: int | None = None,
    one_wave: bool = True,
    kv_quantized: bool = False,
) -> TritonPlan:
    """Build the work tables. ``paths``: which segments each query row reads (:func:`~treegen.kernels.
    row_paths.row_paths`). Every table is computed with numpy over all segments, items and partials at
    once (a decode phase of a thousand branches plans thousands of segments: ~3x less host time than
    one Python iteration per item and per row's partial, which ``tests/triton_plan_reference.py`` keeps
    as the reference the tests compare with). ``target_programs``: how
    many programs the key-axis split aims for: by default one per SM of an H100 (132): fewer, longer programs
    write fewer partials, and with the items longest first the short ones fill in behind them. (Two per SM
    for work under 132 x 1,024 was measured best before the items were ordered, ``bench_attention.py
    --sweep``; with the order, one per SM measured on an H200: paper grid geomean 1.00 (0.97-1.04),
    program-shaped trees 0.81-1.02 (the heavy tree with 9/3 heads at 256 leaves 58 -> 47 us), Phi-4-mini's
    decode step at batch 256 1,843 -> 1,594 us of attention, ``profile_attention_trees_target_programs_h200.json``.)
    ``library``: give the largest shared segment to the library kernel (``library_attention.py``) if
    one is large enough; its last ``< chunks`` keys, if any, are read by the fused leaves (``leaf_tail``) or
    else by a Triton launch. (Real prompts are rarely a multiple of the chunks: measured on an H100, Llama-3-8B
    shape, 256 branches, a 2,047-key prefix's one-key tail in a 128-row launch of its own cost 357 us a decode
    step against 2,048 keys (tree/none 0.797 vs 0.828), ``profile_step.py --prefix``.)
    ``longest_first``: each launch's items in order of decreasing key count (GPUs start programs in table
    order — observed, not guaranteed — so the long ones start first and the short ones fill the SMs they
    leave: measured on an H200, 32/8 x 128 heads, 256 leaves, the heavy tree's call 119 -> 102 us). ``pdl``: programmatic dependent launch level
    (:func:`~treegen.kernels.tree_attention_triton.dependent_launches`; None: 2 on Hopper and newer).
    ``mid_tiles``: segments read by 17..64 rows x heads get 64-row tiles in a launch of their own (None:
    when they make at least ``_MIN_MID_PROGRAMS`` programs). ``half_partials``: 16-bit inputs' partial
    outputs stored in fp16 (half the bytes written and merged; a partial output is a convex combination
    of values, so it is in fp16's range whenever the values are below 65,504 in magnitude — values beyond
    that would turn a partial into inf; a bf16 input's partial rounds to 1/8 of its output's rounding, an
    fp16 input's as its output does). Measured on an H200: 0-16% less time a call on program-shaped trees.
    (Measured and not kept, H200, 256 leaves, ``profile_attention_trees_variants_*_h200.json``: ancestors read
    by few rows in the wide tiles, so that the leaves fuse the merge — uneven trees 113 -> 96 us, deep
    95 -> 122; 64-row wide tiles for every shared segment — deep 95 -> 87 us, heavy 102 -> 135.)
    ``pack_leaves``: at most this many fused leaf items share one 16-row tile (None: as many as fit while
    enough programs remain, see :func:`_leaf_pack`; 1: one item a tile). ``one_wave``: the shared segments' key
    chunks made longer where that fits their programs in one wave of the GPU in no more time (see
    :func:`_one_wave_chunk`). ``kv_quantized``: the plan is for an 8-bit cache (the library segment's rule
    measured for it, ``_LIBRARY_MIN_CHUNK_8BIT``)."""
    if group > 128:
        raise ValueError(f"{group} query heads per KV head is more than the 128 supported")
    if pack_leaves is not None and pack_leaves < 1:
        raise ValueError(f"pack_leaves must be at least 1, got {pack_leaves}")
    seg_start = np.asarray(segment_start, dtype=np.int64)
    seg_len = np.asarray(segment_len, dtype=np.int64)
    seg_pos = np.asarray(segment_pos, dtype=np.int64)
    n = len(seg_len)
    count = paths.count
    segs = np.flatnonzero((count > 0) & (seg_len > 0))  # ascending
    own = np.zeros(n, dtype=bool)
    own[paths.own] = True
    key_begin = np.zeros(n, dtype=np.int64)  # keys before this are the library kernel's
    lib = _library_segment(segs, count, own, paths, seg_start, seg_len, group, num_kv_heads, device,
                           kv_quantized) if library else None
    if lib is not None:
        key_begin[lib[0]] = lib[1].chunks * lib[1].chunk_len
        if key_begin[lib[0]] == seg_len[lib[0]]:
            segs = segs[segs != lib[0]]
    wide_m = 128 if int(count.max(initial=1)) * group >= 128 else 64
    rows_x_heads = count * group
    tile_m = np.zeros(n, dtype=np.int64)
    tile_m[segs] = np.where(rows_x_heads[segs] <= 16, 16, wide_m)
    # segments with 128-row tiles read by at most 64 rows x heads: one 64-row tile each (4 warps) in a launch of
    # their own, when they make at least half a wave of programs (segments x KV heads, before key chunks;
    # fewer: the extra launch costs more than the emptier 128-row tiles)
    mid = segs[(tile_m[segs] == 128) & (rows_x_heads[segs] <= 64)]
    if mid_tiles is None:
        mid_tiles = len(mid) * num_kv_heads >= _MIN_MID_PROGRAMS
    if mid_tiles:
        tile_m[mid] = 64
    m = tile_m[segs]
    rows_per_tile = m // group
    cnt = count[segs]
    tiles = _ceil_div(cnt, rows_per_tile)
    keys = seg_len[segs] - key_begin[segs]
    # balance: cut keys into chunks so the total work is spread over ~target_programs programs
    total = int((tiles * m // 16 * keys).sum()) * num_kv_heads // (wide_m // 16)
    if target_programs is None:  # (see the docstring)
        target_programs = _SMS
    chunk = max(8 * block_n, -(-total // max(target_programs, 1)))
    chunk = -(-chunk // block_n) * block_n
    narrow = m == 16
    if one_wave:
        chunk = _one_wave_chunk(chunk, keys[~narrow], tiles[~narrow] * num_kv_heads, block_n)
    # few narrow (single-branch) segments cannot fill the GPU with one program each: cut them finer
    seg_chunk = np.where(narrow & (int(narrow.sum()) * num_kv_heads < 2 * _SMS), 2 * block_n, chunk)
    # fused merge: the narrow segments are exactly the queries' own ones (an ancestor in the narrow
    # launch would run alongside its descendants), each read by its own queries only and short enough
    # (or numerous enough) to be one unsplit work item
    narrow_set = np.zeros(n, dtype=bool)
    narrow_set[segs[narrow]] = True
    fused = bool(fuse_merge and np.array_equal(narrow_set, own)
                 and not (own[paths.seg] & (paths.own[paths.row] != paths.seg)).any()
                 and (seg_len[segs[narrow]] <= np.maximum(seg_chunk[narrow], _FUSED_LEAF_MAX_KEYS)).all())
    if fused:
        seg_chunk = np.where(narrow, np.maximum(seg_len[segs], 1), seg_chunk)
    by_row = fused and lib is not None and lib[1].rows is None
    leaf_tail = (0, 0, 0)
    if by_row and key_begin[lib[0]] < seg_len[lib[0]]:
        # the library's keys past its chunks (fewer than its chunks) are attended by every fused leaf program
        # itself: no launch of their own for a few keys, no partial for each row to merge
        s, tail_begin = lib[0], int(key_begin[lib[0]])
        leaf_tail = (int(seg_start[s]) + tail_begin, int(seg_pos[s]) + tail_begin, int(seg_len[s]) - tail_begin)
        others = segs != s
        segs, m, rows_per_tile, cnt, tiles, keys, seg_chunk = (
            a[others] for a in (segs, m, rows_per_tile, cnt, tiles, keys, seg_chunk))
    # items: segment by segment (ascending), its key chunks, each chunk's row tiles
    chunks = np.maximum(_ceil_div(keys, seg_chunk), 0)
    row_offset = np.cumsum(cnt) - cnt  # where each segment's rows start in ``rows``
    first_partial = np.cumsum(cnt * chunks) - cnt * chunks  # chunk c of row i's partial: first + c * rows + i
    item_seg, k = expand(chunks * tiles)
    c, t = k // tiles[item_seg], k % tiles[item_seg]
    kb = key_begin[segs][item_seg] + c * seg_chunk[item_seg]
    first_row = t * rows_per_tile[item_seg]
    items = np.stack([seg_start[segs][item_seg], seg_pos[segs][item_seg], kb,
                      np.minimum(seg_len[segs][item_seg], kb + seg_chunk[item_seg]),
                      row_offset[item_seg] + first_row, np.minimum(rows_per_tile[item_seg], cnt[item_seg] - first_row),
                      first_partial[item_seg] + c * cnt[item_seg] + first_row], axis=1)
    num_partials = int((cnt * chunks).sum())
    # rows: each segment's rows (ascending), segment after segment
    by_seg = paths.by_segment()
    listed = np.zeros(n, dtype=bool)
    listed[segs] = True
    rows = paths.row[by_seg][listed[paths.seg[by_seg]]]
    # merging: each row's partials in path order (fused: the own segment's item merges the rest itself)
    lib_seg = lib[0] if lib is not None and not by_row else -1
    index = np.full(n, -1, dtype=np.int64)
    index[segs] = np.arange(len(segs))
    keep = paths.seg != paths.own[paths.row] if fused else np.ones(len(paths.seg), dtype=bool)
    p_seg, p_local, p_row = paths.seg[keep], paths.local[keep], paths.row[keep]
    p_index = index[p_seg]
    n_lib = np.where(p_seg == lib_seg, lib[1].chunks if lib is not None else 0, 0)
    n_part = np.where(p_index >= 0, chunks[np.maximum(p_index, 0)], 0)
    per_pair = n_lib + n_part
    pair, k = expand(per_pair)  # entry k of each pair: its library chunks first, then its own key chunks
    from_lib = k < n_lib[pair]
    lib_rows = lib[1].num_rows if lib is not None else 0
    merge_idx = np.where(from_lib, -1 - (k * lib_rows + p_local[pair]),
                         first_partial[np.maximum(p_index[pair], 0)] + p_local[pair]
                         + (k - n_lib[pair]) * cnt[np.maximum(p_index[pair], 0)])
    merge_ptr = np.zeros(paths.num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(p_row, weights=per_pair, minlength=paths.num_rows).astype(np.int64), out=merge_ptr[1:])

    def i32(x) -> Tensor:  # (through numpy: torch.tensor of a Python list costs ~4x more host time)
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(device)

    def launch(m, table):
        if longest_first:  # programs start in table order: the longest first, the short ones fill in after
            table = table[np.argsort(table[:, 2] - table[:, 3], kind="stable")]
        # rows [o, o + n) of ``rows`` consecutive query rows in every item: hand the kernel the first one
        # (a segment's rows increase: consecutive when the last is n - 1 past the first)
        first, count = table[:, 4], table[:, 5]
        direct = bool(np.all(rows[first + count - 1] - rows[first] == count - 1))
        if direct:
            table = table.copy()
            table[:, 4] = rows[first]
        shape = _launch_shape(m, table, num_kv_heads, block_n, num_stages or 3, leaf_shape)
        pack = _leaf_pack(table, group, num_kv_heads, pack_leaves) if fused and m == 16 else 1
        if pack > 1:  # consecutive items (of similar length: longest first) share a tile; empty ones pad the last
            table = np.concatenate([table, np.zeros((-len(table) % pack, 7), dtype=table.dtype)])
            table = table.reshape(-1, 7 * pack)
        return WorkList(i32(table), m, *shape, direct_rows=direct, pack=pack)

    item_m = m[item_seg]
    heights, first_at = np.unique(m, return_index=True)
    heights = heights[np.argsort(first_at)].tolist()  # in the order segments first use them
    heights.sort(key=lambda h: (h == 16) if fused else h)  # fused: own items last
    return TritonPlan(
        launches=tuple(launch(h, items[item_m == h]) for h in heights),
        rows=i32(rows if len(rows) else [0]),
        merge_ptr=i32(merge_ptr),
        merge_idx=i32(merge_idx if len(merge_idx) else [0]),
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


def _makespan(keys: np.ndarray, programs: np.ndarray, chunk: int) -> int:
    """Estimated time, in keys, of the shared segments' programs when their keys are cut into chunks of ``chunk``
    (the last one of a segment shorter): ``programs[i]`` programs (row tiles x KV heads) for each chunk of
    segment ``i`` of ``keys[i]`` keys, each costing its keys plus ``_PROGRAM_OVERHEAD_KEYS``, started longest first
    on ``_SMS`` SMs (one program each: a 128-row program fills an SM's registers), each on the first SM free."""
    n = _ceil_div(keys, chunk)
    last = keys - (n - 1) * chunk
    costs = np.sort(np.concatenate([np.repeat(chunk, int(((n - 1) * programs).sum())),
                                    np.repeat(last, programs)]))[::-1] + _PROGRAM_OVERHEAD_KEYS
    if len(costs) <= _SMS:
        return int(costs[0]) if len(costs) else 0
    free = [0] * _SMS  # (a heap of the SMs' finish times: only called with at most ~2 waves of programs)
    for cost in costs.tolist():
        heapq.heapreplace(free, free[0] + cost)
    return max(free)


def _one_wave_chunk(chunk: int, keys: np.ndarray, programs: np.ndarray, block_n: int) -> int:
    """``chunk``, or the shortest longer one (a multiple of ``block_n``) that fits the shared segments' programs
    (``programs[i]`` for each chunk of segment ``i`` of ``keys[i]`` keys) in one wave of ``_SMS``, when that
    wave's :func:`_makespan` is at most ``_ONE_WAVE_SLACK`` times as long. One wave takes fewer partials to merge,
    and lets the leaves' launch that follows start beside it on the SMs it leaves free (a programmatic dependent
    launch starts once every program of the launch before has started), which the estimate does not count:
    Phi-4-mini's 24/8 heads over 256 leaves below a 2K prompt, 56 tile programs x 3 chunks of 960, 960 and 128
    keys = 168 programs (estimate 1,088) against 2 chunks of 1,024 = 112 (estimate 1,152): the shared launch
    22.5 -> 26.2 us, but the call 54.2 -> 49.3 us on an H100 (``profile_attention_trees_decode_variants_h100.json``)."""
    keys, programs = keys[keys > 0], programs[keys > 0]
    if not len(keys) or int((_ceil_div(keys, chunk) * programs).sum()) <= _SMS or int(programs.sum()) > _SMS:
        return chunk
    lo, hi = chunk, -(-int(keys.max()) // block_n) * block_n  # hi fits: one chunk a segment
    while hi - lo > block_n:  # the shortest chunk (multiple of block_n) whose programs fit one wave
        mid = (lo + hi) // 2 // block_n * block_n
        if int((_ceil_div(keys, mid) * programs).sum()) <= _SMS:
            hi = mid
        else:
            lo = mid
    return hi if _makespan(keys, programs, hi) <= _ONE_WAVE_SLACK * _makespan(keys, programs, chunk) else chunk


def _launch_shape(block_m: int, items: np.ndarray, num_kv_heads: int, block_n: int, num_stages: int,
                  leaf_shape: tuple[int, int, int] | None = None):
    """(block_n, num_warps, num_stages) of a launch. A thousand or more 16-row programs (branches' own
    keys, a few blocks each) are bound by how many programs an SM holds (their shared-memory buffers):
    one warp, 32-key blocks, two pipeline buffers (``leaf_shape`` replaces that triple: a tuning knob). (Fetching a leaf's ancestor partials before its
    attention, to shorten each program's chain of dependent loads, measured no faster.) Measured on an H100, Llama-3-8B heads with 1024
    leaves of 64 keys: 123 us vs 163 us (64-key blocks, 4 warps, 3 stages); MHA 32/32: 396 vs 528 us; 8/1
    heads under a 16K root: 23 vs 33 us; equal to the defaults at 512 keys. Fewer programs, or longer items
    (a whole sequence's keys in the unshared baseline: one warp there was slower), keep the defaults.
    The shape does not depend on the items' length otherwise, so a decode phase of any length reuses the
    kernel variant compiled by a shorter one. This variant uses 255 registers a thread (so ~8 programs an
    SM); capping them (``maxnreg`` 192/168/128) spills and was 7-50% slower (batch 256 Llama-3 heads:
    71/75/91 vs 66 us)."""
    if _many_short_items(block_m, items, num_kv_heads):
        return leaf_shape or (32, 1, 2)
    return block_n, (8 if block_m == 128 else 4), num_stages


def _many_short_items(block_m: int, items: np.ndarray, num_kv_heads: int) -> bool:
    """A 16-row launch of ``_MANY_PROGRAMS`` or more programs (items x KV heads), none over ``_FUSED_LEAF_MAX_KEYS``
    keys: the one-warp shape of :func:`_launch_shape`."""
    return block_m == 16 and len(items) * num_kv_heads >= _MANY_PROGRAMS and _longest(items) <= _FUSED_LEAF_MAX_KEYS


def _item_keys(items: np.ndarray) -> np.ndarray:
    """The keys each item of ``items`` reads (an item: ``[.., .., kb, ke, ...]``)."""
    return items[:, 3] - items[:, 2]


def _longest(items: np.ndarray) -> int:
    """The most keys an item of ``items`` reads."""
    return int(_item_keys(items).max()) if len(items) else 0


def _leaf_pack(items: np.ndarray, group: int, num_kv_heads: int, limit: int | None) -> int:
    """How many fused leaf items share one 16-row tile: a power of two, as many as their rows x query heads fit (a
    decode leaf of Llama-3's 32/8 heads is 4 of the 16 rows: 4 leaves a tile; 24/8: 4 of 5; MHA 16), at most
    ``limit``; by default (``limit`` None) only down to about ``_PACKED_PROGRAMS`` programs (at least one item a
    program) — except a launch of fewer than ``_MANY_PROGRAMS`` items x KV heads of at most
    ``_FUSED_LEAF_MAX_KEYS`` keys, which packs all that fit.
    A one-item tile computes its padding rows too — loading them, rescaling, merging the ancestors'
    partials and storing: ~2,200 of the ~2,950 instructions of a 32-key leaf's program (ncu on an H100,
    Llama-3-8B decode shape); a packed tile pays that once for all its items, and attends each item's
    keys in turn with its own rows visible (the others masked). But its items' keys are read one item
    after another, so one-warp programs keep about 8 an SM. Measured on an H200 (``profile_attention_trees.py
    --trees decode``, a 2K prompt over leaves of 1-64 keys, every pack of 1-4 at 128-1,024 leaves,
    ``profile_attention_trees_decode_pack_sweep_h200.json``), the best pack made ~1,024 programs: 32/8 x 128 heads
    p1 / p2 / p4 / p4 at 128 / 256 / 512 / 1,024 leaves, 24/8 the same (p5, all 15 of its rows, 6-7% slower than
    p4 at 512 and 1,024: hence powers of two), 16/4 at 256 / 512 / 1,024 p1 / p2 / p4, MHA 32/32 p4 at 128 and
    p16 at 512 and 1,024; the rule before (packs down to 4 programs an SM) lost 6-25% where it packed more (32/8 at
    256 leaves p3 48.3 us against p2 45.3, MHA at 256 p15 106 against p4 80). Launches of fewer items (a 4-warp
    shape) pack all they fit: 16/4 at 128 leaves p4 22.9 us against p1 30.0, 8/1 at 256 and 512 p2 22.4 and 29.2
    against p1 25.4 and 31.8. (Before, on an H100, ``bench_leaf_pack.py``: packs of 4 at ~4 programs an SM and
    above measured 1.07x geomean; 32/8 x 128 at 128 leaves of 128 keys 62 -> 70 us packed by 4, 24/8 54 -> 79 —
    one-warp launches of 1,024 items, which this rule leaves unpacked.) Long leaves gain least and can lose (the
    packed path reads every key block through the masked loop, without TMA): 9/3 x 64 FP8 at 1,024 leaves of 128
    keys 83 -> 94 us (H100, packed by 5 under the rule before; this one packs them by 2). The pack is part of the
    plan's shape key, so kept phase graphs of phases on either side of a threshold are captured apart (capture
    time only).
    Items of more than ``_PACK_MAX_MEAN_KEYS`` keys on average (as planned: a decode phase's leaves with the keys they
    may gain) run one a tile: their fixed cost is small beside their keys, and a packed tile reads its items' keys
    one after another through the masked loop. ``bench_attention_trees.py`` on an H200, the wide class (a
    512-key prefix over leaves of 16-512 keys, 264-276 on average) packed by 2-8 against one a tile (the run of
    2026-11-26, before leaves were packed; ``attention_trees_h200.json`` and ``..._stop64_h200.json``, two machines of
    one kind): 16/8 x 256 heads 222 vs 165 us at 256 leaves and 840 vs 603 at 1,024, 9/3 x 64 45 vs 35, MHA 327 vs 286
    and 32/8 x 128 102 vs 96 at 256 (equal at 1,024); the classes whose leaves average 31-72 keys gained from
    packing in the same runs (deep, 1,020 leaves: 32/8 226 vs 259, 16/8 x 256 350 vs 448)."""
    if limit is None and len(items) and float(_item_keys(items).mean()) > _PACK_MAX_MEAN_KEYS:
        return 1
    pack = 16 // max(int(items[:, 5].max(initial=1)) * group, 1)
    if limit is None and (len(items) * num_kv_heads >= _MANY_PROGRAMS or _longest(items) > _FUSED_LEAF_MAX_KEYS):
        pack = min(pack, len(items) * num_kv_heads // _PACKED_PROGRAMS)
    pack = max(1, min(pack, limit or pack, len(items)))
    return 1 << (pack.bit_length() - 1) if limit is None else pack


def _hopper_or_newer(device) -> bool:
    """A CUDA device of compute capability 9 (Hopper) or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_default(device) -> bool:
    """TMA tensor-descriptor loads on Hopper and newer (and in the interpreter, which emulates them)."""
    return torch.device(device).type != "cuda" or _hopper_or_newer(device)


def _pdl_default(device) -> int:
    """Programmatic dependent launch between the launches of one call on Hopper and newer (not in the
    interpreter): 0 none, 1 for the launches that read the one before (fused leaves, the merge), 2 for
    every launch after the first; ``TREEGEN_PDL`` overrides."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not _hopper_or_newer(device):
        return 0
    return int(os.environ.get("TREEGEN_PDL", "2"))
