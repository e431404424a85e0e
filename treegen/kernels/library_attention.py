"""A large shared segment attended by a library kernel: cuDNN's fused attention, with its LSE.

When thousands of query rows (branches x query heads) read one long shared prefix, its attention is a
dense, compute-bound attention of the FlashAttention-3 kind. On Hopper, cuDNN's fused attention runs
it at ~560-670 TFLOP/s, against ~410-480 for our Triton segment kernel (measured on an H100, bf16,
d=128: batch 1024 x 16K prefix 8/1 heads 109 us vs 142 us; Llama-3-8B heads 32/8, 1024 x 2K 62 vs 82 us).
So the tree-attention plan gives at most one such segment (:class:`LibrarySegment`) to this kernel:
its keys are cut into ``chunks`` equal runs, passed as a batch (a view of the cache, no copy) so that
few rows x a long prefix still fill the GPU, and its partial outputs and natural-log LSEs are merged
by the Triton kernels like any other partial (a negative merge index names a library partial).

An 8-bit cache (:mod:`treegen.kernels.kv_quant`) is read the same way after the segment's keys and
values are dequantized to the query dtype (:func:`dequantized_segment`): once per call, or — a decode
phase, whose segment does not change while its steps read it — once per phase and layer by the runtime,
which passes the copy as ``library_kv``. Per call it cost 246 us a decode step of the Llama-3-8B shape
(two ~3.8 us launches a layer; FP8, 256 branches x 2,047 keys, one H100: 10.16 ms a step, tree/none 0.80);
the Triton kernels reading the FP8 segment directly were slower still (10.91 ms; at 1,024 branches 29.66
vs 26.43 ms: the segment is compute-bound, and cuDNN is faster at it).

The PyTorch reference (:func:`segment_attention_torch`) gives the same partials on any device; CI runs
the whole plan with it under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from treegen.kernels.kv_quant import dequantize

# the cuDNN path was measured on Hopper (sm90) only; elsewhere the Triton kernels attend every segment
_MIN_CAPABILITY = (9, 0)
_CUDNN_MIN_VERSION = 90000
LIBRARY_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LibrarySegment:
    """One shared segment's keys ``[start, start + chunks * chunk_len)`` (cache slots) read by query
    ``rows`` (None: every query row, in order; else an int64 tensor of ``num_rows`` rows). Its partial
    ``(c, r)`` — chunk ``c`` for the segment's ``r``-th row — is named ``-1 - (c * num_rows + r)`` in the
    merge index. Keys past ``chunks * chunk_len`` (fewer than ``chunks``) stay with the Triton kernels."""

    start: int
    chunk_len: int
    chunks: int
    num_rows: int
    rows: Tensor | None


def library_available(device, dtype) -> bool:
    """cuDNN fused attention with LSE output for this device and dtype (fp16/bf16 on Hopper or newer)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in LIBRARY_DTYPES or not torch.cuda.is_available():
        return False
    return (torch.cuda.get_device_capability(device) >= _MIN_CAPABILITY
            and torch.backends.cudnn.is_available()
            and (torch.backends.cudnn.version() or 0) >= _CUDNN_MIN_VERSION
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"))


def _operands(q: Tensor, k_cache: Tensor, v_cache: Tensor, seg: LibrarySegment):
    """[chunks, heads, rows, D] views: the query rows repeated per chunk (stride 0), keys/values per chunk."""
    qs = q if seg.rows is None else q.index_select(0, seg.rows)
    q4 = qs.permute(1, 0, 2).unsqueeze(0).expand(seg.chunks, -1, -1, -1)
    keys = slice(seg.start, seg.start + seg.chunks * seg.chunk_len)
    shape = (seg.chunks, seg.chunk_len, k_cache.shape[1], k_cache.shape[2])
    k4, v4 = (c[keys].view(shape).permute(0, 2, 1, 3) for c in (k_cache, v_cache))
    return q4, k4, v4


def dequantized_segment(seg: LibrarySegment, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor,
                        dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The keys and values of the segment's chunks in an 8-bit cache, dequantized to ``dtype``:
    ``[chunks * chunk_len, kv_heads, head_dim]`` each (what ``segment_attention``'s ``library_kv`` takes)."""
    keys = slice(seg.start, seg.start + seg.chunks * seg.chunk_len)
    return tuple(dequantize(c[keys], s[keys], dtype) for c, s in ((k_cache, k_scale), (v_cache, v_scale)))


def _dequantized(q: Tensor, k_cache: Tensor, v_cache: Tensor, seg: LibrarySegment, k_scale, v_scale, library_kv):
    """The segment's keys/values in q's dtype, as a cache of their own (the segment moved to slot 0) when
    the cache is 8-bit: ``library_kv`` if given (dequantized once for many calls), else dequantized now;
    the cache unchanged when it holds the values themselves."""
    if library_kv is not None:
        k, v = library_kv
        length = seg.chunks * seg.chunk_len
        if k.shape != (length, *k_cache.shape[1:]) or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"library_kv must be two {q.dtype} [{length}, {k_cache.shape[1]}, {k_cache.shape[2]}] "
                             f"tensors (the segment's chunks), got {k.dtype} {tuple(k.shape)} and {v.dtype} "
                             f"{tuple(v.shape)}")
        return k, v, replace(seg, start=0)
    if k_scale is None:
        return k_cache, v_cache, seg
    return (*dequantized_segment(seg, k_cache, v_cache, k_scale, v_scale, q.dtype), replace(seg, start=0))


def segment_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, seg: LibrarySegment, scale: float,
                            k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                            library_kv: tuple[Tensor, Tensor] | None = None):
    """Reference: ``(out [chunks, Hq, rows, D] in q's dtype, lse [chunks, Hq, rows] fp32, natural log)``.
    ``k_scale``/``v_scale`` ``[slots, kv_heads]``: the cache is 8-bit (None: it holds the values).
    ``library_kv``: the segment's keys/values already in q's dtype (:func:`dequantized_segment`), read
    instead of the cache."""
    q4, k4, v4 = _operands(q, *_dequantized(q, k_cache, v_cache, seg, k_scale, v_scale, library_kv))
    group = q4.shape[1] // k4.shape[1]
    k4, v4 = (t.float().repeat_interleave(group, 1) for t in (k4, v4))
    s = q4.float() @ k4.transpose(-1, -2) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v4
    return out.to(q.dtype), lse


def folds_heads(group: int) -> bool:
    """Whether the query heads sharing a key head are folded into the query rows for cuDNN (``fold_heads``)
    rather than passed as GQA: for a group that is not a power of two. cuDNN's GQA with a group of 3
    (Phi-4-mini, 24/8 heads) ran slower than our Triton kernels (end to end on an H200 at batch 256 x
    2K: 33.0K vs 39.8K tok/s, ``library_ab_phi-4-mini_h200.json``); folded, it runs multi-head attention
    with ``group`` times the rows, which it is fast at."""
    return group > 1 and group & (group - 1) != 0


def fold_heads(q4: Tensor, kv_heads: int) -> Tensor:
    """``[chunks, Hq, rows, D]`` queries as ``[chunks, kv_heads, group * rows, D]``: the ``group`` query
    heads of one key head stacked along the rows (KV head ``kv``: query head ``kv * group + g``'s row ``r``
    at ``g * rows + r``), copied once (the chunks share it). Exact for a segment every row sees whole (no
    mask: rows are independent)."""
    chunks, heads, rows, dim = q4.shape
    return q4[:1].reshape(1, kv_heads, heads // kv_heads * rows, dim).expand(chunks, -1, -1, -1)


def unfold_heads(out: Tensor, lse: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """The partials of folded queries (``fold_heads``) back as ``[chunks, heads, rows, D]`` and
    ``[chunks, heads, rows]``: views where the layout allows (cuDNN's output follows the queries')."""
    chunks, _, folded, dim = out.shape
    rows = folded * out.shape[1] // heads
    return out.reshape(chunks, heads, rows, dim), lse.reshape(chunks, heads, rows)


def segment_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, seg: LibrarySegment, scale: float,
                      k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                      library_kv: tuple[Tensor, Tensor] | None = None):
    """The segment's partials, as :func:`segment_attention_torch`, by cuDNN on CUDA (any layout: the
    caller reads them through their strides). GQA is native (key heads are not repeated), or for a
    group that is not a power of two folded into the rows (``folds_heads``). An 8-bit cache
    (``k_scale``/``v_scale`` given) is dequantized to q's dtype first (see the module doc), unless
    ``library_kv`` holds the segment's keys/values dequantized already (:func:`dequantized_segment`)."""
    if not q.is_cuda:
        return segment_attention_torch(q, k_cache, v_cache, seg, scale, k_scale, v_scale, library_kv)
    if q.dtype not in LIBRARY_DTYPES:
        raise ValueError(f"the plan gives a segment to cuDNN attention, which takes fp16/bf16, not {q.dtype}; "
                         "plan with dtype= the dtype you run")
    q4, k4, v4 = _operands(q, *_dequantized(q, k_cache, v_cache, seg, k_scale, v_scale, library_kv))
    heads = q4.shape[1]
    fold = folds_heads(heads // k4.shape[1])
    if fold:
        q4 = fold_heads(q4, k4.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, False, False,
                                                                  scale=scale)[:2]
    lse = lse.view(out.shape[:3])  # cuDNN's LSE has a trailing unit dimension
    return unfold_heads(out, lse, heads) if fold else (out, lse)
