"""KV formats: how keys and values are stored in the cache, and their PyTorch quantization reference.

A KV *format* is what the kernels read: the model's own dtype (no scales), or an 8-bit one with one
fp32 scale per token and KV head:

* ``"int8"`` — symmetric INT8: ``scale = amax / 127`` over the head's ``head_dim`` values, stored
  ``round(x / scale)`` (half away from zero), read back as ``q * scale``;
* ``"fp8"`` — FP8 e4m3 (``torch.float8_e4m3fn``): ``scale = amax / 448``, stored ``x / scale`` rounded to
  e4m3 (nearest even), read back as ``q * scale``.

``amax`` is taken on the value rounded to the model dtype (what an unquantized cache would hold), so
the only error is the 8-bit rounding: at most half a step, ``scale / 2`` for INT8. A head whose values
are all zero gets scale 0 and reads back zeros. A cache in an 8-bit format is ``[slots, kv_heads,
head_dim]`` in the storage dtype plus ``[slots, kv_heads]`` fp32 scales, for keys and values alike:
``head_dim + 4`` bytes per token and head instead of ``2 * head_dim`` (bf16).

The attention kernels dequantize in registers: a key block's scores are ``(q . k_q) * k_scale`` and the
probabilities are multiplied by ``v_scale`` before the product with ``v_q``, which is the same maths as
attending the dequantized cache. The fused RoPE kernel (:func:`treegen.kernels.fused_ops.rope_`)
quantizes on the way into the cache; :func:`quantize_reference` is its reference and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treegen.kernels.launch import Launcher
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

# the 8-bit formats: storage dtype and the largest stored magnitude
_EIGHT_BIT = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
KV_DTYPES = (None, *_EIGHT_BIT)  # None: the model's dtype
STORAGE_QMAX = dict(_EIGHT_BIT.values())  # 8-bit storage dtype → largest stored magnitude
EIGHT_BIT_STORAGE = tuple(STORAGE_QMAX)
# FP8 conversion in hardware: Ada (8.9) and Hopper (9.0) and newer
_FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class KVFormat:
    """How KV is stored: ``storage`` dtype; ``name`` ("int8", "fp8", or the model dtype's name);
    ``qmax`` the largest stored magnitude (0 for an unquantized format, which has no scales)."""

    name: str
    storage: torch.dtype
    qmax: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    @property
    def bytes_per_value(self) -> int:
        return self.storage.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per token and KV head (for keys or for values)."""
        return 4 if self.quantized else 0


def kv_format(kv_dtype: str | None, model_dtype: torch.dtype, device: torch.device | str = "cpu") -> KVFormat:
    """The format for ``kv_dtype`` (None: the model's dtype) on ``device``.

    Raises ValueError for an unknown name (listing the choices), and for ``"fp8"`` on a GPU without
    FP8 conversion (naming its compute capability)."""
    if kv_dtype is None or kv_dtype == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    if kv_dtype not in _EIGHT_BIT:
        choices = ", ".join(repr(c) for c in KV_DTYPES)
        raise ValueError(f"kv_dtype must be one of {choices} (None or 'auto': the model's dtype), got {kv_dtype!r}")
    device = torch.device(device)
    if kv_dtype == "fp8" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < _FP8_MIN_CAPABILITY:
            raise ValueError(f"kv_dtype='fp8' needs a GPU with FP8 conversion (compute capability "
                             f"{_FP8_MIN_CAPABILITY[0]}.{_FP8_MIN_CAPABILITY[1]} or newer); "
                             f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: use kv_dtype='int8'")
    storage, qmax = _EIGHT_BIT[kv_dtype]
    return KVFormat(kv_dtype, storage, qmax)


def quantize_reference(x: Tensor, fmt: KVFormat) -> tuple[Tensor, Tensor]:
    """x [T, kv_heads, head_dim] (model dtype) → (stored [T, kv_heads, head_dim] in ``fmt.storage``,
    scale [T, kv_heads] fp32). See the module doc for the rule."""
    if not fmt.quantized:
        raise ValueError(f"the {fmt.name} format is not quantized")
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / fmt.qmax
    y = x32 / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if fmt.storage == torch.int8:
        y = torch.floor(y.abs() + 0.5).copysign(y)
    return y.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage), scale


def dequantize_reference(stored: Tensor, scale: Tensor) -> Tensor:
    """stored [..., head_dim] and scale [...] → fp32 values [..., head_dim]."""
    return stored.float() * scale.unsqueeze(-1)


if triton is not None:

    @triton.jit
    def _dequantize_kernel(X, S, OUT, n_rows, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rows ``r`` of ``X`` [n_rows, HEAD_DIM] (8-bit) times ``S[r]`` (fp32), rounded to OUT's dtype."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = (r < n_rows)[:, None]
        offs = r[:, None].to(tl.int64) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        x = tl.load(X + offs, mask=ok).to(tl.float32)  # (no `other`: an int fill has no fp8 cast; stores are masked)
        s = tl.load(S + r, mask=r < n_rows, other=0.0)
        tl.store(OUT + offs, (x * s[:, None]).to(OUT.dtype.element_ty), mask=ok)


# each kernel's launcher: Triton's per-call Python skipped once a variant is known (treegen.kernels.launch)
_LAUNCH = {k.fn.__name__: Launcher(k) for k in (_dequantize_kernel,)} if triton is not None else {}


def dequantize(stored: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``dequantize_reference(stored, scale).to(dtype)`` — one kernel on CUDA (same rounding: the fp32
    product rounded once). stored [..., head_dim] contiguous, scale [...] contiguous fp32."""
    head_dim = stored.shape[-1]
    if not (stored.is_cuda and triton is not None and stored.is_contiguous() and scale.is_contiguous()
            and head_dim & (head_dim - 1) == 0):
        return dequantize_reference(stored, scale).to(dtype)
    out = torch.empty(stored.shape, dtype=dtype, device=stored.device)
    rows, block = scale.numel(), 64
    if rows:
        _LAUNCH["_dequantize_kernel"][(triton.cdiv(rows, block),)](stored, scale, out, rows, HEAD_DIM=head_dim,
                                                       BLOCK_R=block, num_warps=4)
    return out


__all__ = ["EIGHT_BIT_STORAGE", "KVFormat", "KV_DTYPES", "STORAGE_QMAX", "dequantize", "dequantize_reference",
           "kv_format", "quantize_reference"]
