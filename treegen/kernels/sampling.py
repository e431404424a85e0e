"""A step's tokens drawn in one pass over the logits: counter-based Gumbel-max with the noise made in
registers (:func:`gumbel_argmax`), and its PyTorch reference beside it (:func:`gumbel_argmax_reference`).

The noise of branch ``b`` at its step ``t`` for token ``j`` is a hash of ``(key_b, t, j)`` (see
:mod:`treegen.runtime.sampler`), so a row's draw is ``argmax_j(logit_j / temperature + gumbel(key, t, j))``
(``argmax_j logit_j`` for a greedy row), over the tokens a constraint's bitmask allows. Made with
PyTorch ops, the hash alone is ~15 element-wise passes over ``[rows, vocab]`` int64 tensors: measured on an
H100 (TinyLlama shape, 256 branches at temperature 1, vocabulary 32,000), 1.2 ms of a 3.7 ms decode step.
The kernel reads each logit once and computes, per row: the best score's token, the score, that token's
logit, and the log-sum-exp of the row's logits before the mask (for the token's log-probability) — one program per
chunk of ``CHUNK_TILES`` tiles of a row, the chunks' partial results combined by a second small kernel.

The integer hash is exact in both; the floats are the reference's operations in the same order
(the division by the temperature rounded to nearest, ``-log(-log(u))`` with libdevice's ``logf`` on the
GPU), so the kernel draws the reference's tokens; the log-sum-exp is accumulated online (equal to
``torch.logsumexp`` within float rounding). Ties go to the lowest token id, as ``torch.argmax``.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from treegen.kernels.launch import Launcher, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

_MASK32 = 0xFFFFFFFF
# the hash's constants (lowbias32) and the per-branch / per-token mixing constants
_MUL1, _MUL2, _KEY_MUL, _LAST_ADD = 0x7FEB352D, 0x846CA68B, 0x9E3779B1, 0x632BE5AB
BLOCK = 1024  # logits per tile of the kernel
CHUNK_TILES = 8  # tiles per program: a row of 32,000 logits is 4 programs, of 128,256 16


# --------------------------------------------------------------------------- reference

def hash32(x: Tensor) -> Tensor:
    """lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def unit_interval(x: Tensor) -> Tensor:
    """32-bit hashes (int64) → float32 uniforms strictly inside (0, 1): the top 24 bits, centred in
    their cell. The largest, (2^24 - 0.5) / 2^24, rounds to 1.0 in float32, whose Gumbel noise is +inf
    (a token drawn whatever its logit, a forbidden one included), so it is clamped below 1."""
    return (((x >> 8).float() + 0.5) / float(1 << 24)).clamp_max(1.0 - 2.0 ** -24)


def uniform_noise(keys: Tensor, steps: Tensor, vocab_size: int, start: int = 0) -> Tensor:
    """Counter-based uniforms in (0, 1). keys, steps: [B] int64 → [B, vocab_size] float32, of token
    ids ``start .. start + vocab_size - 1`` (a slice of the vocabulary gets that slice's noise). On the
    CPU in numpy's wrapping 32-bit arithmetic (the same bits, ~25x faster than int64 tensor ops there)."""
    if keys.device.type == "cpu":
        return _uniform_noise_numpy(keys, steps, vocab_size, start)
    return uniform_noise_reference(keys, steps, vocab_size, start)


def uniform_noise_reference(keys: Tensor, steps: Tensor, vocab_size: int, start: int = 0) -> Tensor:
    """:func:`uniform_noise` in PyTorch int64 ops (any device): the definition."""
    ids = torch.arange(start, start + vocab_size, device=keys.device, dtype=torch.int64)
    x = hash32((keys.unsqueeze(1) * _KEY_MUL + steps.unsqueeze(1)) & _MASK32)
    x = hash32((x ^ ids.unsqueeze(0)) & _MASK32)
    return unit_interval(hash32((x + _LAST_ADD) & _MASK32))


def _hash32_numpy(x: np.ndarray) -> np.ndarray:
    """:func:`hash32` on uint32 arrays, in place (numpy's uint32 products wrap: the low 32 bits)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_MUL1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_MUL2)
    x ^= x >> np.uint32(16)
    return x


def _row_bases_numpy(keys: Tensor, steps: Tensor) -> np.ndarray:
    """Each row's hash of (key, step), uint32 (the first step of :func:`uniform_noise_reference`)."""
    base = (keys.numpy().astype(np.uint64) * np.uint64(_KEY_MUL) + steps.numpy().astype(np.uint64)) & np.uint64(_MASK32)
    return _hash32_numpy(base.astype(np.uint32))


def _unit_interval_numpy(x: np.ndarray) -> Tensor:
    u = ((x >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) / np.float32(1 << 24)
    return torch.from_numpy(np.minimum(u, np.float32(1.0 - 2.0 ** -24)))


def _uniforms_numpy(bases: np.ndarray, ids: np.ndarray) -> Tensor:
    """The uniforms of token ``ids`` under their rows' ``bases`` (broadcast together), as
    :func:`uniform_noise_reference`'s last steps."""
    x = _hash32_numpy(bases ^ ids)
    x += np.uint32(_LAST_ADD)
    return _unit_interval_numpy(_hash32_numpy(x))


def _uniform_noise_numpy(keys: Tensor, steps: Tensor, vocab_size: int, start: int) -> Tensor:
    return _uniforms_numpy(_row_bases_numpy(keys, steps)[:, None],
                           np.arange(start, start + vocab_size, dtype=np.uint32)[None, :])


def _gumbel(u: Tensor) -> Tensor:
    return -torch.log(-torch.log(u))


# the range of gumbel_noise's values: u in [2^-25, 1 - 2^-24] gives -log(-log(u)) in about [-2.852, 16.636]
GUMBEL_SPAN = 16.636 + 2.852


def gumbel_argmax_sparse(scaled: Tensor, keys: Tensor, steps: Tensor) -> Tensor:
    """``(scaled + gumbel_noise(keys, steps, V)).argmax(-1)`` on the CPU, with noise made only for the
    tokens that can win: a token whose scaled logit is more than the noise's range (plus a margin for
    rounding) below its row's largest can never outscore that one, whatever their noise. A language
    model's rows keep a few dozen to a few thousand of their tokens, so the hash runs on those alone (rows
    where more than a quarter could win take the whole noise).
    scaled: [B, V] fp32 (``-inf`` where filtered out)."""
    rows_n, vocab = scaled.shape
    top = scaled.max(-1, keepdim=True).values
    margin = GUMBEL_SPAN + 1.0 + top.abs() * 2.0 ** -16  # (rounding of large scaled logits)
    can_win = scaled >= top - margin
    # flat rows (a random model's): the whole noise is cheaper; a row whose best is not finite (NaN, inf,
    # every token filtered) has no bound to prune by: the whole noise, as the definition
    if int(can_win.sum()) * 4 > can_win.numel() or not bool(torch.isfinite(top).all()):
        return (scaled + gumbel_noise(keys, steps, vocab)).argmax(-1)
    rows, cols = can_win.nonzero(as_tuple=True)  # row-major: each row's tokens in id order
    u = _uniforms_numpy(_row_bases_numpy(keys, steps)[rows.numpy()], cols.numpy().astype(np.uint32))
    score = scaled[rows, cols] + _gumbel(u)
    best = torch.full((rows_n,), float("-inf")).scatter_reduce(0, rows, score, "amax")
    first = score == best[rows]  # the lowest id among equal best scores, as argmax
    return torch.full((rows_n,), vocab, dtype=torch.int64).scatter_reduce(0, rows[first], cols[first], "amin")


def gumbel_noise(keys: Tensor, steps: Tensor, vocab_size: int, start: int = 0) -> Tensor:
    """Gumbel noise ``-log(-log(u))`` of :func:`uniform_noise`'s uniforms: [B, vocab_size] float32."""
    return _gumbel(uniform_noise(keys, steps, vocab_size, start))


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """A token bitmask ``[B, ceil(V / 32)]`` int32 (bit ``j % 32`` of word ``j // 32`` set: token ``j``
    allowed, xgrammar's layout) → ``[B, V]`` bool."""
    ids = torch.arange(vocab_size, device=bitmask.device)
    return ((bitmask[:, ids // 32] >> (ids % 32)) & 1).bool()


def gumbel_argmax_reference(logits: Tensor, temperature: Tensor, keys: Tensor, steps: Tensor,
                            bitmask: Tensor | None = None, start: int = 0, all_greedy: bool = False,
                            floor: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of ``logits [B, V]`` fp32 (token ids ``start ..``): the token (an index into the row,
    int64) whose score is largest — the logit where the row's ``temperature`` is 0, else ``logit /
    temperature + gumbel(key, step, start + j)`` — among the tokens ``bitmask [B, ceil(V / 32)]`` allows
    (None: all) and, in rows that sample, whose scaled logit ``logit / temperature`` is at least the
    row's ``floor [B]`` fp32 (None: no floor; top-p / top-k filtering, see
    :func:`~treegen.kernels.filter_floor.filter_floor_reference`); its score, its logit, and the log-sum-exp
    of the row's logits before the mask: ``(token [B] int64, score [B], logit [B], lse [B])`` fp32.
    ``all_greedy``: every temperature is 0."""
    lse = logits.logsumexp(-1)
    masked = logits if bitmask is None else logits.masked_fill(~allowed_tokens(bitmask, logits.shape[1]),
                                                               float("-inf"))
    score = masked
    if not all_greedy:
        scaled = masked / temperature.clamp_min(1e-6).unsqueeze(1)
        if floor is not None:
            scaled = scaled.masked_fill(scaled < floor.unsqueeze(1), float("-inf"))
        score = torch.where((temperature == 0).unsqueeze(1), masked,
                            scaled + gumbel_noise(keys, steps, logits.shape[1], start))
    best = score.argmax(-1, keepdim=True)
    return best.squeeze(1), score.gather(1, best).squeeze(1), masked.gather(1, best).squeeze(1), lse


# --------------------------------------------------------------------------- kernels

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _hash32(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _log(x, PRECISE: tl.constexpr):
        if PRECISE:  # libdevice's logf, as torch.log on CUDA (the interpreter has no libdevice)
            return libdevice.log(x)
        else:
            return tl.log(x)

    @triton.jit
    def _gumbel_partial_kernel(L, stride_l, TEMP, KEYS, STEPS, MASK, stride_m, FLOOR, V, start, CHUNK,
                               P_SCORE, P_TOKEN, P_LOGIT, P_MAX, P_SUM, parts,
                               GREEDY: tl.constexpr, HAS_MASK: tl.constexpr, HAS_FLOOR: tl.constexpr,
                               REDO: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        lo = part * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        temp = tl.load(TEMP + row)
        greedy_row = temp == 0
        divisor = tl.maximum(temp, 1e-6)
        base = (tl.load(KEYS + row).to(tl.int64) * 0x9E3779B1 + tl.load(STEPS + row).to(tl.int64)) & 0xFFFFFFFF
        base = _hash32(base)
        if HAS_FLOOR:
            floor = tl.load(FLOOR + row)
            if REDO:  # a row without a floor keeps its draw (see gumbel_argmax): nothing to read
                hi = tl.where(floor == -float("inf"), lo, hi)
        best_score = -float("inf")
        best_token = lo.to(tl.int64)
        best_logit = -float("inf")
        run_max = -float("inf")
        run_sum = 0.0
        offs = tl.arange(0, BLOCK)
        for off in range(lo, hi, BLOCK):
            j = off + offs
            ok = j < hi
            x = tl.load(L + row * stride_l + j, mask=ok, other=-float("inf")).to(tl.float32)
            # log-sum-exp of the logits before the mask, online
            tile_max = tl.max(x, axis=0)
            new_max = tl.maximum(run_max, tile_max)
            safe = tl.where(new_max == -float("inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(x - safe), axis=0)
            run_max = new_max
            if HAS_MASK:
                word = tl.load(MASK + row * stride_m + j // 32, mask=ok, other=0)
                x = tl.where(((word >> (j % 32)) & 1) != 0, x, -float("inf"))
            if GREEDY:
                score = x
            else:
                h = _hash32((base ^ (start + j).to(tl.int64)) & 0xFFFFFFFF)
                h = _hash32((h + 0x632BE5AB) & 0xFFFFFFFF)
                u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * 5.960464477539063e-08, 1.0 - 5.960464477539063e-08)  # / 2^24
                noise = -_log(-_log(u, PRECISE), PRECISE)
                scaled = tl.math.div_rn(x, divisor)
                if HAS_FLOOR:
                    scaled = tl.where(scaled < floor, -float("inf"), scaled)
                score = tl.where(greedy_row, x, scaled + noise)
            score = tl.where(ok, score, -float("inf"))
            tile_best = tl.max(score, axis=0)
            at = tl.argmax(score, axis=0)  # the first of equal scores
            if tile_best > best_score:  # (strictly: an earlier tile keeps a tie)
                best_score = tile_best
                best_token = (off + at).to(tl.int64)
                best_logit = tl.max(tl.where(offs == at, x, -float("inf")), axis=0)
        out = row * parts + part
        tl.store(P_SCORE + out, best_score)
        tl.store(P_TOKEN + out, best_token)
        tl.store(P_LOGIT + out, best_logit)
        tl.store(P_MAX + out, run_max)
        tl.store(P_SUM + out, run_sum)

    @triton.jit
    def _gumbel_combine_kernel(P_SCORE, P_TOKEN, P_LOGIT, P_MAX, P_SUM, parts, TOKEN, SCORE, LOGIT, LSE, FLOOR,
                               REDO: tl.constexpr, PRECISE: tl.constexpr, BLOCK_P: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_P)
        ok = k < parts
        write = True
        if REDO:  # a row without a floor keeps its draw
            write = tl.load(FLOOR + row) != -float("inf")
        score = tl.load(P_SCORE + row * parts + k, mask=ok, other=-float("inf"))
        at = tl.argmax(score, axis=0)  # the first chunk among equal scores: the lowest token id
        pick = k == at
        tl.store(TOKEN + row, tl.sum(tl.where(pick, tl.load(P_TOKEN + row * parts + k, mask=ok, other=0), 0), axis=0),
                 mask=write)
        tl.store(SCORE + row, tl.max(score, axis=0), mask=write)
        tl.store(LOGIT + row, tl.max(tl.where(pick, tl.load(P_LOGIT + row * parts + k, mask=ok,
                                                            other=-float("inf")), -float("inf")), axis=0), mask=write)
        maxes = tl.load(P_MAX + row * parts + k, mask=ok, other=-float("inf"))
        sums = tl.load(P_SUM + row * parts + k, mask=ok, other=0.0)
        top = tl.max(maxes, axis=0)
        safe = tl.where(top == -float("inf"), 0.0, top)
        total = tl.sum(tl.where(maxes == -float("inf"), 0.0, sums * tl.exp(maxes - safe)), axis=0)
        tl.store(LSE + row, safe + _log(total, PRECISE), mask=write)

_LAUNCH = {k.fn.__name__: Launcher(k) for k in (_gumbel_partial_kernel, _gumbel_combine_kernel)} \
    if triton is not None else {}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# the logits the kernel reads (16-bit ones converted exactly as they are loaded)
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available(logits: Tensor) -> bool:
    """The runtime draws these logits with the kernel: on CUDA, with triton (the CPU takes the PyTorch
    ops; tests run the kernel there under ``TRITON_INTERPRET=1`` by calling :func:`gumbel_argmax`)."""
    return triton is not None and logits.is_cuda


def _chunk(vocab: int) -> int:
    """Logits per program: ``CHUNK_TILES`` tiles — by the vocabulary alone, so a row's log-sum-exp is
    summed in the same order whatever the batch (its log-probabilities do not depend on what runs beside it)."""
    return min(CHUNK_TILES, -(-vocab // BLOCK)) * BLOCK


def gumbel_argmax(logits: Tensor, temperature: Tensor, keys: Tensor, steps: Tensor,
                  bitmask: Tensor | None = None, start: int = 0, all_greedy: bool = False,
                  floor: Tensor | None = None, redo: tuple | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`gumbel_argmax_reference` in one pass over the logits (see the module doc). ``logits``
    ``[B, V]`` fp32, or fp16/bf16 (the model's own: converted to fp32 as they are loaded, exactly, so
    the result is that of their fp32 copy, without writing and reading one: at a 128K vocabulary and
    1,024 rows 0.5 GB a step); ``temperature`` ``[B]`` fp32; ``keys``, ``steps``
    ``[B]`` int64; ``bitmask`` ``[B, ceil(V / 32)]`` int32 or None; ``floor`` ``[B]`` fp32 or None.
    ``redo``: the four results of this same draw without a floor — a row whose floor is -inf would draw the
    same, so it keeps them and its logits are not read again; the other rows are drawn again into them
    (returned). No host sync (CUDA graphs capture it)."""
    rows, vocab = logits.shape
    if logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"gumbel_argmax needs fp32, fp16 or bf16 logits, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape != (rows, -(-vocab // 32))
                                or bitmask.stride(1) != 1):
        raise ValueError(f"the bitmask must be int32 [{rows}, {-(-vocab // 32)}] with contiguous words, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    device = logits.device
    if redo is not None:
        if floor is None or all_greedy:
            raise ValueError("gumbel_argmax: redo draws again the rows a floor filters (a floor, and not all greedy)")
        token, score, logit, lse = redo
        want = [(torch.int64, token), *((torch.float32, t) for t in (score, logit, lse))]
        if any(t.dtype != dtype or t.shape != (rows,) or t.device != device or not t.is_contiguous() for dtype, t in want):
            raise ValueError(f"gumbel_argmax: redo must be an earlier draw of these {rows} rows: (token int64, score, "
                             f"logit, lse float32), each [{rows}] on {device}")
    else:
        token = torch.empty(rows, dtype=torch.int64, device=device)
        score, logit, lse = (torch.empty(rows, dtype=torch.float32, device=device) for _ in range(3))
    if rows == 0:
        return token, score, logit, lse
    chunk = _chunk(vocab)
    parts = -(-vocab // chunk)
    p_score, p_logit, p_max, p_sum = (torch.empty(rows * parts, dtype=torch.float32, device=device) for _ in range(4))
    p_token = torch.empty(rows * parts, dtype=torch.int64, device=device)
    mask = bitmask if bitmask is not None else token  # (unused)
    _LAUNCH["_gumbel_partial_kernel"][(rows, parts)](
        logits, logits.stride(0), temperature, keys, steps, mask, bitmask.stride(0) if bitmask is not None else 0,
        floor if floor is not None else temperature, vocab, start, chunk, p_score, p_token, p_logit, p_max, p_sum,
        parts, GREEDY=all_greedy, HAS_MASK=bitmask is not None, HAS_FLOOR=floor is not None and not all_greedy,
        REDO=redo is not None, PRECISE=not _INTERPRET, BLOCK=BLOCK, num_warps=4)
    _LAUNCH["_gumbel_combine_kernel"][(rows,)](
        p_score, p_token, p_logit, p_max, p_sum, parts, token, score, logit, lse,
        floor if floor is not None else temperature, REDO=redo is not None, PRECISE=not _INTERPRET,
        BLOCK_P=max(2, next_power_of_2(parts)), num_warps=1)
    return token, score, logit, lse


__all__ = ["LOGIT_DTYPES", "allowed_tokens", "available", "gumbel_argmax",
           "gumbel_argmax_reference", "gumbel_argmax_sparse",
           "gumbel_noise", "hash32",
           "uniform_noise", "uniform_noise_reference", "unit_interval"]
