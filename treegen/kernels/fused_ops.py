"""Fused element-wise steps of a decoder layer (CUDA), each beside its PyTorch reference.

A decode step of a small batch is many tiny kernels: an unfused layer launches ~40 (RMSNorm alone is
eight: cast, square, mean, add, rsqrt, multiply, cast, scale; RoPE ten), and at a few microseconds
each they, not the matrix products, set the step time. These kernels do each step in one launch:

* :func:`add_rms_norm` — ``h += y`` (the residual add) then ``x = RMSNorm(h)``;
* :func:`rope_` — rotary embedding of the query and key heads of a fused QKV projection, in place,
  optionally writing the keys and values straight into the KV cache (no separate cache-write kernels),
  quantizing them for an 8-bit cache;
* :func:`silu_mul` — ``silu(gate) * up`` from a fused gate/up projection.

They round where Hugging Face's PyTorch code rounds (every intermediate that HF holds in the model
dtype is rounded to it here too), so in bf16 they agree with the references to the last bit except
for fp32 summation order inside RMSNorm's mean. The references are the CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from treegen.kernels.kv_quant import STORAGE_QMAX
from treegen.kernels.launch import Launcher, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


# --------------------------------------------------------------------------- references (HF maths)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF ``LlamaRMSNorm``: normalise in fp32, cast back, then scale.  x [..., hidden]."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[..., d] -> [..., d] with halves (x1, x2) -> (-x2, x1), as in HF."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF ``apply_rotary_pos_emb`` for one of q / k: x [T, heads, D], cos/sin [T, 1, D] (model dtype)."""
    return x * cos + rotate_half(x) * sin


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for gate_up = [gate | up] along the last axis."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(H, Y, W, X, hidden, stride_h, stride_y, stride_x, eps,
                             HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < hidden
        h = tl.load(H + row * stride_h + offs, mask=ok, other=0.0)
        if HAS_Y:  # the residual add, rounded to the model dtype as torch's add does
            h = (h.to(tl.float32) + tl.load(Y + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32))
            h = h.to(H.dtype.element_ty)
            tl.store(H + row * stride_h + offs, h, mask=ok)
        h32 = h.to(tl.float32)
        var = tl.sum(h32 * h32, axis=0) / hidden
        normed = (h32 * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(X + row * stride_x + offs, (w * normed).to(X.dtype.element_ty), mask=ok)

    @triton.jit
    def _quantize_rows(x, QMAX: tl.constexpr, INT8: tl.constexpr):
        """Rows of ``x`` [R, D] (fp32, already rounded to the model dtype) → (8-bit values as fp32, scales [R]):
        ``scale = amax / QMAX``, INT8 rounds half away from zero (the rule of kv_quant.quantize_reference);
        FP8 rounds when the caller casts to e4m3."""
        scale = tl.max(tl.abs(x), axis=1) / QMAX
        y = x / tl.where(scale > 0, scale, 1.0)[:, None]
        if INT8:
            y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
        return tl.minimum(tl.maximum(y, -QMAX), QMAX), scale

    @triton.jit
    def _rope_kernel(QKV, COS, SIN, KC, VC, SLOTS, KS, VS, n_q, n_kv, stride_t, stride_h, stride_c, stride_ct,
                     stride_ch, stride_st,
                     HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                     STORE: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        # the first ROT_DIM dims of each head rotate (rotate_half within them); the rest pass through
        # (partial rotary, Phi-3/4)
        half: tl.constexpr = ROT_DIM // 2
        rotated = offs_d < ROT_DIM
        rot_d = tl.where(rotated, (offs_d + half) % ROT_DIM, offs_d)
        sign = tl.where(offs_d < half, -1.0, 1.0)
        ok = (offs_h < n_q + n_kv)[:, None]  # the query and key heads are rotated
        base = QKV + t * stride_t + offs_h[:, None] * stride_h
        x = tl.load(base + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        x_rot = tl.load(base + rot_d[None, :], mask=ok, other=0.0).to(tl.float32) * sign[None, :]
        dt = QKV.dtype.element_ty
        c = tl.load(COS + t * stride_c + offs_d, mask=rotated, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * stride_c + offs_d, mask=rotated, other=0.0).to(tl.float32)
        a = (x * c[None, :]).to(dt).to(tl.float32)  # x * cos, rounded as in HF
        b = (x_rot * s[None, :]).to(dt).to(tl.float32)  # rotate_half(x) * sin, rounded
        out = tl.where(rotated[None, :], a + b, x).to(dt)
        tl.debug_barrier()  # every lane has read its rotated partner before any lane writes
        if STORE:  # queries in place; keys (rotated) and values straight into the KV cache at this token's slot
            slot = tl.load(SLOTS + t).to(tl.int64)
            is_q = (offs_h < n_q)[:, None]
            tl.store(base + offs_d[None, :], out, mask=ok & is_q)
            kv_rows = slot * stride_ct + (offs_h - n_q)[:, None] * stride_ch + offs_d[None, :]
            offs_v = tl.arange(0, BLOCK_KV)
            v_ok = (offs_v < n_kv)[:, None]
            v = tl.load(QKV + t * stride_t + (n_q + n_kv + offs_v)[:, None] * stride_h + offs_d[None, :], mask=v_ok)
            v_rows = slot * stride_ct + offs_v[:, None] * stride_ch + offs_d[None, :]
            if QMAX > 0:  # an 8-bit cache: quantize each KV head's row on the way in, store its scale beside it
                k8, k_scale = _quantize_rows(out.to(tl.float32), QMAX, INT8)
                tl.store(KC + kv_rows, k8.to(KC.dtype.element_ty), mask=ok & ~is_q)
                tl.store(KS + slot * stride_st + (offs_h - n_q), k_scale, mask=(offs_h >= n_q) & (offs_h < n_q + n_kv))
                v8, v_scale = _quantize_rows(v.to(tl.float32), QMAX, INT8)
                tl.store(VC + v_rows, v8.to(VC.dtype.element_ty), mask=v_ok)
                tl.store(VS + slot * stride_st + offs_v, v_scale, mask=offs_v < n_kv)
            else:
                tl.store(KC + kv_rows, out.to(KC.dtype.element_ty), mask=ok & ~is_q)
                tl.store(VC + v_rows, v.to(VC.dtype.element_ty), mask=v_ok)
        else:
            tl.store(base + offs_d[None, :], out, mask=ok)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, inter, stride_g, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < inter
        g = tl.load(GU + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_g + inter + offs, mask=ok, other=0.0).to(tl.float32)
        dt = OUT.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded to the model dtype
        tl.store(OUT + row * stride_o + offs, (act * u).to(dt), mask=ok)


# each kernel's launcher: Triton's per-call Python skipped once a variant is known (treegen.kernels.launch)
_LAUNCH = {k.fn.__name__: Launcher(k) for k in (_add_rms_norm_kernel, _rope_kernel, _silu_mul_kernel)} if triton is not None else {}


def _check_rows(name: str, t: Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, features] with contiguous features, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def add_rms_norm(h: Tensor, y: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """``h += y`` in place (when ``y`` is given), then return ``RMSNorm(h) * weight``. h, y [T, hidden]."""
    _check_rows("h", h)
    if y is not None:
        _check_rows("y", y)
        if y.shape != h.shape:
            raise ValueError(f"add_rms_norm: y {tuple(y.shape)} must match h {tuple(h.shape)}")
    x = torch.empty_like(h)
    if h.shape[0]:
        _LAUNCH["_add_rms_norm_kernel"][(h.shape[0],)](
            h, y if y is not None else h, weight, x, h.shape[1], h.stride(0),
            (y if y is not None else h).stride(0), x.stride(0), eps,
            HAS_Y=y is not None, BLOCK=next_power_of_2(h.shape[1]), num_warps=4 if h.shape[1] <= 4096 else 8)
    return x


def rope_(qkv: Tensor, cos: Tensor, sin: Tensor, num_q_heads: int, num_kv_heads: int,
          store: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Rotary embedding of a fused QKV projection ``qkv [T, num_q_heads + 2 * num_kv_heads, D]``
    (any row stride): the query and key heads are rotated in place; cos/sin ``[T, R]`` in the model
    dtype, ``R <= D`` the rotary dims (``R < D``: partial rotary, the first R dims of each head rotate
    and the rest pass through, as HF's Phi-3). ``store=(k_cache, v_cache, slots)``: instead of rotating the keys in place, write the
    rotated keys and the values to ``k_cache[slots]`` / ``v_cache[slots]`` (``[S, num_kv_heads, D]``),
    the KV cache write in the same launch. ``store=(k_cache, v_cache, slots, k_scale, v_scale)``: an
    8-bit cache (int8 or float8_e4m3fn, :mod:`treegen.kernels.kv_quant`) with its fp32 scales
    ``[S, num_kv_heads]``: each KV head's row is quantized on the way in. Returns ``qkv``."""
    heads = num_q_heads + 2 * num_kv_heads
    if qkv.dim() != 3 or qkv.shape[1] != heads or qkv.stride(2) != 1 or qkv.stride(1) != qkv.shape[2]:
        raise ValueError(f"rope_: qkv must be [T, {heads} heads, D] with heads packed in each row, got shape "
                         f"{tuple(qkv.shape)} strides {qkv.stride()}")
    if cos.dim() != 2 or cos.shape[0] != qkv.shape[0] or not 0 < cos.shape[1] <= qkv.shape[2] or cos.shape[1] % 2 \
            or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"rope_: cos/sin must be [T, R] with T = {qkv.shape[0]} and an even R <= D = {qkv.shape[2]}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    qmax, int8 = 0.0, False
    if store is not None:
        if len(store) not in (3, 5):
            raise ValueError(f"rope_: store is (k_cache, v_cache, slots[, k_scale, v_scale]), got {len(store)} items")
        k_cache, v_cache, slots = store[:3]
        if k_cache.shape[1:] != (num_kv_heads, qkv.shape[2]) or v_cache.stride() != k_cache.stride() \
                or k_cache.stride(2) != 1 or slots.shape != (qkv.shape[0],):
            raise ValueError(f"rope_: store needs k/v caches [S, {num_kv_heads}, {qkv.shape[2]}] with equal strides "
                             f"and one slot per token, got {tuple(k_cache.shape)} and slots {tuple(slots.shape)}")
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(f"rope_: k_cache and v_cache dtypes differ: {k_cache.dtype} and {v_cache.dtype}")
        if len(store) == 3 and k_cache.dtype in STORAGE_QMAX:
            raise ValueError(f"rope_: a {k_cache.dtype} (8-bit) cache needs its scales: "
                             "store=(k_cache, v_cache, slots, k_scale, v_scale)")
        k_scale = v_scale = k_cache  # unused unless the cache is 8-bit
        if len(store) == 5:
            k_scale, v_scale = store[3:]
            if k_cache.dtype not in STORAGE_QMAX or any(s.shape != k_cache.shape[:2] or s.dtype != torch.float32
                                                        for s in (k_scale, v_scale)) \
                    or v_scale.stride() != k_scale.stride() or k_scale.stride(1) != 1:
                raise ValueError(f"rope_: an 8-bit store needs an int8/float8_e4m3fn cache and fp32 scales "
                                 f"[S, {num_kv_heads}] with equal strides, got cache {k_cache.dtype} and scales "
                                 f"{k_scale.dtype} {tuple(k_scale.shape)}, {v_scale.dtype} {tuple(v_scale.shape)}")
            qmax, int8 = STORAGE_QMAX[k_cache.dtype], k_cache.dtype == torch.int8
    else:
        k_cache = v_cache = slots = k_scale = v_scale = qkv  # unused
    if qkv.shape[0]:
        _LAUNCH["_rope_kernel"][(qkv.shape[0],)](
            qkv, cos, sin, k_cache, v_cache, slots, k_scale, v_scale, num_q_heads, num_kv_heads, qkv.stride(0),
            qkv.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_scale.stride(0),
            HEAD_DIM=qkv.shape[2], ROT_DIM=cos.shape[1], BLOCK_H=next_power_of_2(num_q_heads + num_kv_heads),
            BLOCK_KV=next_power_of_2(num_kv_heads), STORE=store is not None, QMAX=qmax, INT8=int8,
            num_warps=4)
    return qkv


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * inter]`` = [gate | up]; returns [T, inter]."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must have an even width, got {gate_up.shape[1]}")
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = 1024
        _LAUNCH["_silu_mul_kernel"][(gate_up.shape[0], triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def fused_ops_available(device: torch.device) -> bool:
    """True where the fused kernels run compiled: a CUDA device with triton installed."""
    return triton is not None and torch.device(device).type == "cuda"


__all__ = ["add_rms_norm", "fused_ops_available", "rms_norm_reference", "rope_", "rope_reference",
           "rotate_half", "silu_mul", "silu_mul_reference"]
