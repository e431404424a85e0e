"""Top-p / top-k filtering as a floor: the smallest scaled logit a row keeps (:func:`filter_floor`), found on
the GPU by a search over the values without sorting them, and its PyTorch reference beside it
(:func:`filter_floor_reference`: a sort). The sampling kernel (:mod:`treegen.kernels.sampling`) then draws
each row among the tokens at or above its floor, in its one pass.

The search. Each float32 value has an order-preserving int32 *key* (:func:`_key`); the floor is the
smallest key ``t`` at which the row *keeps* — the probability mass of the values with keys above ``t``
is below the row's ``top_p`` and fewer than ``top_k`` of them are above it (both only grow as ``t``
falls) — and it is always some value's key. The search holds ``lo < hi``: ``lo`` does not keep, ``hi``
does; each pass over the row tests ``WAYS`` thresholds in ``(lo, hi]`` and keeps the bracket of the first
that keeps; it ends when ``hi = lo + 1`` (the floor is ``hi``'s value). Only values inside the bracket
are counted each pass — the mass and the number of values above ``hi`` are carried from the pass that
chose it — so a tile of the row with no value in the bracket costs a load and a compare.

* **Parallel over the row.** Every pass is one launch of ``rows x parts`` programs, each over a chunk of
  ``CHUNK`` logits (by the vocabulary alone: a row's sums run in one order whatever the batch), writing
  per-threshold partial sums; the next launch's programs each combine their row's partials (in one fixed
  order: the same result in all) and derive the next bracket; one of them records it. A fixed number of
  launches (CUDA graphs capture them): a statistics pass (largest and smallest key, the largest value and
  the softmax's normaliser), a first split, ``KEY_PASSES`` splits of the keys' range (16 ways each, 2^32
  keys: eight always end the search, whatever the first did), then a launch that writes the floors. A
  row whose bracket is closed returns at once, so later launches cost little.
* **The first split is by value** (rows with a ``top_p`` below 1): a value whose probability is below
  ``(1 - top_p) / V`` can never be kept — all of them together hold less than ``1 - top_p`` — so the
  floor lies between ``lse + log((1 - top_p) / V)`` (less a margin of one nat and two ulps for rounding) and the
  largest value, a span of a few nats, which the first pass cuts in ``WAYS`` equal spans of *value*
  (the keys' range across zero is 2^31 keys: eight key passes to cross it, while the mass sits within a
  nat of the floor). Rows with only ``top_k`` split their keys from the first pass.

Measured against the single-program search this replaces (one program a row, eight 16-way passes of
int64 keys, every value every pass): see ``benchmarks/bench_sampling.py --modes top_p`` and the README.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treegen.kernels.launch import Launcher, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


# --------------------------------------------------------------------------- reference

def filter_floor_reference(scaled: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """The smallest scaled logit that top-p / top-k filtering keeps in each row: ``[B]`` fp32. Sorted
    from the most likely down, a token is kept while the probability of those before it is below the row's
    ``top_p`` (``top_p >= 1``: no such limit) and (``top_k > 0``) it is among the first ``top_k``; the most
    likely is always kept. The rows keep every token whose scaled logit is at least this (so tokens tied
    with the last one kept are kept too, whatever order the sort gave them). scaled: ``[B, V]`` fp32
    (``-inf`` where a mask forbids)."""
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    rank = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    keep = (((top_p >= 1).unsqueeze(1) | (mass_before < top_p.unsqueeze(1)))
            & ((top_k.unsqueeze(1) <= 0) | (rank < top_k.unsqueeze(1))))
    kept = keep.sum(-1).clamp_min(1)  # (a prefix of the sorted order: both conditions only grow with the rank)
    return sorted_logits.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)


# --------------------------------------------------------------------------- kernels

WAYS = 16  # thresholds a pass tests
BLOCK = 256  # logits per tile
CHUNK = 8192  # logits per program (a row of 128,256 is 16 programs, of 32,000 four)
KEY_PASSES = 8  # 16-way splits of 2^32 keys: eight close any bracket
MARGIN_NATS = 1.0  # below the bound of the first, value split: room for the rounding of the sums

if triton is not None:

    @triton.jit
    def _key(v):
        """Float32 values → int32 keys in the same order (-0.0 just below +0.0; -inf lowest but NaN)."""
        b = v.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _value(k):
        """The float32 value of an int32 key (:func:`_key`'s inverse)."""
        k = k.to(tl.int32)
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _scaled_tile(L, stride_l, MASK, stride_m, row, j, ok, divisor, HAS_MASK: tl.constexpr):
        """Logits ``j`` of ``row`` (``ok``: inside the row) divided by the temperature, -inf where masked
        or outside."""
        x = tl.load(L + row * stride_l + j, mask=ok, other=-float("inf")).to(tl.float32)
        if HAS_MASK:
            word = tl.load(MASK + row * stride_m + j // 32, mask=ok, other=0)
            x = tl.where(((word >> (j % 32)) & 1) != 0, x, -float("inf"))
        return tl.where(ok, tl.math.div_rn(x, divisor), -float("inf"))

    @triton.jit
    def _stats_kernel(L, stride_l, TEMP, MASK, stride_m, V, WINNER, S_MAX, S_SUM, S_ABOVE, S_KMIN, S_KMAX,
                      S_CABOVE, parts, CHUNK: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WINNER: tl.constexpr,
                      BLOCK: tl.constexpr):
        """A chunk of a row: its largest scaled value, the sum of exp(value - that), its smallest and
        largest key (-0.0 below +0.0, whatever sign a float max gives a zero); ``HAS_WINNER``: also the sum
        and the count of the values above the winner's (its logit ``WINNER[row]``, scaled)."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        divisor = tl.maximum(tl.load(TEMP + row), 1e-6)
        offs = tl.arange(0, BLOCK)
        big = -float("inf")
        run_sum = 0.0
        run_above = 0.0
        count_above = tl.zeros([], dtype=tl.int32)
        win_key = tl.full([], 2147483647, tl.int32)
        if HAS_WINNER:
            win_key = _key(tl.math.div_rn(tl.load(WINNER + row), divisor))
        kmax = tl.full([], -2147483648, tl.int32)
        kmin = tl.full([], 2147483647, tl.int32)
        for off in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, V), BLOCK):
            j = off + offs
            ok = j < V
            x = _scaled_tile(L, stride_l, MASK, stride_m, row, j, ok, divisor, HAS_MASK)
            new_big = tl.maximum(big, tl.max(x, axis=0))
            safe = tl.where(new_big == -float("inf"), 0.0, new_big)
            rescale = tl.exp(big - safe)
            e = tl.exp(x - safe)
            run_sum = run_sum * rescale + tl.sum(e, axis=0)
            big = new_big
            k = _key(x)
            if HAS_WINNER:
                above = k > win_key
                run_above = run_above * rescale + tl.sum(tl.where(above, e, 0.0), axis=0)
                count_above += tl.sum(above.to(tl.int32), axis=0)
            kmax = tl.maximum(kmax, tl.max(tl.where(ok, k, -2147483648), axis=0))
            kmin = tl.minimum(kmin, tl.min(tl.where(ok, k, 2147483647), axis=0))
        at = row * parts + part
        tl.store(S_MAX + at, big)
        tl.store(S_SUM + at, run_sum)
        tl.store(S_KMIN + at, kmin)
        tl.store(S_KMAX + at, kmax)
        if HAS_WINNER:
            tl.store(S_ABOVE + at, run_above)
            tl.store(S_CABOVE + at, count_above)

    @triton.jit
    def _search_kernel(L, stride_l, TEMP, MASK, stride_m, TOP_P, TOP_K, V, rows, parts, WINNER,
                       S_MAX, S_SUM, S_ABOVE, S_KMIN, S_KMAX, S_CABOVE, BIG, Z,
                       LO, HI, C_MASS, C_COUNT, THR, P_MASS, P_COUNT, FLOOR, cur,
                       FIRST: tl.constexpr, FINAL: tl.constexpr, CHUNK: tl.constexpr, HAS_MASK: tl.constexpr,
                       HAS_WINNER: tl.constexpr, WAYS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
                       MARGIN: tl.constexpr):
        """One pass of the search (see the module doc): the bracket from the last pass's partial sums
        (``FIRST``: from the statistics), recorded in buffer ``cur`` of the state by the row's chunk 0;
        then (``FINAL``: the floor written instead) this chunk's sums above each new threshold."""
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        prev = 1 - cur
        top_p = tl.load(TOP_P + row)
        top_k = tl.load(TOP_K + row)
        no_p = (top_p >= 1.0).to(tl.int32)  # (no mass limit)
        no_k = (top_k <= 0).to(tl.int32)  # (no count limit)
        ways = tl.arange(0, WAYS)
        k = tl.arange(0, BLOCK_P)
        ok_p = k < parts
        value_split = False
        if FIRST:
            maxes = tl.load(S_MAX + row * parts + k, mask=ok_p, other=-float("inf"))
            sums = tl.load(S_SUM + row * parts + k, mask=ok_p, other=0.0)
            big = tl.max(maxes, axis=0)
            safe = tl.where(big == -float("inf"), 0.0, big)  # (a row with every token masked: its floor is -inf)
            z = tl.sum(tl.where(maxes == -float("inf"), 0.0, sums * tl.exp(maxes - safe)), axis=0)
            lo = tl.min(tl.load(S_KMIN + row * parts + k, mask=ok_p, other=2147483647), axis=0).to(tl.int64) - 1
            hi = tl.max(tl.load(S_KMAX + row * parts + k, mask=ok_p, other=-2147483648), axis=0).to(tl.int64)
            hi = tl.where(no_p * no_k == 1, lo + 1, hi)  # (no filter: keep everything)
            c_mass = 0.0  # (nothing above the largest key)
            c_count = tl.zeros([], dtype=tl.int32)
            if HAS_WINNER:  # the unfiltered draw stands where its token is kept (and in greedy rows)
                temp = tl.load(TEMP + row)
                above_sums = tl.load(S_ABOVE + row * parts + k, mask=ok_p, other=0.0)
                m_above = tl.sum(tl.where(maxes == -float("inf"), 0.0, above_sums * tl.exp(maxes - safe)), axis=0)
                n_above = tl.sum(tl.load(S_CABOVE + row * parts + k, mask=ok_p, other=0), axis=0)
                kept = tl.maximum((m_above / z < top_p).to(tl.int32), no_p) * \
                    tl.maximum((n_above < top_k).to(tl.int32), no_k) == 1
                win_key = _key(tl.math.div_rn(tl.load(WINNER + row), tl.maximum(temp, 1e-6))).to(tl.int64)
                open_key = _key(tl.full([], -float("inf"), tl.float32)).to(tl.int64)
                # kept: the floor -inf (a closed bracket at it); else the winner's key does not keep
                lo = tl.where(kept | (temp == 0), open_key - 1, tl.minimum(tl.maximum(lo, win_key), hi - 1))
                hi = tl.where(kept | (temp == 0), open_key, hi)
            # below this a value's probability is under (1 - top_p) / V: never kept (see the module doc)
            # (summed below the largest first, then added to it once; less two of its ulps: that one rounding
            # of a large value can exceed the margin — scaled logits of 2^26 are 8 apart)
            below = tl.log(tl.maximum(z, 1e-30)) + tl.log(tl.maximum(1.0 - top_p, 1e-30) / V) - MARGIN
            bound = safe + below
            bound = bound - tl.abs(bound) * 2.384185791015625e-07  # (2^-22)
            value_split = (top_p < 1.0) & (big > bound) & (bound > -float("inf")) & (big < float("inf")) & (hi - lo > 1)
            if value_split:
                lo = tl.minimum(tl.maximum(lo, _key(bound).to(tl.int64) - 1), hi - 1)
            if part == 0:
                tl.store(BIG + row, safe)
                tl.store(Z + row, z)
        else:
            safe = tl.load(BIG + row)
            z = tl.load(Z + row)
            big, bound = safe, safe  # (not read: the value split is the first pass's)
            lo = tl.load(LO + prev * rows + row)
            hi = tl.load(HI + prev * rows + row)
            c_mass = tl.load(C_MASS + prev * rows + row)
            c_count = tl.load(C_COUNT + prev * rows + row)
            if hi - lo > 1:  # the last pass summed: the first of its thresholds that keeps
                thr = tl.load(THR + (prev * rows + row) * WAYS + ways)
                at = (prev * rows + row) * parts * WAYS + k[:, None] * WAYS + ways[None, :]
                mass_at = c_mass + tl.sum(tl.load(P_MASS + at, mask=ok_p[:, None], other=0.0), axis=0)
                count_at = c_count + tl.sum(tl.load(P_COUNT + at, mask=ok_p[:, None], other=0), axis=0)
                mass_ok = tl.maximum((mass_at / z < top_p).to(tl.int32), no_p)
                count_ok = tl.maximum((count_at < top_k).to(tl.int32), no_k)
                keeps = mass_ok * count_ok == 1
                first = tl.min(tl.where(keeps, ways, WAYS), axis=0)  # (hi keeps...
                found = first < WAYS  # ...but where the sums are not numbers: NaN or +inf logits; then the top value)
                chosen = ways == first
                new_hi = tl.where(found, tl.sum(tl.where(chosen, thr, 0), axis=0), hi)
                new_lo = tl.where(found, tl.where(first == 0, lo, tl.sum(tl.where(ways == first - 1, thr, 0), axis=0)),
                                  hi - 1)
                c_mass = tl.where(found, tl.sum(tl.where(chosen, mass_at, 0.0), axis=0), c_mass)
                c_count = tl.where(found, tl.sum(tl.where(chosen, count_at, 0), axis=0), c_count)
                lo, hi = new_lo, new_hi
        if FINAL:
            tl.store(FLOOR + row, _value(hi))
        else:
            if part == 0:
                tl.store(LO + cur * rows + row, lo)
                tl.store(HI + cur * rows + row, hi)
                tl.store(C_MASS + cur * rows + row, c_mass)
                tl.store(C_COUNT + cur * rows + row, c_count)
            if hi - lo > 1:
                if value_split:  # WAYS equal spans of value between the bound and the largest
                    span = (big - bound) / WAYS
                    thr = _key(bound + (ways + 1).to(tl.float32) * span).to(tl.int64)
                    thr = tl.minimum(tl.maximum(thr, lo + 1), hi)
                else:  # WAYS equal spans of keys
                    step = (hi - lo + WAYS - 1) // WAYS
                    thr = tl.minimum(lo + (ways + 1).to(tl.int64) * step, hi)
                thr = tl.where(ways == WAYS - 1, hi, thr)
                if part == 0:
                    tl.store(THR + (cur * rows + row) * WAYS + ways, thr)
                thr32 = thr.to(tl.int32)  # (in (lo, hi]: inside int32, as every key)
                lo32 = (lo + 1).to(tl.int32)  # (the bracket's lowest key: lo >= -2^31 - 1)
                hi32 = hi.to(tl.int32)
                divisor = tl.maximum(tl.load(TEMP + row), 1e-6)
                offs = tl.arange(0, BLOCK)
                mass = tl.zeros([WAYS, BLOCK], dtype=tl.float32)
                count = tl.zeros([WAYS, BLOCK], dtype=tl.int32)
                for off in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, V), BLOCK):
                    j = off + offs
                    x = _scaled_tile(L, stride_l, MASK, stride_m, row, j, j < V, divisor, HAS_MASK)
                    key = _key(x)
                    inside = (key >= lo32) & (key <= hi32)
                    if tl.max(inside.to(tl.int32), axis=0) > 0:  # (a tile with none in the bracket adds nothing)
                        above = (key[None, :] > thr32[:, None]) & inside[None, :]
                        mass += tl.where(above, tl.exp(x - safe)[None, :], 0.0)
                        count += above.to(tl.int32)
                out = ((cur * rows + row) * parts + part) * WAYS + ways
                tl.store(P_MASS + out, tl.sum(mass, axis=1))
                tl.store(P_COUNT + out, tl.sum(count, axis=1))

_LAUNCH = {k.fn.__name__: Launcher(k) for k in (_stats_kernel, _search_kernel)} if triton is not None else {}


def filter_floor(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                 bitmask: Tensor | None = None, winner: Tensor | None = None) -> Tensor:
    """:func:`filter_floor_reference` of the scaled logits ``logits / temperature`` (masked by ``bitmask``)
    without sorting them: the search of the module doc, in ``KEY_PASSES + 3`` launches of ``rows x
    ceil(V / CHUNK)`` programs. The mass is summed by chunk, the reference's in sorted order: where a row's
    kept mass is within float rounding of its ``top_p`` the two may differ by the one token at the boundary.
    ``logits`` ``[B, V]`` fp32, fp16 or bf16; ``temperature``, ``top_p`` ``[B]`` fp32; ``top_k`` ``[B]``
    int64; ``bitmask`` as :func:`~treegen.kernels.sampling.gumbel_argmax`'s. No host sync (CUDA graphs
    capture it).

    ``winner``: ``[B]`` fp32, the logit of the token each row drew without a floor (``gumbel_argmax``'s
    third result). A row that keeps that token (its scaled logit at or above the floor), and a greedy row,
    would draw the same with its floor: its floor is given as -inf, and its search stops after the
    statistics pass (which also sums the values above the winner's); the others search from the winner's
    value up. Nucleus sampling rarely draws outside the nucleus (at most ``1 - top_p`` of the time), so a
    step's search runs on a few rows."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    floor = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return floor
    parts = -(-vocab // CHUNK)
    f32 = dict(dtype=torch.float32, device=device)
    s_max, s_sum, s_above = (torch.empty(rows * parts, **f32) for _ in range(3))
    s_kmin, s_kmax, s_cabove = (torch.empty(rows * parts, dtype=torch.int32, device=device) for _ in range(3))
    big, z = torch.empty(rows, **f32), torch.empty(rows, **f32)
    lo, hi = (torch.empty(2 * rows, dtype=torch.int64, device=device) for _ in range(2))
    c_mass, c_count = torch.empty(2 * rows, **f32), torch.empty(2 * rows, dtype=torch.int32, device=device)
    thr = torch.empty(2 * rows * WAYS, dtype=torch.int64, device=device)
    p_mass = torch.empty(2 * rows * parts * WAYS, **f32)
    p_count = torch.empty(2 * rows * parts * WAYS, dtype=torch.int32, device=device)
    mask = bitmask if bitmask is not None else floor  # (unused)
    stride_m = bitmask.stride(0) if bitmask is not None else 0
    has_mask = bitmask is not None
    has_winner = winner is not None
    winner = winner if has_winner else floor  # (unused)
    _LAUNCH["_stats_kernel"][(rows, parts)](
        logits, logits.stride(0), temperature, mask, stride_m, vocab, winner, s_max, s_sum, s_above, s_kmin, s_kmax,
        s_cabove, parts, CHUNK=CHUNK, HAS_MASK=has_mask, HAS_WINNER=has_winner, BLOCK=BLOCK, num_warps=4)
    searches = 1 + KEY_PASSES
    for n in range(searches + 1):
        final = n == searches
        _LAUNCH["_search_kernel"][(rows, 1 if final else parts)](
            logits, logits.stride(0), temperature, mask, stride_m, top_p, top_k, vocab, rows, parts, winner,
            s_max, s_sum, s_above, s_kmin, s_kmax, s_cabove, big, z, lo, hi, c_mass, c_count, thr, p_mass, p_count,
            floor, n % 2, FIRST=n == 0, FINAL=final, CHUNK=CHUNK, HAS_MASK=has_mask, HAS_WINNER=has_winner,
            WAYS=WAYS, BLOCK=BLOCK,
            BLOCK_P=max(2, next_power_of_2(parts)), MARGIN=MARGIN_NATS, num_warps=4)
    return floor


__all__ = ["filter_floor", "filter_floor_reference"]
