"""Hierarchical (tree) attention: plan once per tree shape, run once per layer.

The KV cache is a flat pool of slots per layer, ``k_cache: [num_slots, num_kv_heads, head_dim]``.
A *segment* is a contiguous run of slots holding the keys/values of one tree node; segments form a
forest through ``segment_parent``. A query row belongs to one segment (its *own* segment) and attends

* fully to every ancestor segment, and
* causally to its own segment (keys whose absolute position is ``<=`` the query's position).

Both rules are one rule on absolute positions: key visible iff ``key_pos <= query_pos``, because every
ancestor key precedes every descendant position. A plan with a sliding ``window`` W (Mistral, the local
layers of Gemma 2/3) adds ``key_pos > query_pos - W`` (Hugging Face's rule): segments wholly before every
window of the rows below them are left out of the plan (their KV is not read), a segment partly inside is
masked. A plan with a ``softcap`` c (Gemma 2) scores ``c * tanh(s / c)`` instead of ``s``.

The attention is decomposed by tree level: at level ``d`` every segment of depth ``d`` is attended by all query rows below it, batched into one
matrix-matrix product (and all query heads that share a KV head are folded into the query axis). The
partial results are merged exactly with the log-sum-exp trick.

LSE convention (everywhere in treegen): **natural log**, fp32, ``lse = log(sum_j exp(s_j))`` with
``s_j = scale * q . k_j``. A segment with no visible key has ``lse = -inf`` and output 0; merging
it with anything leaves the other side unchanged and never produces NaN.

The cache may be in an 8-bit KV format (:mod:`treegen.kernels.kv_quant`): then ``k_scale`` and
``v_scale`` ``[num_slots, num_kv_heads]`` fp32 are given, and every path reads ``stored * scale``.

Nothing in this module knows about programs or branches; it sees segments and query rows only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from treegen.kernels.kv_quant import EIGHT_BIT_STORAGE, dequantize_reference
from treegen.kernels.library_attention import dequantized_segment, library_available
from treegen.kernels.row_paths import expand, row_paths
from treegen.kernels.tree_attention_triton import tree_attention_triton, triton_available
from treegen.kernels.triton_plan import TritonPlan, plan_triton

_NO_POSITION = torch.iinfo(torch.int64).max  # padding key position: never visible


@dataclass(frozen=True)
class LevelPlan:
    """All segments of one tree depth, padded into a batch.

    ``kv_slots: [n, max_len] int64`` — slot of each key in the flat cache (padding → 0);
    e.g. two segments at slots 0..2 and 7..8 → ``[[0, 1, 2], [7, 8, 0]]``.
    ``kv_pos: [n, max_len] int64`` — absolute position of each key (padding → int64 max, masked).
    ``query_rows: [n, max_rows] int64`` — query rows attending each segment (padding → 0).
    ``query_valid: [n, max_rows] bool`` — False on padding.
    ``valid_rows: [V] int64`` / ``valid_index: [V] int64`` — the real (non-padding) entries: their query
    row, and their position in the flattened ``[n * max_rows]`` layout (no boolean indexing at run time).
    """

    kv_slots: Tensor
    kv_pos: Tensor
    query_rows: Tensor
    query_valid: Tensor
    valid_rows: Tensor
    valid_index: Tensor
    mask_cache: dict = field(default_factory=dict, compare=False, repr=False)  # see _hidden


@dataclass(frozen=True)
class TreeAttentionPlan:
    """Index tensors for one tree shape; reused by every layer of a forward pass.

    ``query_pos: [num_queries] int64`` — absolute position of each query row.
    ``backend`` — ``"reference"`` (PyTorch, any device) or ``"triton"`` (the Triton kernels).
    ``levels`` — reference: one :class:`LevelPlan` per tree depth that has a query below it.
    ``triton`` — Triton: the kernels' work tables (None for the reference).
    ``window`` — sliding window W (keys at ``key_pos > query_pos - W`` only; None: all earlier keys).
    ``softcap`` — attention logit soft-capping c (scores ``c * tanh(s / c)``; None: plain scores).
    """

    num_queries: int
    query_pos: Tensor
    backend: str
    levels: tuple[LevelPlan, ...]
    triton: TritonPlan | None = None
    window: int | None = None
    softcap: float | None = None

    def shape_key(self) -> tuple | None:
        """What a captured launch of this plan fixes besides its tables (see
        :meth:`~treegen.kernels.triton_plan.TritonPlan.shape_key`); None: the plan cannot be padded
        (the reference backend, or a library segment)."""
        key = self.triton.shape_key() if self.backend == "triton" else None
        return None if key is None else (self.window, self.softcap, key)

    def sizes(self) -> tuple:
        """Its tables' lengths (:meth:`~treegen.kernels.triton_plan.TritonPlan.sizes`)."""
        return self.triton.sizes()

    def padded(self, num_queries: int, capacity: tuple, query_pos: Tensor) -> "TreeAttentionPlan":
        """Empty tables for ``num_queries`` rows at ``capacity`` (as :meth:`sizes`), reading positions
        from ``query_pos`` (``[num_queries]``), to be filled by :meth:`load`."""
        return dataclasses.replace(self, num_queries=num_queries, query_pos=query_pos,
                                   triton=self.triton.padded(num_queries, capacity))

    def load(self, plan: "TreeAttentionPlan") -> None:
        """Copy ``plan``'s tables into this :meth:`padded` one (its positions are the caller's to copy)."""
        self.triton.load(plan.triton)


def _padded_ranges(first: np.ndarray, length: np.ndarray, fill: int) -> np.ndarray:
    """Row i: ``first[i], first[i] + 1, ...`` (``length[i]`` of them), then ``fill``; at least one column."""
    width = max(int(length.max(initial=0)), 1)
    j = np.arange(width, dtype=np.int64)
    return np.where(j < length[:, None], first[:, None] + j, fill)


def plan_tree_attention(
    *,
    segment_parent: Sequence[int],
    segment_start: Sequence[int],
    segment_len: Sequence[int],
    segment_pos: Sequence[int],
    query_segment: Sequence[int],
    query_pos: Sequence[int],
    device: torch.device | str = "cpu",
    backend: str = "auto",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    dtype: torch.dtype | None = None,
    window: int | None = None,
    softcap: float | None = None,
    query_pos_buffer: Tensor | None = None,
    triton_options: dict | None = None,
    kv_quantized: bool = False,
) -> TreeAttentionPlan:
    """Build the index tensors for tree attention.

    segment_parent: [num_segments] — parent segment index, -1 for a root; parents may appear in
        any order. A chain root(len 4) → child(len 2) → ``[-1, 0]``.
    segment_start: [num_segments] — first slot of the segment in the flat cache; e.g. ``[0, 4]``.
    segment_len: [num_segments] — number of valid keys (written slots) of the segment; ``[4, 2]``.
    segment_pos: [num_segments] — absolute position of the segment's first key; ``[0, 4]``.
    query_segment: [num_queries] — the segment each query row belongs to (attends causally);
        two decode queries of the child above → ``[1, 1]`` is invalid for one sequence, but two
        prefill rows of it are ``[1, 1]`` with query_pos ``[4, 5]``.
    query_pos: [num_queries] — absolute position of each query row.
    backend: ``"auto"`` (Triton on CUDA when available, else the reference), ``"reference"``, or
        ``"triton"`` (also on CPU under ``TRITON_INTERPRET=1``, which is how CI tests the kernels).
    num_heads, num_kv_heads: query and KV head counts; needed by the Triton backend.
    dtype: the dtype of the queries the plan will run with (and of the cache, unless it is 8-bit).
        Triton backend, fp16/bf16 on a Hopper GPU: the largest shared segment read by many query rows
        goes to cuDNN's fused attention (:mod:`~treegen.kernels.library_attention`; an 8-bit cache's
        segment is dequantized for it); the plan then runs with that dtype only. None: every segment
        goes to the Triton kernels.
    window: sliding window (None: full causal attention). Rows skip ancestors whose last key is outside
        their window at planning time (positions only grow while a plan is reused, so it stays so).
    softcap: attention logit soft-capping (None: none). Either one keeps the library segment off.
    query_pos_buffer: an int64 ``[num_queries]`` tensor on ``device`` already holding ``query_pos``, used
        as the plan's own instead of a new copy (plans of one forward pass with different windows share
        it, and a decode phase advances it in place); planning reads positions from ``query_pos`` only,
        never from the device.
    kv_quantized: the plan is for an 8-bit cache (its large shared segment goes to cuDNN, dequantized, by the rule
        measured for such caches: ``kv_quantized`` of :func:`~treegen.kernels.triton_plan.plan_triton`).
    triton_options: tuning knobs passed to :func:`~treegen.kernels.triton_plan.plan_triton`
        (``target_programs``, ``block_n``, ``num_stages``, ``library`` to force the library segment
        on or off); the defaults were measured on an H100.
    """
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() and num_kv_heads else "reference"
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    if backend == "triton" and not (num_heads and num_kv_heads):
        raise ValueError("the triton backend needs num_heads and num_kv_heads at planning time")
    n = len(segment_parent)
    for name, seq in (("segment_start", segment_start), ("segment_len", segment_len), ("segment_pos", segment_pos)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries, segment_parent has {n}")
    if len(query_segment) != len(query_pos):
        raise ValueError(f"query_segment has {len(query_segment)} entries, query_pos has {len(query_pos)}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if query_pos_buffer is not None:
        query_pos_t = query_pos_buffer
        if query_pos_t.dtype != torch.int64 or query_pos_t.shape != (len(query_pos),) or query_pos_t.device != device:
            raise ValueError(f"query_pos_buffer must be int64 [{len(query_pos)}] on {device}, got "
                             f"{query_pos_t.dtype} {tuple(query_pos_t.shape)} on {query_pos_t.device}")
    else:
        query_pos_t = torch.as_tensor(list(query_pos), dtype=torch.int64).to(device)

    paths = row_paths(segment_parent, query_segment, query_pos=query_pos, segment_pos=segment_pos,
                      segment_len=segment_len, window=window)  # (checks the parents and the rows' segments)
    if backend == "triton":
        plain = window is None and softcap is None  # the library kernel computes plain causal attention
        group = num_heads // num_kv_heads
        options = {"library": plain and dtype is not None and library_available(device, dtype),
                   "kv_quantized": kv_quantized, **(triton_options or {})}
        return TreeAttentionPlan(
            num_queries=len(query_pos), query_pos=query_pos_t, backend=backend, levels=(),
            triton=plan_triton(segment_start=segment_start, segment_len=segment_len, segment_pos=segment_pos,
                               paths=paths, num_kv_heads=num_kv_heads, group=group, device=device, **options),
            window=window, softcap=None if softcap is None else float(softcap),
        )

    levels = []
    rows_of = paths.rows_of()
    depth = {s: int(paths.depth[s]) for s in rows_of}
    def tensor(x: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)

    for d in sorted(set(depth.values())):  # (tables built with numpy: a CPU decode phase plans thousands of segments)
        segs = np.array(sorted(s for s in rows_of if depth[s] == d), dtype=np.int64)
        length = np.asarray([segment_len[s] for s in segs], dtype=np.int64)
        rows = [rows_of[s] for s in segs]
        count = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        which, j = expand(count)  # each listed row's segment (of this level) and its place among that one's rows
        width = max(int(count.max(initial=0)), 1)
        query_rows = np.zeros((len(rows), width), dtype=np.int64)
        valid_rows = np.fromiter((q for r in rows for q in r), dtype=np.int64, count=int(count.sum()))
        query_rows[which, j] = valid_rows
        levels.append(
            LevelPlan(
                kv_slots=tensor(_padded_ranges(np.asarray([segment_start[s] for s in segs], dtype=np.int64), length, 0)),
                kv_pos=tensor(_padded_ranges(np.asarray([segment_pos[s] for s in segs], dtype=np.int64), length,
                                             _NO_POSITION)),
                query_rows=tensor(query_rows),
                query_valid=tensor(np.arange(width) < count[:, None]).bool(),
                valid_rows=tensor(valid_rows),
                valid_index=tensor(which * width + j),
            )
        )
    return TreeAttentionPlan(num_queries=len(query_pos), query_pos=query_pos_t, backend=backend, levels=tuple(levels),
                             window=window, softcap=None if softcap is None else float(softcap))


def merge_attention_states(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Exactly merge two partial attention results over disjoint key sets.

    o1, o2: [..., head_dim] fp32; lse1, lse2: [...] fp32 natural-log LSE (-inf = no keys).
    Returns (o, lse) with the same shapes. Empty sides (-inf) never produce NaN.
    """
    m = torch.maximum(lse1, lse2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m_safe)
    w2 = torch.exp(lse2 - m_safe)
    denom = w1 + w2
    o = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / denom.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return o, m_safe + torch.log(denom)


def _hidden(level: LevelPlan, query_pos: Tensor, group: int, window: int | None) -> Tensor:
    """[n, 1, R*G, L] bool, True where a key is invisible to a query row (position rule, window or
    padding).

    Depends only on the plan's positions, so it is made once per forward pass and reused by every
    layer (``query_pos`` moves in place between decode steps; its version counter tells)."""
    key = (query_pos.data_ptr(), query_pos._version, group)
    cached = level.mask_cache.get("hidden")
    if cached is not None and cached[0] == key:
        return cached[1]
    n, rows = level.query_rows.shape
    qpos = query_pos[level.query_rows].unsqueeze(2)
    visible = (level.kv_pos.unsqueeze(1) <= qpos) & level.query_valid.unsqueeze(2)
    if window is not None:
        visible &= level.kv_pos.unsqueeze(1) > qpos - window
    hidden = ~visible.unsqueeze(2).expand(n, rows, group, -1).reshape(n, 1, rows * group, -1)
    level.mask_cache["hidden"] = (key, hidden)
    return hidden


def _gather(cache: Tensor, scales: Tensor | None, slots: Tensor) -> Tensor:
    """fp32 ``cache[..., slots, :, :]`` [..., len(slots), kv_heads, head_dim], dequantized when ``scales``
    are given (leading dimensions, say layers, are kept)."""
    stored = cache.index_select(-3, slots)
    return stored.float() if scales is None else dequantize_reference(stored, scales.index_select(-2, slots))


def _level_scores(q: Tensor, k_cache: Tensor, query_pos: Tensor, level: LevelPlan, scale: float,
                  k_scale: Tensor | None, window: int | None, softcap: float | None) -> Tensor:
    """Scores of one level's query rows against their segments' keys, ``[..., n, Hkv, R*G, L]`` fp32, -inf
    where a key is invisible (position rule, window, padding). ``q [..., Q, Hq, D]`` and ``k_cache
    [..., slots, Hkv, D]`` may share leading dimensions (layers: one call for many layers)."""
    n, rows = level.query_rows.shape
    lead, (num_heads, head_dim) = q.shape[:-3], q.shape[-2:]
    num_kv = k_cache.shape[-2]
    group = num_heads // num_kv
    qs = q.index_select(-3, level.query_rows.reshape(-1)).float()  # [..., n*R, Hq, D]
    qs = qs.view(*lead, n, rows, num_kv, group, head_dim).transpose(-4, -3).reshape(
        *lead, n, num_kv, rows * group, head_dim)
    k = _gather(k_cache, k_scale, level.kv_slots.reshape(-1)).view(*lead, n, -1, num_kv, head_dim)
    k = k.permute(*range(len(lead)), -4, -2, -1, -3)  # [..., n, Hkv, D, L]
    scores = torch.matmul(qs, k).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores.masked_fill_(_hidden(level, query_pos, group, window), float("-inf"))


def _rows_lse(lse: Tensor, level: LevelPlan, num_heads: int) -> Tensor:
    """``[..., n, Hkv, R*G]`` LSE of a level as ``[..., n, R, heads]``."""
    n, rows = level.query_rows.shape
    lead, num_kv = lse.shape[:-3], lse.shape[-2]
    return lse.view(*lead, n, num_kv, rows, num_heads // num_kv).transpose(-3, -2).reshape(*lead, n, rows, num_heads)


def _attend_level(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_pos: Tensor, level: LevelPlan, scale: float,
                  k_scale: Tensor | None = None, v_scale: Tensor | None = None, window: int | None = None,
                  softcap: float | None = None):
    """Attention of every segment of one level against the query rows below it → (o, lse) per row."""
    n, rows = level.query_rows.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[1]
    scores = _level_scores(q, k_cache, query_pos, level, scale, k_scale, window, softcap)
    v = _gather(v_cache, v_scale, level.kv_slots.reshape(-1)).view(n, -1, num_kv, head_dim).transpose(1, 2)
    lse = torch.logsumexp(scores, dim=-1)  # [n, Hkv, R*G]
    lse_safe = lse.masked_fill(torch.isinf(lse), 0.0)
    out = torch.matmul(torch.exp(scores - lse_safe.unsqueeze(-1)), v)  # [n, Hkv, R*G, D]  (v: [n, Hkv, L, D])
    out = out.view(n, num_kv, rows, num_heads // num_kv, head_dim).permute(0, 2, 1, 3, 4).reshape(
        n, rows, num_heads, head_dim)
    return out, _rows_lse(lse, level, num_heads)


# fp32 scores tree_lse_reference holds at once at most (1 GiB): a level with more keys is scored in chunks of keys
LSE_SCORE_ELEMENTS = 2**28


def _key_chunks(level: LevelPlan, score_rows: int) -> list[LevelPlan]:
    """``level``, or the same level cut into chunks of keys whose scores (``score_rows`` per key) fit
    ``LSE_SCORE_ELEMENTS``; the chunks are kept on the level (their masks are made once per pass)."""
    keys = level.kv_slots.shape[1]
    step = max(1, LSE_SCORE_ELEMENTS // max(1, score_rows))
    if keys <= step:
        return [level]
    cached = level.mask_cache.get("key_chunks")
    if cached is None or cached[0] != step:
        parts = [dataclasses.replace(level, kv_slots=level.kv_slots[:, a : a + step], kv_pos=level.kv_pos[:, a : a + step],
                                     mask_cache={}) for a in range(0, keys, step)]
        cached = level.mask_cache["key_chunks"] = (step, parts)
    return cached[1]


def tree_lse_reference(q: Tensor, k_cache: Tensor, plan: TreeAttentionPlan, scale: float,
                       k_scale: Tensor | None = None) -> Tensor:
    """Each query row's LSE over every key it sees, ``[num_queries, num_heads]`` fp32 (natural log;
    -inf: no key) — :func:`tree_attention_reference`'s ``return_lse`` without the values: no value is
    read and no output computed, the levels' LSEs merged by ``logaddexp`` (what sparse window
    attention normalises its weights by, every compaction, in every layer).

    ``q [..., num_queries, heads, head_dim]`` and ``k_cache [..., slots, kv_heads, head_dim]`` (scales
    ``[..., slots, kv_heads]``) may carry the same leading dimensions — several layers in one call, the
    plan being the same for every layer — giving ``[..., num_queries, heads]``."""
    lead, (num_q, num_heads) = q.shape[:-3], q.shape[-3:-1]
    lse_acc = torch.full((*lead, num_q, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for level in plan.levels:
        lse = None
        for part in _key_chunks(level, math.prod(lead) * level.query_rows.numel() * num_heads):
            scores = _level_scores(q, k_cache, plan.query_pos, part, scale, k_scale, plan.window, plan.softcap)
            part_lse = torch.logsumexp(scores, dim=-1)
            lse = part_lse if lse is None else torch.logaddexp(lse, part_lse)
        lse = _rows_lse(lse, level, num_heads)
        lse = lse.reshape(*lead, -1, num_heads).index_select(-2, level.valid_index)
        lse_acc.index_copy_(len(lead), level.valid_rows,
                            torch.logaddexp(lse_acc.index_select(-2, level.valid_rows), lse))
    return lse_acc


def tree_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TreeAttentionPlan, scale: float,
                             k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                             return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """PyTorch reference (fp32 maths): one batched attention per tree level, LSE-merged.

    q: [num_queries, num_heads, head_dim]; k_cache, v_cache: [num_slots, num_kv_heads, head_dim]
    (the query rows' own keys must already be written); k_scale, v_scale: [num_slots, num_kv_heads]
    fp32 for an 8-bit cache (None: the cache holds the values themselves). Returns
    [num_queries, num_heads, head_dim] in q's dtype; with ``return_lse`` also each row's LSE over every
    key it sees, ``[num_queries, num_heads]`` fp32 (natural log; -inf: no key), which is what sparse
    window attention normalises its attention weights by. Loops in Python over tree levels only, never
    over segments or query rows.
    """
    num_q, num_heads, head_dim = q.shape
    o_acc = torch.zeros(num_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((num_q, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for i, level in enumerate(plan.levels):
        out, lse = _attend_level(q, k_cache, v_cache, plan.query_pos, level, scale, k_scale, v_scale,
                                 plan.window, plan.softcap)
        o_new = out.reshape(-1, num_heads, head_dim).index_select(0, level.valid_index)
        lse_new = lse.reshape(-1, num_heads).index_select(0, level.valid_index)
        if i:  # merge into what the rows hold from the levels above (each row appears once per level)
            o_new, lse_new = merge_attention_states(o_acc.index_select(0, level.valid_rows),
                                                    lse_acc.index_select(0, level.valid_rows), o_new, lse_new)
        o_acc.index_copy_(0, level.valid_rows, o_new)
        lse_acc.index_copy_(0, level.valid_rows, lse_new)
    return (o_acc.to(q.dtype), lse_acc) if return_lse else o_acc.to(q.dtype)


def check_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TreeAttentionPlan,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Raise ValueError naming the offending argument when shapes, dtypes or devices disagree."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected q [Q, Hq, D] and k_cache == v_cache shape [S, Hkv, D]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"head_dim differs: q has {q.shape[2]}, k_cache has {k_cache.shape[2]}")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[1]}")
    if q.shape[0] != plan.num_queries:
        raise ValueError(f"q has {q.shape[0]} rows, the plan was made for {plan.num_queries}")
    if not (q.device == k_cache.device == v_cache.device == plan.query_pos.device):
        raise ValueError(f"devices differ: q {q.device}, k_cache {k_cache.device}, v_cache {v_cache.device}, plan {plan.query_pos.device}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (an 8-bit cache) or neither")
    if k_scale is None:
        if not (q.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype} "
                             "(an 8-bit cache needs k_scale and v_scale)")
        return
    if k_cache.dtype not in EIGHT_BIT_STORAGE or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_scale/v_scale are for an 8-bit cache (int8 or float8_e4m3fn); got k_cache "
                         f"{k_cache.dtype}, v_cache {v_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.shape != k_cache.shape[:2] or s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(f"{name} must be fp32 [num_slots, num_kv_heads] = {tuple(k_cache.shape[:2])} on "
                             f"{k_cache.device}, got {s.dtype} {tuple(s.shape)} on {s.device}")
    if s.stride() != k_scale.stride() or k_scale.stride(1) != 1:
        raise ValueError("k_scale and v_scale need equal strides and contiguous heads")


def library_copy(plan: TreeAttentionPlan, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None,
                 v_scale: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """The keys/values the plan's library segment reads from an 8-bit cache, dequantized to ``dtype`` now,
    to be passed as :func:`tree_attention`'s ``library_kv`` by every later call of this plan on this
    layer's cache while the segment's KV stays as it is (a decode phase: the segment is shared, so no
    row writes it). None when the plan has no library segment or the cache holds the values themselves."""
    if k_scale is None or plan.triton is None or plan.triton.library is None:
        return None
    return dequantized_segment(plan.triton.library, k_cache, v_cache, k_scale, v_scale, dtype)


def library_copy_bytes(plan: TreeAttentionPlan, k_cache: Tensor, dtype: torch.dtype) -> int:
    """The memory one layer's :func:`library_copy` takes (0: none)."""
    if plan.triton is None or plan.triton.library is None:
        return 0
    seg = plan.triton.library
    return 2 * seg.chunks * seg.chunk_len * k_cache.shape[1] * k_cache.shape[2] * dtype.itemsize


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TreeAttentionPlan, scale: float,
                   k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                   library_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Dispatcher: the one entry point the runtime calls. Shapes as in :func:`tree_attention_reference`
    (``k_scale``/``v_scale``: the scales of an 8-bit cache, None otherwise). ``library_kv``: this layer's
    :func:`library_copy` of the plan (None: the library segment, if any, reads the cache).

    Runs the backend the plan was made for (``plan.backend``; see :func:`plan_tree_attention`).
    """
    check_inputs(q, k_cache, v_cache, plan, k_scale, v_scale)
    if plan.backend == "triton":
        if plan.triton.group != q.shape[1] // k_cache.shape[1]:
            raise ValueError(f"the plan was made for {plan.triton.group} query heads per KV head, "
                             f"q/k_cache have {q.shape[1] // k_cache.shape[1]}")
        return tree_attention_triton(q, k_cache, v_cache, plan.triton, plan.query_pos, scale, k_scale, v_scale,
                                     window=plan.window, softcap=plan.softcap, library_kv=library_kv)
    if library_kv is not None:
        raise ValueError("library_kv is for a plan with a library segment (the Triton backend's); this plan has none")
    return tree_attention_reference(q, k_cache, v_cache, plan, scale, k_scale, v_scale)
