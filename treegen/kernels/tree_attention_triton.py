"""Triton tree attention: every segment's KV is read once for all query rows below it.

Two kernels, launched once per tile height, whatever the tree's depth (plus, on Hopper, one cuDNN call for a
large shared prefix: :mod:`treegen.kernels.library_attention`, merged like any other partial):

1. ``_segment_attention_kernel`` — one program per *work item* × KV head. A work item is a tile of
   query rows below one segment (rows × the query heads sharing the KV head, folded into the tile's
   M axis: GQA/MQA become one matrix-matrix product) against one *chunk* of that segment's keys
   (long segments are split along the key axis so few queries × a long prefix still fill the GPU,
   flash-decoding style). Keys are visible iff ``key_pos <= query_pos`` (ancestors fully, the query's
   own segment causally — the same rule as the reference). It writes a partial output and LSE.
   It is launched once per tile height (16 rows for segments read by few queries, 64 and/or 128 for shared
   ones; the work tables are made by :mod:`treegen.kernels.triton_plan`), each launch with its own key
   block, warps and pipeline depth (``_launch_shape`` there: thousands of branches' own short
   segments run as small one-warp programs).
2. ``_merge_kernel`` — one program per query row merges that row's partials along its whole
   root-to-leaf path (any depth, unbalanced trees) with the log-sum-exp rule, all heads at once.

When every query's own segment is a single 16-row work item (decode: one leaf per branch), that
launch runs last and its items merge their rows' ancestor partials themselves (``fused_merge``): no merge
launch, and no partial written for the leaf. Several such items may share one program's tile
(``WorkList.pack``: a decode leaf of 4 query heads per KV head fills 4 of its 16 rows): the program
attends each item's keys in turn, with the other items' rows masked, then merges and stores every row.

Sliding window and soft-capping (plan-level, :mod:`~treegen.kernels.tree_attention`): with a window W a
key is visible iff ``query_pos - W < key_pos <= query_pos``; each work item starts at the first key block
any of its rows can see and reads the blocks every row sees without masks. With a soft cap c the scores
are ``c * tanh(s / c)`` before the softmax (Gemma 2).

Programmatic dependent launch (Hopper and newer, ``TritonPlan.pdl``, :func:`dependent_launches`): a call's
second and later kernels are launched while the kernel before runs its last programs. Every program of a
kernel that has a dependent signals it at its start (``gdc_launch_dependents``): the dependent's programs
take the SMs its programs free, instead of the GPU draining to empty between the two. A dependent waits
for the kernel before (``gdc_wait``) before it reads that kernel's partials (fused leaves: before their
merge; the merge kernel: at its start), or — a segment launch independent of the one before — at its
end, so that each kernel finishes after the one before it and the call's last kernel after all of them
(what the layer's next kernel, launched normally, waits for). Measured on an H200 (program-shaped trees,
``benchmarks/profile_attention_trees.py``): 32/8 x 128 heads, 4-11% less time a call at 256 leaves, 1-3% at 1,024.

LSE convention: partial LSEs are stored as **natural log** in fp32 (the kernel works in base 2
internally with ``exp2`` and converts on store). A work item with no visible key stores ``-inf``
and output 0; the merge skips such partials without NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from treegen.kernels.launch import Launcher, next_power_of_2
from treegen.kernels.library_attention import segment_attention
from treegen.kernels.triton_plan import TritonPlan

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

_LN2 = math.log(2.0)
# bf16 queries over an FP8 cache: the kernels' matrix products in "fp16" (e4m3 converts to fp16 in one
# instruction per pair; queries scaled into its range by a power of two) or in the "query" dtype (bf16).
# Measured on an H200, Llama-3-8B decode (1,024 leaves of 128 keys below 2,048, 32/8 heads): leaves' launch
# 155 vs 170 us. INT8 keeps the query dtype: its fp16 products were slower (169 vs 152 us), also with the
# int8 -> fp16 bit trick (``0x6400 | (x + 128)`` minus 1152: 172 us). (benchmarks/results/kv_quant_attention_h200.json;
# the leaves' launch without TMA: kv_quant_leaf_launch_h200.json)
FP8_PRODUCTS = "fp16"
_LOG2E = 1.0 / _LN2


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _soft_cap(qk, cap, pre):
        """``cap * tanh(qk * pre)`` (``pre = scale / cap``): Gemma 2's attention logit soft-capping.
        tanh as ``1 - 2 / (exp(2x) + 1)``: saturates to +-1 without NaN, and runs in the interpreter."""
        return cap * (1.0 - 2.0 / (tl.exp(2.0 * qk * pre) + 1.0))

    @triton.jit
    def _online_softmax_step(acc, m_i, l_i, qk, v, vs, scale_log2, MAY_BE_EMPTY: tl.constexpr, PRECISION: tl.constexpr,
                             QUANT: tl.constexpr):
        """Fold one block of raw scores ``qk`` [M, N] (invisible keys -inf) and values ``v`` [N, D] into the
        running base-2 max ``m_i``, sum ``l_i`` and output ``acc``. The base-2 score is ``qk * scale_log2``,
        applied in one FMA with the max subtraction (the max is taken on raw scores: the scale is positive).
        MAY_BE_EMPTY: a row may have seen no visible key yet (max -inf), which must not turn into NaN.
        QUANT: ``v`` holds 8-bit values (converted to the query dtype) whose per-key scales ``vs`` [N] are
        folded into the probabilities before the product (``p @ (v * vs) == (p * vs) @ v``)."""
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
        if MAY_BE_EMPTY:
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(qk * scale_log2 - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * vs[None, :]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _attend_block(acc, m_i, l_i, q, qpos, K, V, KS, VS, stride_kt, stride_st, pos0, start, hi, scale_log2,
                      window, cap, pre,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      PRECISION: tl.constexpr, QUANT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
        """Fold keys [start, start + BLOCK_N) of a segment (those before ``hi``) into the online softmax
        (base-2 running max ``m_i`` and sum ``l_i``). MASKED=False: every key of the block is visible to every
        row (no bounds, causal or window checks). WINDOW: keys at ``key_pos <= qpos - window`` are invisible
        too. SOFTCAP: scores are soft-capped (``_soft_cap``; ``scale_log2`` is then plain log2(e)).
        QUANT: K/V hold 8-bit values, ``KS``/``VS`` their per-key scales (stride ``stride_st``): the
        scores are ``(q . k) * k_scale`` and the values are scaled through the probabilities."""
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_off = offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
        s_off = offs_n.to(tl.int64) * stride_st
        if MASKED:
            key_ok = offs_n < hi
            k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
            v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(K + kv_off)
            v = tl.load(V + kv_off)
        if QUANT:
            if MASKED:
                ks = tl.load(KS + s_off, mask=key_ok, other=0.0)
                vs = tl.load(VS + s_off, mask=key_ok, other=0.0)
            else:
                ks = tl.load(KS + s_off)
                vs = tl.load(VS + s_off)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        else:
            vs = 0.0
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if QUANT:
            qk = qk * ks[None, :]
        if SOFTCAP:
            qk = _soft_cap(qk, cap, pre)
        if MASKED:
            visible = key_ok[None, :] & ((pos0 + offs_n)[None, :] <= qpos[:, None])
            if WINDOW:
                visible = visible & ((pos0 + offs_n)[None, :] > qpos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        return _online_softmax_step(acc, m_i, l_i, qk, v, vs, scale_log2, True, PRECISION, QUANT)

    @triton.jit
    def _attend_blocks(acc, m_i, l_i, q, qpos, K, V, KS, VS, stride_kt, stride_st, pos0, lo, hi, scale_log2,
                       window, cap, pre,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                       PRECISION: tl.constexpr, QUANT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
        """Online-softmax over keys [lo, hi) of a segment, block after block (:func:`_attend_block`)."""
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(acc, m_i, l_i, q, qpos, K, V, KS, VS, stride_kt, stride_st, pos0, start, hi,
                                          scale_log2, window, cap, pre, HEAD_DIM, BLOCK_N, MASKED, PRECISION, QUANT,
                                          WINDOW, SOFTCAP)
        return m_i, l_i, acc

    @triton.jit
    def _attend_blocks_tma(acc, m_i, l_i, q, K_desc, V_desc, KS, VS, stride_st, row0, col, lo, hi, scale_log2,
                           cap, pre, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr,
                           QUANT: tl.constexpr, SOFTCAP: tl.constexpr):
        """Unmasked online-softmax over keys [lo, hi) (whole blocks) with TMA tensor-descriptor loads;
        ``row0`` is the segment's first cache slot, ``col`` the KV head's first column. QUANT: as in
        :func:`_attend_block` (``KS``/``VS`` point at the segment's first slot's scales)."""
        col = col.to(tl.int32)
        for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            row = (row0 + start).to(tl.int32)
            k = K_desc.load([row, col])
            v = V_desc.load([row, col])
            if QUANT:
                s_off = (start + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_st
                ks = tl.load(KS + s_off)
                vs = tl.load(VS + s_off)
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            else:
                vs = 0.0
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if QUANT:
                qk = qk * ks[None, :]
            if SOFTCAP:
                qk = _soft_cap(qk, cap, pre)
            # a fully visible block gives every row a finite score, so the max is never -inf here
            m_i, l_i, acc = _online_softmax_step(acc, m_i, l_i, qk, v, vs, scale_log2, False, PRECISION, QUANT)
        return m_i, l_i, acc

    @triton.jit(do_not_specialize=["tail_slot", "tail_pos", "tail_len"])
    def _segment_attention_kernel(
        Q, K, V, K_desc, V_desc, KS, VS, O_part, LSE_part, work, rows, q_pos, merge_ptr, merge_idx, Out,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_st, stride_pt, stride_ph, stride_lt, stride_ot, stride_oh,
        scale_log2, window, cap, pre,
        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h, tail_slot, tail_pos, tail_len,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRECISION: tl.constexpr, FUSE_MERGE: tl.constexpr,
        MERGE_J: tl.constexpr, HAS_LIB: tl.constexpr, DIRECT_ROWS: tl.constexpr, LIB_BY_ROW: tl.constexpr,
        LIB_P2: tl.constexpr, QUANT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
        F16_PRODUCTS: tl.constexpr, NUM_KV: tl.constexpr, PDL_TRIGGER: tl.constexpr, PDL_WAIT: tl.constexpr,
        PACK: tl.constexpr, PACK_P2: tl.constexpr, SUB_ROWS: tl.constexpr, LIB_TAIL: tl.constexpr,
    ):
        # the KV heads of one work item are consecutive programs: GPUs start programs in id order (observed
        # behaviour, not a CUDA guarantee; only speed depends on it), so the plan's order of items (longest
        # first) is the order they start in
        wid = tl.program_id(0) // NUM_KV
        kvh = tl.program_id(0) % NUM_KV
        if PDL_TRIGGER:  # the call's next launch may start as this one's last programs run (see the module doc)
            tl.extra.cuda.gdc_launch_dependents()
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        head = kvh * GROUP + offs_m % GROUP
        if PACK > 1:  # the tile's rows belong to PACK items of SUB_ROWS rows each, item after item
            sub = offs_m // GROUP // SUB_ROWS
            local = offs_m // GROUP % SUB_ROWS
            entry = work + (wid * PACK + tl.minimum(sub, PACK - 1)) * 7
            row_begin = tl.load(entry + 4)
            row_count = tl.where(sub < PACK, tl.load(entry + 5), 0)
            part0 = 0  # (packed items are fused leaves: they write no partials)
        else:
            slot0 = tl.load(work + wid * 7 + 0)
            pos0 = tl.load(work + wid * 7 + 1)
            kb = tl.load(work + wid * 7 + 2)
            ke = tl.load(work + wid * 7 + 3)
            row_begin = tl.load(work + wid * 7 + 4)
            row_count = tl.load(work + wid * 7 + 5)
            part0 = tl.load(work + wid * 7 + 6)
            local = offs_m // GROUP
        row_ok = local < row_count
        if DIRECT_ROWS:  # the item's rows are query rows row_begin, row_begin + 1, ...
            qrow = tl.where(row_ok, row_begin + local, 0)
        else:
            qrow = tl.load(rows + row_begin + local, mask=row_ok, other=0)
        qpos = tl.load(q_pos + qrow, mask=row_ok, other=-1)
        q = tl.load(Q + qrow[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if F16_PRODUCTS:
            # bf16 queries over an FP8 cache: the products run in fp16, to which e4m3 converts in one
            # instruction per pair; the tile's queries are divided by a power of two that keeps them in
            # fp16's range (exact), and the scores multiplied back through the scale
            qf = q.to(tl.float32)
            qmul = tl.exp2(tl.maximum(tl.ceil(tl.log2(tl.max(tl.max(tl.abs(qf), axis=1), axis=0) / 32768.0)), 0.0))
            q = (qf / qmul).to(tl.float16)
            if SOFTCAP:
                pre = pre * qmul
            else:
                scale_log2 = scale_log2 * qmul

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if LIB_TAIL:
            # the library segment's last few keys (past its chunks: under 8), before every row, so all rows see
            # them: one 16-key block (the smallest tl.dot takes), not a full key block of the leaf's own
            t_kv = tail_slot.to(tl.int64) * stride_kt + kvh * stride_kh
            t_s = tail_slot.to(tl.int64) * stride_st + kvh
            m_i, l_i, acc = _attend_blocks(acc, m_i, l_i, q, qpos, K + t_kv, V + t_kv, KS + t_s, VS + t_s, stride_kt,
                                           stride_st, tail_pos, 0, tail_len, scale_log2, window, cap, pre, HEAD_DIM,
                                           16, True, PRECISION, QUANT, WINDOW, SOFTCAP)
        if PACK > 1:
            # each item's keys with its own rows visible: the others' positions are -1 (no key is visible to
            # them, so their running max, sum and output stay as they are). The items' key blocks run as one
            # loop, item after item (an empty item has none), so the loop's software pipeline fetches the next
            # block, also the next item's first, while this one is computed. (Measured on an H100, decode tree
            # of a 2K prompt over leaves of 1-64 keys, the leaves' launch against one loop per item: 32/8 x 128
            # heads 47.8 -> 46.1 us at 256 leaves and 71.8 -> 69.2 at 1,024; 24/8 at 1,024 84.4 -> 79.0; MHA
            # 32/32 117.6 -> 107.0 and 218.2 -> 207.8; 16/4 and 8/1 equal. profile_attention_trees_decode_*flat_pack*)
            offs_p = tl.arange(0, PACK_P2)
            p_ok = offs_p < PACK
            entries = work + (wid * PACK + tl.minimum(offs_p, PACK - 1)) * 7
            slot_v = tl.load(entries + 0, mask=p_ok, other=0)
            pos_v = tl.load(entries + 1, mask=p_ok, other=0)
            kb_v = tl.load(entries + 2, mask=p_ok, other=0)
            # keys past an item's last query position are invisible to all its rows: stop there
            qmax_v = tl.max(tl.where(sub[:, None] == offs_p[None, :], qpos[:, None], -1), axis=0)
            hi_v = tl.minimum(tl.load(entries + 3, mask=p_ok, other=0), qmax_v - pos_v + 1)
            blocks_v = tl.where(p_ok, tl.maximum(hi_v - kb_v + BLOCK_N - 1, 0) // BLOCK_N, 0)
            end_v = tl.cumsum(blocks_v, 0)  # item i's blocks are [end_v[i] - blocks_v[i], end_v[i])
            for b in range(0, tl.sum(blocks_v, 0)):
                i = tl.sum((end_v <= b).to(tl.int32), 0)  # the item whose blocks hold block b
                this = offs_p == i
                slot0 = tl.sum(tl.where(this, slot_v, 0), 0)
                pos0 = tl.sum(tl.where(this, pos_v, 0), 0)
                start = tl.sum(tl.where(this, kb_v + (b - end_v + blocks_v) * BLOCK_N, 0), 0)
                hi = tl.sum(tl.where(this, hi_v, 0), 0)
                kv_base = slot0.to(tl.int64) * stride_kt + kvh * stride_kh
                s_base = slot0.to(tl.int64) * stride_st + kvh
                m_i, l_i, acc = _attend_block(acc, m_i, l_i, q, tl.where(sub == i, qpos, -1), K + kv_base, V + kv_base,
                                              KS + s_base, VS + s_base, stride_kt, stride_st, pos0, start, hi,
                                              scale_log2, window, cap, pre, HEAD_DIM, BLOCK_N, True, PRECISION, QUANT,
                                              WINDOW, SOFTCAP)
        else:
            # keys past the tile's last query position are invisible to all its rows: stop there;
            # keys before its first query position (and inside the chunk) are visible to all: no mask
            hi = tl.minimum(ke, tl.max(qpos, axis=0) - pos0 + 1)
            qmin = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
            full = tl.minimum(hi, qmin - pos0 + 1)
            full = tl.maximum(kb, kb + (full - kb) // BLOCK_N * BLOCK_N)
            if WINDOW:
                # keys before the lowest row's window are invisible to all rows: start at the block holding
                # its first key; keys inside the highest row's window (and before ``full``) are visible to all
                lo = kb + tl.maximum(qmin - window + 1 - pos0 - kb, 0) // BLOCK_N * BLOCK_N
                ulo = kb + (tl.maximum(tl.max(qpos, axis=0) - window + 1 - pos0 - kb, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
                ulo = tl.maximum(lo, tl.minimum(ulo, full))
            else:
                lo = kb
                ulo = kb
            kv_base = slot0.to(tl.int64) * stride_kt + kvh * stride_kh
            s_base = slot0.to(tl.int64) * stride_st + kvh  # the scales of an 8-bit cache: [slots, kv_heads]
            if WINDOW:  # the blocks that only some rows see because of the window
                m_i, l_i, acc = _attend_blocks(acc, m_i, l_i, q, qpos, K + kv_base, V + kv_base, KS + s_base, VS + s_base,
                                               stride_kt, stride_st, pos0, lo, ulo, scale_log2, window, cap, pre,
                                               HEAD_DIM, BLOCK_N, True, PRECISION, QUANT, WINDOW, SOFTCAP)
            if USE_TMA:
                # a fully visible block has a finite score in every row, so the running max is finite
                m_i, l_i, acc = _attend_blocks_tma(acc, m_i, l_i, q, K_desc, V_desc, KS + s_base, VS + s_base, stride_st,
                                                   slot0, kvh * HEAD_DIM, ulo, full, scale_log2, cap, pre, BLOCK_N,
                                                   WARP_SPECIALIZE, PRECISION, QUANT, SOFTCAP)
            else:
                m_i, l_i, acc = _attend_blocks(acc, m_i, l_i, q, qpos, K + kv_base, V + kv_base, KS + s_base, VS + s_base,
                                               stride_kt, stride_st, pos0, ulo, full, scale_log2, window, cap, pre,
                                               HEAD_DIM, BLOCK_N, False, PRECISION, QUANT, WINDOW, SOFTCAP)
            m_i, l_i, acc = _attend_blocks(acc, m_i, l_i, q, qpos, K + kv_base, V + kv_base, KS + s_base, VS + s_base,
                                           stride_kt, stride_st, pos0, tl.maximum(full, ulo), hi, scale_log2, window, cap,
                                           pre, HEAD_DIM, BLOCK_N, True, PRECISION, QUANT, WINDOW, SOFTCAP)

        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        if FUSE_MERGE:  # this item is its rows' own segment: merge their ancestors' partials and finish
            if PDL_WAIT:  # the partials are the previous launch's
                tl.extra.cuda.gdc_wait()
            out = _merge_partials(out, lse, O_part, LSE_part, merge_ptr, merge_idx, qrow, head, row_ok, offs_d,
                                  stride_pt, stride_ph, stride_lt,
                                  O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
                                  MERGE_J, HAS_LIB, LIB_BY_ROW, LIB_P2)
            tl.store(Out + qrow[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = (part0 + local).to(tl.int64)
            tl.store(O_part + part[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :], out,
                     mask=row_ok[:, None])
            tl.store(LSE_part + part * stride_lt + head, lse, mask=row_ok)
            if PDL_WAIT:  # finish only after the previous launch: the next one's wait then covers both
                tl.extra.cuda.gdc_wait()

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
                    mask=tl.expand_dims(part_ok, -1), other=0.0).to(tl.float32)
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
                        MERGE_J: tl.constexpr, HAS_LIB: tl.constexpr, LIB_BY_ROW: tl.constexpr,
                        LIB_P2: tl.constexpr):
        """Fold the partials listed for each row's query (natural-log LSE) into ``out``/``lse``; returns
        the merged output. Rows have different numbers of partials: each stops at its own end. MERGE_J
        partials of every row are fetched together (independent loads), so a row below a long prefix
        split into many chunks does not wait for its partials one at a time. LIB_BY_ROW (the number of
        library chunks, ``LIB_P2`` rounded up to a power of two; 0: none): the library partials of query
        row ``q`` are read as chunk ``c``, row ``q`` without a lookup in the merge list (which does not
        list them)."""
        begin = tl.load(merge_ptr + qrow, mask=row_ok, other=0)
        end = tl.load(merge_ptr + qrow + 1, mask=row_ok, other=0)
        m = lse
        l_sum = tl.where(lse > float("-inf"), 1.0, 0.0)
        acc = out * l_sum[:, None]
        if LIB_BY_ROW > 0:
            # all chunks in one [16, LIB_P2, D] load. (One chunk at a time in an unrolled loop was tried:
            # Phi-4-mini's 3 chunks 57 -> 52 us, but Llama-3-8B's 2 made its leaves' launch 692-695 -> 737 us a
            # step at batch 256, H200, profile_step.py; and the plan no longer gives a folded group 3 chunks)
            # (names of their own: compiled Triton types a name once, and the loop below reuses p/ok/...)
            offs_c = tl.arange(0, LIB_P2)
            p_lib = -1 - (offs_c[None, :] * lib_rows + qrow[:, None])
            ok_lib = row_ok[:, None] & (offs_c[None, :] < LIB_BY_ROW)
            lse_lib, o_lib = _load_partials(p_lib, ok_lib, head[:, None], offs_d, O_part, LSE_part, stride_pt,
                                            stride_ph, stride_lt, O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r,
                                            lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h, HAS_LIB)
            m, l_sum, acc = _fold_partials(m, l_sum, acc, lse_lib, o_lib)
        offs_j = tl.arange(0, MERGE_J)
        for j0 in range(0, tl.max(end - begin, axis=0), MERGE_J):
            idx = begin[:, None] + j0 + offs_j[None, :]
            ok = row_ok[:, None] & (idx < end[:, None])
            p = tl.load(merge_idx + idx, mask=ok, other=0)
            lse_j, o_j = _load_partials(p, ok, head[:, None], offs_d, O_part, LSE_part, stride_pt, stride_ph, stride_lt,
                                        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r,
                                        lib_sl_h, HAS_LIB)
            m, l_sum, acc = _fold_partials(m, l_sum, acc, lse_j, o_j)
        return acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]

    @triton.jit
    def _fold_partials(m, l_sum, acc, lse_j, o_j):
        """Fold J partials of each row (outputs ``o_j`` [R, J, D], natural-log LSEs ``lse_j`` [R, J]; -inf:
        empty or masked, contributes nothing) into the running max ``m``, sum ``l_sum`` and unnormalised
        output ``acc`` [R, D] with the log-sum-exp rule, without NaN on empty sides."""
        m_new = tl.maximum(m, tl.max(lse_j, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        b = tl.exp(lse_j - m_safe[:, None])
        return m_new, l_sum * a + tl.sum(b, axis=1), acc * a[:, None] + tl.sum(b[:, :, None] * o_j, axis=1)

    @triton.jit
    def _merge_kernel(
        O_part, LSE_part, merge_ptr, merge_idx, Out,
        num_heads, stride_pt, stride_ph, stride_lt, stride_ot, stride_oh,
        O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
        BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_LIB: tl.constexpr, PDL_WAIT: tl.constexpr,
        MERGE_J: tl.constexpr,
    ):
        """One program per query row, all its heads. MERGE_J > 1: that many of the row's partials fetched
        together (as the fused leaves do, ``_merge_partials``), not one dependent load after another."""
        q = tl.program_id(0)
        if PDL_WAIT:  # the partials are the previous launches'
            tl.extra.cuda.gdc_wait()
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        h_ok = offs_h < num_heads
        if MERGE_J > 1:
            qrow = q + offs_h * 0  # the row of every head
            out = _merge_partials(tl.zeros([BLOCK_H, HEAD_DIM], tl.float32),
                                  tl.full([BLOCK_H], float("-inf"), tl.float32),
                                  O_part, LSE_part, merge_ptr, merge_idx, qrow, offs_h, h_ok, offs_d,
                                  stride_pt, stride_ph, stride_lt,
                                  O_lib, LSE_lib, lib_rows, lib_so_c, lib_so_r, lib_so_h, lib_sl_c, lib_sl_r, lib_sl_h,
                                  MERGE_J, HAS_LIB, 0, 1)
        else:
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
                m, l, acc = _fold_partials(m, l, acc, lse[:, None], o[:, None, :])
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(Out + q.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=h_ok[:, None])


# each kernel's launcher: Triton's per-call Python skipped once a variant is known (treegen.kernels.launch)
_LAUNCH = {k.fn.__name__: Launcher(k) for k in (_segment_attention_kernel, _merge_kernel)} if triton is not None else {}


SUPPORTED_HEAD_DIMS = (64, 128, 256)


def merge_block(num_heads: int, head_dim: int) -> int:
    """How many of a row's partials the merge launch fetches together. 4 ([heads, 4, head_dim] fp32 over 8 warps)
    for 16-32 heads (rounded up to a power of two) x 128, or 16 x 256: 0-6.5% less time a call on an H200 at 32/8,
    32/32, 16/8 heads (program-shaped trees whose leaves do not merge, 256/1,024 leaves); at 9/3 x 64 it measured
    4-21% more, so smaller rows keep one at a time over 4 warps (profile_attention_trees_merge_h200.json), and
    larger ones too ([64, 4, 128] would not fit the registers)."""
    width = next_power_of_2(num_heads) * head_dim
    return 4 if num_heads >= 16 and head_dim >= 128 and width <= 4096 else 1


def partial_dtype(plan: TritonPlan, q: Tensor) -> torch.dtype:
    """The partial outputs' dtype: fp16 for 16-bit queries when the plan asks (``half_partials``), else fp32."""
    return torch.float16 if plan.half_partials and q.element_size() == 2 else torch.float32


def dependent_launches(plan: TritonPlan, pdl: int) -> list[bool]:
    """Which kernels of one call are launched as programmatic dependents of the kernel before (``launch_pdl``):
    one entry per segment launch, then one for the merge launch (False when the plan fuses the merge).
    ``pdl``: 0 none; 1 the kernels that read the launch before's partials (fused leaves, the merge); 2 also
    the segment launches after the first (independent of the one before; each finishes only after it).
    The first kernel of a call never is: it reads what the layer's earlier kernels wrote."""
    n = len(plan.launches)
    links = [i > 0 and (pdl >= 2 or pdl >= 1 and plan.fused_merge and w.block_m == 16)
             for i, w in enumerate(plan.launches)]
    return links + [pdl >= 1 and n > 0 and not plan.fused_merge]


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TritonPlan, query_pos: Tensor,
                          scale: float, k_scale: Tensor | None = None, v_scale: Tensor | None = None, *,
                          window: int | None = None, softcap: float | None = None,
                          library_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Triton tree attention. Shapes as :func:`~treegen.kernels.tree_attention.tree_attention_reference`;
    ``query_pos: [num_queries]`` int32 or int64 absolute positions; ``k_scale``/``v_scale``
    ``[num_slots, num_kv_heads]`` fp32 (contiguous heads): the scales of an 8-bit cache (None: none).
    ``window``: sliding window (None: none); ``softcap``: attention logit soft-capping (None: none) —
    the plan must have been made for them (it leaves out-of-window segments out, and the library
    segment computes neither). ``library_kv``: the plan's library segment's keys/values of an 8-bit cache
    already dequantized to q's dtype (:func:`~treegen.kernels.library_attention.dequantized_segment`)."""
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
    # fp32 tiles (and head_dim 256's) are twice as large: halve the key block and the pipeline depth to fit
    # shared memory; fp32 inputs also get full fp32 products
    exact = q.element_size() > 2
    wide = exact or head_dim > 128
    o_part = torch.empty(max(plan.num_partials, 1), num_heads, head_dim, device=q.device, dtype=partial_dtype(plan, q))
    lse_part = torch.empty(max(plan.num_partials, 1), num_heads, dtype=torch.float32, device=q.device)
    quant = k_scale is not None
    f16_products = quant and q.dtype == torch.bfloat16 and k_cache.dtype != torch.int8 and FP8_PRODUCTS == "fp16"
    if plan.library is not None and (window is not None or softcap is not None):
        raise ValueError("the plan gives a segment to the library kernel, which has no window or soft cap: "
                         "plan with window/softcap (plan_tree_attention)")
    # soft-capping scores c * tanh(s * scale / c) in the kernel, then exp2 of score * log2(e)
    cap, pre, scale_log2 = (float(softcap), scale / float(softcap), _LOG2E) if softcap is not None \
        else (1.0, 1.0, scale * _LOG2E)
    if library_kv is not None and plan.library is None:
        raise ValueError("library_kv is for a plan with a library segment; this plan has none")
    if plan.library is not None:  # [chunks, heads, rows, D] / [chunks, heads, rows], read through their strides
        o_lib, lse_lib = segment_attention(q, k_cache, v_cache, plan.library, scale, k_scale, v_scale, library_kv)
        lib_args = (o_lib, lse_lib, plan.library.num_rows, o_lib.stride(0), o_lib.stride(2), o_lib.stride(1),
                    lse_lib.stride(0), lse_lib.stride(2), lse_lib.stride(1))
    else:
        lib_args = (o_part, lse_part, 1, 0, 0, 0, 0, 0, 0)
    tail = plan.leaf_tail
    links = dependent_launches(plan, plan.pdl if q.is_cuda else 0)
    # what every launch of this call passes alike, built once a call (an uncaptured forward runs this per layer)
    scales = (k_scale, v_scale) if quant else (k_cache, v_cache)
    shared_args = (plan.rows, query_pos, plan.merge_ptr, plan.merge_idx, out,
                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_scale.stride(0) if quant else 0,
                   o_part.stride(0), o_part.stride(1), lse_part.stride(0), out.stride(0), out.stride(1), scale_log2,
                   window or 0, cap, pre, *lib_args, *tail)
    shared = dict(GROUP=plan.group, HEAD_DIM=head_dim, WARP_SPECIALIZE=plan.warp_specialize,
                  PRECISION="ieee" if exact else "tf32",  # fp32 inputs get full fp32 products (no TF32)
                  HAS_LIB=plan.library is not None, LIB_BY_ROW=plan.library.chunks if plan.library_by_row else 0,
                  LIB_P2=next_power_of_2(plan.library.chunks) if plan.library_by_row else 1, QUANT=quant,
                  WINDOW=window is not None, SOFTCAP=softcap is not None, F16_PRODUCTS=f16_products, NUM_KV=num_kv)
    # a leaf below a 16K prefix split 32 ways: 64 branches 8/1 heads 32 us (J=8) vs 36 (4) vs 42 (1), H100;
    # [16, J, head_dim] fp32 must fit the launch's registers: one warp gets J=1, head_dim 256 J=2
    merge_j = 8 if head_dim <= 128 else 2
    for index, launch in enumerate(plan.launches):
        block_n = launch.block_n // 2 if wide else launch.block_n
        # an 8-bit cache's many-leaves launch reads with plain loads: its TMA loads were slower (H200, Llama-3-8B
        # decode, 1,024 leaves: INT8 145 vs 174 us, FP8 137 vs 156; bf16 equal), see FP8_PRODUCTS' file
        use_tma = plan.use_tma and not (quant and launch.block_m == 16)
        if use_tma:
            key = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype, k_cache.shape[0], k_cache.stride(0), block_n,
                   head_dim)
            descriptors = plan.descriptors.get(key)
            if descriptors is None:
                # 2-D views [slots, kv_heads * head_dim]: one block = BLOCK_N slots x one KV head
                descriptors = plan.descriptors[key] = tuple(
                    TensorDescriptor(c, [c.shape[0], num_kv * head_dim], [c.stride(0), 1], [block_n, head_dim])
                    for c in (k_cache, v_cache))
            k_desc, v_desc = descriptors
        else:
            k_desc = v_desc = k_cache  # unused
        fused = plan.fused_merge and launch.block_m == 16
        follows, precedes = links[index], links[index + 1]
        _LAUNCH["_segment_attention_kernel"][(launch.work.shape[0] * num_kv,)](
            q, k_cache, v_cache, k_desc, v_desc, *scales, o_part, lse_part, launch.work, *shared_args,
            BLOCK_M=launch.block_m, BLOCK_N=block_n, USE_TMA=use_tma, FUSE_MERGE=fused,
            MERGE_J=1 if launch.num_warps < 4 else merge_j, DIRECT_ROWS=launch.direct_rows,
            PDL_TRIGGER=precedes, PDL_WAIT=follows, PACK=launch.pack, PACK_P2=next_power_of_2(launch.pack),
            SUB_ROWS=launch.block_m // plan.group // launch.pack, LIB_TAIL=fused and tail[2] > 0,
            num_warps=launch.num_warps, num_stages=min(2, launch.num_stages) if wide else launch.num_stages,
            **shared, **({"launch_pdl": True} if follows else {}),
        )
    if plan.fused_merge:
        return out
    merge_j = merge_block(num_heads, head_dim)
    _LAUNCH["_merge_kernel"][(num_q,)](
        o_part, lse_part, plan.merge_ptr, plan.merge_idx, out,
        num_heads, o_part.stride(0), o_part.stride(1), lse_part.stride(0), out.stride(0), out.stride(1), *lib_args,
        BLOCK_H=next_power_of_2(num_heads), HEAD_DIM=head_dim, HAS_LIB=plan.library is not None,
        PDL_WAIT=links[-1], MERGE_J=merge_j, num_warps=8 if merge_j > 1 else 4,
        **({"launch_pdl": True} if links[-1] else {}),
    )
    return out
