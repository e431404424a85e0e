"""Triton tree attention: every segment's KV is read once for all query rows below it.

Two kinds of launch per layer, whatever the tree's depth:

1. ``_segment_attention_kernel`` — one program per *work item* × KV head. A work item is a tile of
   query rows below one segment (rows × the query heads sharing the KV head, folded into the tile's
   M axis: GQA/MQA become one matrix-matrix product) against one *chunk* of that segment's keys
   (long segments are split along the key axis so few queries × a long prefix still fill the GPU,
   flash-decoding style). Keys are visible iff ``key_pos <= query_pos`` (ancestors fully, the query's
   own segment causally — the same rule as the reference). It writes a partial output and LSE.
   It is launched once per tile height (16 rows for segments read by few queries, 64/128 for shared
   ones; see :class:`TritonPlan`), each launch with its own key block, warps and pipeline depth
   (``_launch_shape``: thousands of branches' own short segments run as small one-warp programs).
2. ``_merge_kernel`` — one program per query row merges that row's partials along its whole
   root-to-leaf path (any depth, unbalanced trees) with the log-sum-exp rule, all heads at once.

When every query's own segment is a single 16-row work item (decode: one leaf per branch), that
launch runs last and its items merge their rows' ancestor partials themselves (``fused_merge``): two
launches per layer instead of three, and no partial written for the leaf.

LSE convention: partial LSEs are stored as **natural log** in fp32 (the kernel works in base 2
internally with ``exp2`` and converts on store). A work item with no visible key stores ``-inf``
and output 0; the merge skips such partials without NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from treegen.kernels.library_attention import LibrarySegment, segment_attention

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

_LN2 = math.log(2.0)
# a query's own segment up to this many keys is read by one program when that lets it merge the
# query's partials itself (fewer launches beat splitting so short a segment)
_FUSED_LEAF_MAX_KEYS = 512
# a shared segment goes to the library kernel (library_attention.py) when it is read by at least this many
# query rows x heads per KV head and has at least this many keys; its keys are cut into chunks of at least
# _LIBRARY_MIN_CHUNK so that ~one wave of 128-row tiles fills an H100's 132 SMs (measured best: see there)
_LIBRARY_MIN_ROWS = 512
_LIBRARY_MIN_KEYS = 1024
_LIBRARY_MIN_CHUNK = 512
# ... and only when it holds this share of all shared-segment work (rows x keys). Measured on an H100, 8/1
# heads: 16 roots of 2560 keys x 64 branches, one of them by cuDNN: 76 us vs 49 all-Triton; a 2K root over
# 16 problems of 512 keys (80% of the work): 56 vs 55 us
_LIBRARY_MIN_SHARE = 0.9
# ... and when at most this many chunks fill the GPU: each is a partial every row merges. 64 branches x 8/1
# heads under a 16K root needs 32: 38 us vs 32 all-Triton; 8 (64 x 4K): 23 vs 26 us
_LIBRARY_MAX_CHUNKS = 8
_SMS = 132


def triton_available() -> bool:
    return triton is not None
_LOG2E = 1.0 / _LN2


@dataclass(frozen=True)
class WorkList:
    """Work items launched together with one tile height.

    ``work: [num_items, 7] int32`` — per item: first cache slot of the segment, absolute position of
    the segment's first key, key range begin/end within the segment, offset into ``rows`` of the tile's
    first query row, number of query rows, first partial entry. E.g. a root of 40 keys at slots 0..39
    read by query rows [0, 1] in one chunk → ``[[0, 0, 0, 40, 0, 2, 0]]``.
    ``block_m`` — tile height (query rows x query heads per KV head); ``block_n`` — keys per block of the
    key loop (fp16/bf16; fp32 inputs use half); ``num_warps`` and ``num_stages`` (software-pipeline depth
    of the key loop) for the launch.
    """

    work: Tensor
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


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


def _library_segment(segs, rows_of, paths, segment_start, segment_len, group, num_kv_heads, device):
    """The shared segment with the most work among those large enough for the library kernel, cut into
    chunks for ~one wave of 128-row tiles; None if there is none or it is not most of the shared work.
    Only ancestors of every row reading it qualify (no row's own segment: those need the causal mask)."""
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
    chunks = max(1, min(round(_SMS / tiles), segment_len[s] // _LIBRARY_MIN_CHUNK))
    if chunks > _LIBRARY_MAX_CHUNKS:
        return None
    rows = rows_of[s]
    every = rows == list(range(len(paths)))
    return s, LibrarySegment(start=segment_start[s], chunk_len=segment_len[s] // chunks, chunks=chunks,
                             num_rows=len(rows),
                             rows=None if every else torch.tensor(rows, dtype=torch.int64, device=device))


def plan_triton(
    *,
    segment_start: Sequence[int],
    segment_len: Sequence[int],
    segment_pos: Sequence[int],
    rows_of: dict[int, list[int]],
    paths: list[list[int]],
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
) -> TritonPlan:
    """Build the work tables. ``rows_of[s]``: query rows below segment ``s`` (own rows included);
    ``paths[q]``: segments on query row ``q``'s root-to-own-segment path. ``target_programs``: how
    many programs the key-axis split aims for: by default one per SM of an H100 (132) for large work
    (fewer, longer programs write fewer partials) and two per SM for small work — measured with
    ``benchmarks/bench_attention.py --sweep`` (results in benchmarks/results/attention_sweep_h100.json).
    ``library``: give the largest shared segment to the library kernel (``library_attention.py``) if
    one is large enough; the Triton launches then read only its last ``< chunks`` keys, if any."""
    if group > 128:
        raise ValueError(f"{group} query heads per KV head is more than the 128 supported")
    segs = sorted(s for s in rows_of if segment_len[s] > 0)
    key_begin = {s: 0 for s in segs}  # keys before this are the library kernel's
    lib = _library_segment(segs, rows_of, paths, segment_start, segment_len, group, num_kv_heads, device) \
        if library else None
    if lib is not None:
        key_begin[lib[0]] = lib[1].chunks * lib[1].chunk_len
        if key_begin[lib[0]] == segment_len[lib[0]]:
            segs.remove(lib[0])
    wide_m = 128 if max((len(r) for r in rows_of.values()), default=1) * group >= 128 else 64
    tile_m = {s: 16 if len(rows_of[s]) * group <= 16 else wide_m for s in segs}
    tiles = {s: -(-len(rows_of[s]) // (tile_m[s] // group)) for s in segs}
    # balance: cut keys into chunks so the total work is spread over ~target_programs programs
    total = sum(tiles[s] * tile_m[s] // 16 * (segment_len[s] - key_begin[s]) for s in segs) * num_kv_heads // (wide_m // 16)
    if target_programs is None:
        target_programs = 132 if total >= 132 * 1024 else 264
    chunk = max(8 * block_n, -(-total // max(target_programs, 1)))
    chunk = -(-chunk // block_n) * block_n
    # few narrow (single-branch) segments cannot fill the GPU with one program each: cut them finer
    narrow = sum(1 for s in segs if tile_m[s] == 16) * num_kv_heads
    seg_chunk = {s: 2 * block_n if tile_m[s] == 16 and narrow < 2 * 132 else chunk for s in segs}
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
    work: dict[int, list] = {}
    rows, partial_base, local_index = [], {}, {}
    num_partials = 0
    for s in segs:
        row_offset = len(rows)
        rows.extend(rows_of[s])
        local_index[s] = {q: i for i, q in enumerate(rows_of[s])}
        count, rows_per_tile = len(rows_of[s]), tile_m[s] // group
        for c, kb in enumerate(range(key_begin[s], segment_len[s], seg_chunk[s])):
            ke = min(segment_len[s], kb + seg_chunk[s])
            partial_base[(s, c)] = num_partials
            for t in range(tiles[s]):
                first = t * rows_per_tile
                work.setdefault(tile_m[s], []).append([segment_start[s], segment_pos[s], kb, ke, row_offset + first,
                                                       min(rows_per_tile, count - first), num_partials + first])
            num_partials += count
    merge_ptr, merge_idx = [0], []
    lib_index = {q: i for i, q in enumerate(rows_of[lib[0]])} if lib else {}
    for q, path in enumerate(paths):
        for s in path[:-1] if fused else path:  # fused: the own segment's item merges the rest itself
            if lib and s == lib[0]:
                merge_idx.extend(-1 - (c * lib[1].num_rows + lib_index[q]) for c in range(lib[1].chunks))
            if s in local_index:
                chunks = -(-(segment_len[s] - key_begin[s]) // seg_chunk[s])
                merge_idx.extend(partial_base[(s, c)] + local_index[s][q] for c in range(chunks))
        merge_ptr.append(len(merge_idx))

    def i32(x, shape=None):
        t = torch.tensor(x, dtype=torch.int32)
        return (t.reshape(shape) if shape else t).to(device)

    order = sorted(work.items(), key=lambda mi: (mi[0] == 16) if fused else mi[0])  # fused: own items last
    return TritonPlan(
        launches=tuple(WorkList(i32(items, (-1, 7)), m, *_launch_shape(m, items, num_kv_heads, block_n, num_stages or 3))
                       for m, items in order),
        rows=i32(rows or [0]),
        merge_ptr=i32(merge_ptr),
        merge_idx=i32(merge_idx or [0]),
        num_partials=num_partials,
        group=group,
        use_tma=_tma_default(device) if use_tma is None else use_tma,
        warp_specialize=warp_specialize,
        fused_merge=fused,
        library=lib[1] if lib else None,
    )


def _launch_shape(block_m: int, items: list, num_kv_heads: int, block_n: int, num_stages: int):
    """(block_n, num_warps, num_stages) of a launch. A thousand or more 16-row programs (branches' own
    keys, a few blocks each) are bound by how many programs an SM holds (their shared-memory buffers):
    one warp, 32-key blocks, two pipeline buffers. (Fetching a leaf's ancestor partials before its
    attention, to shorten each program's chain of dependent loads, measured no faster.) Measured on an H100, Llama-3-8B heads with 1024
    leaves of 64 keys: 123 us vs 163 us (64-key blocks, 4 warps, 3 stages); MHA 32/32: 396 vs 528 us; 8/1
    heads under a 16K root: 23 vs 33 us; equal to the defaults at 512 keys. Fewer programs, or longer items
    (a whole sequence's keys in the unshared baseline: one warp there was slower), keep the defaults.
    The shape does not depend on the items' length otherwise, so a decode phase of any length reuses the
    kernel variant compiled by a shorter one."""
    longest = max((ke - kb for _, _, kb, ke, *_ in items), default=0)
    if block_m == 16 and len(items) * num_kv_heads >= 1024 and longest <= _FUSED_LEAF_MAX_KEYS:
        return 32, 1, 2
    return block_n, (8 if block_m == 128 else 4), num_stages


def _tma_default(device) -> bool:
    """TMA tensor-descriptor loads on Hopper and newer (and in the interpreter, which emulates them)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= 9


if triton is not None:

    @triton.jit
    def _online_softmax_step(acc, m_i, l_i, qk, v, scale_log2, MAY_BE_EMPTY: tl.constexpr, PRECISION: tl.constexpr):
        """Fold one block of raw scores ``qk`` [M, N] (invisible keys -inf) and values ``v`` [N, D] into the
        running base-2 max ``m_i``, sum ``l_i`` and output ``acc``. The base-2 score is ``qk * scale_log2``,
        applied in one FMA with the max subtraction (the max is taken on raw scores: the scale is positive).
        MAY_BE_EMPTY: a row may have seen no visible key yet (max -inf), which must not turn into NaN."""
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
        if MAY_BE_EMPTY:
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(qk * scale_log2 - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _attend_blocks(acc, m_i, l_i, q, qpos, K, V, stride_kt, pos0, lo, hi, scale_log2,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                       PRECISION: tl.constexpr):
        """Online-softmax over keys [lo, hi) of a segment (base-2 running max ``m_i`` and sum ``l_i``).
        MASKED=False: every key of every block is visible to every row (no bounds or causal checks)."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kv_off = offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
            if MASKED:
                key_ok = offs_n < hi
                k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
                v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(K + kv_off)
                v = tl.load(V + kv_off)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if MASKED:
                visible = key_ok[None, :] & ((pos0 + offs_n)[None, :] <= qpos[:, None])
                qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(acc, m_i, l_i, qk, v, scale_log2, True, PRECISION)
        return m_i, l_i, acc

    @triton.jit
    def _attend_blocks_tma(acc, m_i, l_i, q, K_desc, V_desc, row0, col, lo, hi, scale_log2,
                           BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr):
        """Unmasked online-softmax over keys [lo, hi) (whole blocks) with TMA tensor-descriptor loads;
        ``row0`` is the segment's first cache slot, ``col`` the KV head's first column."""
        col = col.to(tl.int32)
        for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            row = (row0 + start).to(tl.int32)
            k = K_desc.load([row, col])
            v = V_desc.load([row, col])
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            # a fully visible block gives every row a finite score, so the max is never -inf here
            m_i, l_i, acc = _online_softmax_step(acc, m_i, l_i, qk, v, scale_log2, False, PRECISION)
        return m_i, l_i, acc

    @triton.jit
    def _segment_attention_kernel(
        Q, K, V, K_desc, V_desc, O_part, LSE_part, work, rows, q_pos, merge_ptr, merge_idx, Out,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ph, stride_lt, stride_ot, stride_oh,
        scale_log2,
        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr, FUSE_MERGE: tl.constexpr,
        MERGE_J: tl.constexpr, HAS_LIB: tl.constexpr,
    ):
        wid = tl.program_id(0)
        kvh = tl.program_id(1)
        slot0 = tl.load(work + wid * 7 + 0)
        pos0 = tl.load(work + wid * 7 + 1)
        kb = tl.load(work + wid * 7 + 2)
        ke = tl.load(work + wid * 7 + 3)
        row_begin = tl.load(work + wid * 7 + 4)
        row_count = tl.load(work + wid * 7 + 5)
        part0 = tl.load(work + wid * 7 + 6)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        local = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = local < row_count
        qrow = tl.load(rows + row_begin + local, mask=row_ok, other=0)
        qpos = tl.load(q_pos + qrow, mask=row_ok, other=-1)
        q = tl.load(Q + qrow[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # keys past the tile's last query position are invisible to all its rows: stop there;
        # keys before its first query position (and inside the chunk) are visible to all: no mask
        hi = tl.minimum(ke, tl.max(qpos, axis=0) - pos0 + 1)
        qmin = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
        full = tl.minimum(hi, qmin - pos0 + 1)
        full = tl.maximum(kb, kb + (full - kb) // BLOCK_N * BLOCK_N)
        kv_base = slot0.to(tl.int64) * stride_kt + kvh * stride_kh
        if USE_TMA:
            # a fully visible block has a finite score in every row, so the running max is finite
            m_i, l_i, acc = _attend_blocks_tma(acc, m_i, l_i, q, K_desc, V_desc, slot0, kvh * HEAD_DIM, kb, full,
                                               scale_log2, BLOCK_N, WARP_SPECIALIZE, PRECISION)
        else:
            m_i, l_i, acc = _attend_blocks(acc, m_i, l_i, q, qpos, K + kv_base, V + kv_base, stride_kt, pos0, kb,
                                           full, scale_log2, HEAD_DIM, BLOCK_N, False, PRECISION)
        m_i, l_i, acc = _attend_blocks(acc, m_i, l_i, q, qpos, K + kv_base, V + kv_base, stride_kt, pos0, full, hi,
                                       scale_log2, HEAD_DIM, BLOCK_N, True, PRECISION)

        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        if FUSE_MERGE:  # this item is its rows' own segment: merge their ancestors' partials and finish
            out = _merge_partials(out, lse, O_part, LSE_part, merge_ptr, merge_idx, qrow, head, row_ok, offs_d,
                                  stride_pt, stride_ph, stride_lt,
                                  O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
                                  MERGE_J, HAS_LIB)
            tl.store(Out + qrow[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = (part0 + local).to(tl.int64)
            tl.store(O_part + part[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :], out,
                     mask=row_ok[:, None])
            tl.store(LSE_part + part * stride_lt + head, lse, mask=row_ok)

    @triton.jit
    def _load_partials(p, ok, head, offs_d, O_part, LSE_part, stride_pt, stride_ph, stride_lt,
                       O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
                       HAS_LIB: tl.constexpr):
        """(natural-log LSE, fp32 output [..., D]) of partial entries ``p`` (any shape; ``head`` and ``ok``
        broadcast to it). ``p >= 0``: a Triton partial; ``p < 0``: the library segment's partial
        ``-1 - p = chunk * lib_rows + row``, read through the library output's own strides."""
        p64 = tl.maximum(p, 0).to(tl.int64)
        part_ok = ok & (p >= 0)
        lse = tl.load(LSE_part + p64 * stride_lt + head, mask=part_ok, other=float("-inf"))
        o = tl.load(O_part + tl.expand_dims(p64 * stride_pt + head * stride_ph, -1) + offs_d,
                    mask=tl.expand_dims(part_ok, -1), other=0.0)
        if HAS_LIB:
            lib_ok = ok & (p < 0)
            e = tl.where(lib_ok, -1 - p, 0)
            c = (e // lib_rows).to(tl.int64)
            r = (e % lib_rows).to(tl.int64)
            lse_l = tl.load(LSE_lib + c * lib_sl_c + r * lib_sl_r + head * lib_sl_h, mask=lib_ok, other=float("-inf"))
            o_l = tl.load(O_lib + tl.expand_dims(c * lib_so_c + r * lib_so_r + head * lib_so_h, -1) + offs_d,
                          mask=tl.expand_dims(lib_ok, -1), other=0.0)
            lse = tl.where(lib_ok, lse_l, lse)
            o = tl.where(tl.expand_dims(lib_ok, -1), o_l.to(tl.float32), o)
        return lse, o

    @triton.jit
    def _merge_partials(out, lse, O_part, LSE_part, merge_ptr, merge_idx, qrow, head, row_ok, offs_d,
                        stride_pt, stride_ph, stride_lt,
                        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
                        MERGE_J: tl.constexpr, HAS_LIB: tl.constexpr):
        """Fold the partials listed for each row's query (natural-log LSE) into ``out``/``lse``; returns
        the merged output. Rows have different numbers of partials: each stops at its own end. MERGE_J
        partials of every row are fetched together (independent loads), so a row below a long prefix
        split into many chunks does not wait for its partials one at a time."""
        begin = tl.load(merge_ptr + qrow, mask=row_ok, other=0)
        end = tl.load(merge_ptr + qrow + 1, mask=row_ok, other=0)
        m = lse
        l_sum = tl.where(lse > float("-inf"), 1.0, 0.0)
        acc = out * l_sum[:, None]
        offs_j = tl.arange(0, MERGE_J)
        for j0 in range(0, tl.max(end - begin, axis=0), MERGE_J):
            idx = begin[:, None] + j0 + offs_j[None, :]
            ok = row_ok[:, None] & (idx < end[:, None])
            p = tl.load(merge_idx + idx, mask=ok, other=0)
            lse_j, o_j = _load_partials(p, ok, head[:, None], offs_d, O_part, LSE_part, stride_pt, stride_ph, stride_lt,
                                        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r,
                                        lib_sl_h, HAS_LIB)
            # the LSE merge rule of _lse_merge_step, for MERGE_J partials at once
            m_new = tl.maximum(m, tl.max(lse_j, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp(m - m_safe)
            b = tl.exp(lse_j - m_safe[:, None])
            l_sum = l_sum * a + tl.sum(b, axis=1)
            acc = acc * a[:, None] + tl.sum(b[:, :, None] * o_j, axis=1)
            m = m_new
        return acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]

    @triton.jit
    def _lse_merge_step(m, l_sum, acc, lse, o):
        """Fold one partial (output ``o`` [R, D], natural-log LSE ``lse`` [R]; -inf: empty) into the
        running max ``m``, sum ``l_sum`` and unnormalised output ``acc``, without NaN on empty sides."""
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        b = tl.exp(lse - m_safe)
        return m_new, l_sum * a + b, acc * a[:, None] + o * b[:, None]

    @triton.jit
    def _merge_kernel(
        O_part, LSE_part, merge_ptr, merge_idx, Out,
        num_heads, stride_pt, stride_ph, stride_lt, stride_ot, stride_oh,
        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
        BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_LIB: tl.constexpr,
    ):
        q = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        h_ok = offs_h < num_heads
        begin = tl.load(merge_ptr + q)
        end = tl.load(merge_ptr + q + 1)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for i in range(begin, end):
            p = tl.load(merge_idx + i) + offs_h * 0  # one entry per head: masks need its shape
            lse, o = _load_partials(p, h_ok, offs_h, offs_d, O_part, LSE_part, stride_pt, stride_ph, stride_lt,
                                    O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r,
                                    lib_sl_h, HAS_LIB)
            m, l, acc = _lse_merge_step(m, l, acc, lse, o)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(Out + q.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=h_ok[:, None])


SUPPORTED_HEAD_DIMS = (64, 128)


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TritonPlan, query_pos: Tensor,
                          scale: float) -> Tensor:
    """Triton tree attention. Shapes as :func:`~treegen.kernels.tree_attention.tree_attention_reference`;
    ``query_pos: [num_queries]`` int32 or int64 absolute positions."""
    if triton is None:
        raise RuntimeError("the Triton tree-attention kernel needs the triton package")
    num_q, num_heads, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the Triton tree-attention kernel supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension and k/v equal strides")
    num_kv = k_cache.shape[1]
    out = torch.empty_like(q)
    if num_q == 0:
        return out
    # fp32 tiles are twice as large: halve the key block and the pipeline depth to fit shared memory
    wide = q.element_size() > 2
    o_part = torch.empty(max(plan.num_partials, 1), num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(max(plan.num_partials, 1), num_heads, dtype=torch.float32, device=q.device)
    if plan.library is not None:  # [chunks, heads, rows, D] / [chunks, heads, rows], read through their strides
        o_lib, lse_lib = segment_attention(q, k_cache, v_cache, plan.library, scale)
        lib_args = (o_lib, lse_lib, plan.library.num_rows, o_lib.stride(0), o_lib.stride(2), o_lib.stride(1),
                    lse_lib.stride(0), lse_lib.stride(2), lse_lib.stride(1))
    else:
        lib_args = (o_part, lse_part, 1, 0, 0, 0, 0, 0, 0)
    for launch in plan.launches:
        block_n = launch.block_n // 2 if wide else launch.block_n
        if plan.use_tma:
            # 2-D views [slots, kv_heads * head_dim]: one block = BLOCK_N slots x one KV head
            k_desc, v_desc = (TensorDescriptor(c, [c.shape[0], num_kv * head_dim], [c.stride(0), 1], [block_n, head_dim])
                              for c in (k_cache, v_cache))
        else:
            k_desc = v_desc = k_cache  # unused
        _segment_attention_kernel[(launch.work.shape[0], num_kv)](
            q, k_cache, v_cache, k_desc, v_desc, o_part, lse_part, launch.work, plan.rows, query_pos,
            plan.merge_ptr, plan.merge_idx, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), o_part.stride(0), o_part.stride(1),
            lse_part.stride(0), out.stride(0), out.stride(1), scale * _LOG2E, *lib_args,
            GROUP=plan.group, HEAD_DIM=head_dim, BLOCK_M=launch.block_m, BLOCK_N=block_n,
            USE_TMA=plan.use_tma, WARP_SPECIALIZE=plan.warp_specialize,
            PRECISION="ieee" if wide else "tf32",  # fp32 inputs get full fp32 products (no TF32)
            FUSE_MERGE=plan.fused_merge and launch.block_m == 16,
            # a leaf below a 16K prefix split 32 ways: 64 branches 8/1 heads 32 us (J=8) vs 36 (4) vs 42 (1), H100;
            # [16, J, head_dim] fp32 must fit the launch's registers: one warp gets J=1
            MERGE_J=8 if launch.num_warps >= 4 else 1, HAS_LIB=plan.library is not None,
            num_warps=launch.num_warps, num_stages=min(2, launch.num_stages) if wide else launch.num_stages,
        )
    if plan.fused_merge:
        return out
    _merge_kernel[(num_q,)](
        o_part, lse_part, plan.merge_ptr, plan.merge_idx, out,
        num_heads, o_part.stride(0), o_part.stride(1), lse_part.stride(0), out.stride(0), out.stride(1), *lib_args,
        BLOCK_H=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, HAS_LIB=plan.library is not None, num_warps=4,
    )
    return out
