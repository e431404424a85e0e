"""Sparse window attention's importance of a branch's own keys: each key's attention weight, summed over a
branch's recorded queries and the query heads of its KV head — ALISA's "local attention sum" (the selection
itself is :func:`treegen.runtime.swa.alisa_select`).

For layer ``l``, branch ``b`` and KV head ``h``: the queries ``q[l, b, t, h*G + g]`` (``t`` < the steps
recorded, ``g`` < the group) at positions ``qpos[b, t]`` (-1: a padding row, which sees nothing) saw the
branch's own keys ``k[l, start[b] + i, h]`` (``i`` < ``written[b]``) at mask positions ``seg_pos[b] + i``
up to their own position, and the keys of the branch's ancestors, whose log-sum-exp ``anc_lse[l, b, t,
h*G + g]`` is given (-inf: none). The weight of own key ``i`` for a row is ``exp(s_i - lse)``, ``s_i =
scale * q . k_i`` (soft-capped where the model does), ``lse`` the row's log-sum-exp over everything it
saw; the result ``[B, L, kv_heads, W]`` (fp32, zero past a branch's written keys) sums it over the rows.

:func:`own_importance_reference` is PyTorch (fp32 maths, score tensors in memory: ~10 GB of traffic a
compaction event of 64 branches at the Llama-3-8B shape); :func:`own_importance` runs the Triton kernel — one
program a (layer, branch, KV head), its rows' scores in registers over two passes of the own keys (the LSE,
then the weights) — where it can (CUDA or the interpreter, no soft cap), else the reference.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from treegen.kernels.launch import Launcher
from treegen.kernels.tree_attention import _gather

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def own_importance_reference(q: Tensor, k_cache: Tensor, k_scale: Tensor | None, anc_lse: Tensor, start: Tensor,
                             written: Tensor, qpos: Tensor, seg_pos: Tensor, scale: float,
                             softcap: float | None = None, width: int | None = None) -> Tensor:
    """``q [L, B, T, H, D]``, ``k_cache [L, slots, kv_heads, D]`` (``k_scale [L, slots, kv_heads]`` for an 8-bit
    cache), ``anc_lse [L, B, T, H]`` fp32, ``start``/``written``/``seg_pos`` ``[B]`` and ``qpos [B, T]`` int64
    (see the module doc) → ``[B, L, kv_heads, width]`` fp32 (``width``: at least the most written)."""
    num_layers, num_b, steps, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[-2]
    width = int(written.max()) if width is None else width
    offs = torch.arange(width, device=q.device)
    slots = (start[:, None] + offs).clamp_max(k_cache.shape[1] - 1)  # [B, W] (past written: masked below)
    keys = _gather(k_cache, k_scale, slots.reshape(-1)).view(num_layers, num_b, width, num_kv, head_dim)
    s = torch.einsum("lbthgd,lbwhd->lbthgw", q.float().view(num_layers, num_b, steps, num_kv, -1, head_dim), keys)
    s = s * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    hidden = (offs >= written[:, None])[:, None, :] | ((seg_pos[:, None] + offs)[:, None, :] > qpos[:, :, None])
    s.masked_fill_(hidden[None, :, :, None, None, :], float("-inf"))  # [B, T, W] over every layer and head
    anc = anc_lse.view(num_layers, num_b, steps, num_kv, -1)
    lse = torch.logaddexp(anc, torch.logsumexp(s, dim=-1))
    s.sub_(lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))  # (a row that saw no key stays -inf)
    return s.exp_().sum(dim=(2, 4)).transpose(0, 1).contiguous()  # [B, L, kv_heads, W]


if triton is not None:

    @triton.jit
    def _scores(q, k_base, s_base, start, offs_n, written, seg_pos, qpos, offs_d, stride_ks, stride_ss, scale,
                QUANT: tl.constexpr, PRECISION: tl.constexpr):
        """The rows' scores against own keys ``offs_n`` ``[BLOCK_R, BLOCK_N]`` and which of them the rows
        see (written, at or before the row's position)."""
        key_ok = offs_n < written
        slot = (start + offs_n).to(tl.int64)
        k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        if QUANT:  # (an 8-bit key times its scale: the scale applies to the product)
            s = s * tl.load(s_base + slot * stride_ss, mask=key_ok, other=0.0)[None, :]
        return s * scale, key_ok[None, :] & ((seg_pos + offs_n)[None, :] <= qpos[:, None])

    @triton.jit
    def _own_importance_kernel(Q, K, KS, ANC, START, WRITTEN, QPOS, SEGPOS, OUT,
                               stride_ql, stride_qb, stride_qt, stride_qh,
                               stride_kl, stride_ks, stride_kh,
                               stride_sl, stride_ss,
                               stride_al, stride_ab, stride_at,
                               stride_ob, stride_ol, stride_oh,
                               num_b, num_kv, width, scale, STEPS: tl.constexpr, GROUP: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                               QUANT: tl.constexpr, PRECISION: tl.constexpr):
        """One program a (layer, branch, KV head): its rows (step x group member, padded to BLOCK_R), two
        passes over the branch's own keys — their LSE (merged with the ancestors'), then the weights summed
        over the rows, stored per key."""
        pid = tl.program_id(0)
        h = pid % num_kv
        b = (pid // num_kv) % num_b
        layer = pid // (num_kv * num_b)
        offs_r = tl.arange(0, BLOCK_R)
        t = offs_r // GROUP
        head = h * GROUP + offs_r % GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = t < STEPS
        qpos = tl.load(QPOS + b * STEPS + t, mask=row_ok, other=-1)
        q_off = layer.to(tl.int64) * stride_ql + b * stride_qb + t * stride_qt + head * stride_qh
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        anc = tl.load(ANC + layer.to(tl.int64) * stride_al + b * stride_ab + t * stride_at + head, mask=row_ok,
                      other=float("-inf"))
        start = tl.load(START + b)
        written = tl.load(WRITTEN + b)
        seg_pos = tl.load(SEGPOS + b)
        k_base = K + layer.to(tl.int64) * stride_kl + h * stride_kh
        s_base = KS + layer.to(tl.int64) * stride_sl + h
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        for n0 in range(0, written, BLOCK_N):  # pass 1: the own keys' LSE, online
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s, visible = _scores(q, k_base, s_base, start, offs_n, written, seg_pos, qpos, offs_d, stride_ks,
                                 stride_ss, scale, QUANT, PRECISION)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        own = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        top = tl.maximum(own, anc)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        both = tl.exp(own - top_safe) + tl.exp(anc - top_safe)  # (0 only for a row that saw nothing)
        lse = tl.where(both > 0, top_safe + tl.log(tl.where(both > 0, both, 1.0)), 0.0)  # (its weights: 0 below)
        out_base = OUT + b.to(tl.int64) * stride_ob + layer * stride_ol + h * stride_oh
        for n0 in range(0, written, BLOCK_N):  # pass 2: each key's weight, summed over the rows
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s, visible = _scores(q, k_base, s_base, start, offs_n, written, seg_pos, qpos, offs_d, stride_ks,
                                 stride_ss, scale, QUANT, PRECISION)
            w = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            tl.store(out_base + offs_n, tl.sum(w, axis=0), mask=(offs_n < written) & (offs_n < width))

    _LAUNCH = Launcher(_own_importance_kernel)


def own_importance(q: Tensor, k_cache: Tensor, k_scale: Tensor | None, anc_lse: Tensor, start: Tensor,
                   written: Tensor, qpos: Tensor, seg_pos: Tensor, scale: float, softcap: float | None = None,
                   width: int | None = None) -> Tensor:
    """:func:`own_importance_reference`'s result, by the Triton kernel where it runs (CUDA or the
    interpreter, no soft cap, a head dim of 16-256 that is a power of two, at most 128 rows — recorded steps x
    group — a program, keys with unit stride), else by the reference. ``width``: the result's last dimension,
    at least ``written.max()`` for every weight to be there (given, it saves reading that from the device;
    a smaller one leaves out the weights of the keys past it)."""
    num_layers, num_b, steps, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[-2]
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    block_r = max(16, 1 << max(0, steps * (num_heads // num_kv) - 1).bit_length())  # rows a program holds
    if (triton is None or softcap is not None or (not q.is_cuda and not interpreting)
            or head_dim & (head_dim - 1) or not 16 <= head_dim <= 256 or block_r > 128
            or k_cache.stride(-1) != 1 or (k_scale is not None and k_scale.stride(-1) != 1)):
        return own_importance_reference(q, k_cache, k_scale, anc_lse, start, written, qpos, seg_pos, scale,
                                        softcap, width)
    width = int(written.max()) if width is None else width
    group = num_heads // num_kv
    q, anc_lse, qpos = q.contiguous(), anc_lse.contiguous(), qpos.contiguous()
    start, written, seg_pos = start.contiguous(), written.contiguous(), seg_pos.contiguous()

    out = torch.zeros(num_b, num_layers, num_kv, width, dtype=torch.float32, device=q.device)
    quant = k_scale is not None
    scales = k_scale if quant else anc_lse  # (any tensor: not read)
    _LAUNCH[(num_layers * num_b * num_kv,)](
        q, k_cache, scales, anc_lse, start, written, qpos, seg_pos, out,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scales.stride(0) if quant else 0, scales.stride(1) if quant else 0,
        anc_lse.stride(0), anc_lse.stride(1), anc_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        num_b, num_kv, width, float(scale), STEPS=steps, GROUP=group, HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_N=64,
        QUANT=quant, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out
