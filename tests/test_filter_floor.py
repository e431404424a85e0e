"""The top-p / top-k floor (treegen/kernels/filter_floor.py): the reference's floor is what sorted filtering
keeps; the search kernel finds the reference's floor (CPU: the Triton interpreter, rows of one chunk and of
several; GPU: compiled, large rows)."""

import os

import pytest
import torch

from treegen.kernels import filter_floor as floor_module
from treegen.kernels.filter_floor import filter_floor, filter_floor_reference
from treegen.kernels.sampling import allowed_tokens

interpreted = pytest.mark.skipif(floor_module.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs triton and TRITON_INTERPRET=1")


def _inputs(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    temperature[0] = 0.0  # a greedy row among sampled ones (its floor is still the scaled row's)
    return logits, temperature


def _peaked(rows: int, vocab: int, seed: int, device="cpu") -> torch.Tensor:
    """Logits of a language model's shape: a few hundred likely tokens, a long tail (the value split's case)."""
    g = torch.Generator(device=device).manual_seed(seed)
    rank = torch.argsort(torch.rand(rows, vocab, generator=g, device=device), dim=-1).float()
    return -1.1 * torch.log1p(rank) + 0.5 * torch.randn(rows, vocab, generator=g, device=device) + 8.0


def _sorted_filter(scaled, top_p, top_k):
    """The top-p / top-k filter as a mask over sorted positions (the sampler's definition before the floor)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    rank = torch.arange(scaled.shape[1]).unsqueeze(0)
    drop = (mass_before >= top_p.unsqueeze(1)) | ((top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1)))
    drop[:, 0] = False
    return torch.zeros_like(drop).scatter(1, order, ~drop)


def test_the_filter_floor_keeps_what_sorted_filtering_keeps_and_every_tie():
    """Rows without ties: the tokens at or above the floor are those the sorted positions' mask keeps (top-p
    alone, top-k alone, both, neither); a tie at the last kept value keeps every tied token."""
    g = torch.Generator().manual_seed(4)
    scaled = torch.randn(8, 500, generator=g) * 2
    top_p = torch.tensor([0.9, 0.5, 1.0, 1.0, 0.95, 0.01, 0.7, 1.0])
    top_k = torch.tensor([0, 0, 10, 0, 40, 0, 3, 1])
    kept = scaled >= filter_floor_reference(scaled, top_p, top_k).unsqueeze(1)
    assert torch.equal(kept, _sorted_filter(scaled, top_p, top_k))
    assert kept[3].all() and kept[7].sum() == 1 and kept[2].sum() == 10
    tied = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])
    assert (tied >= filter_floor_reference(tied, torch.ones(1), torch.tensor([2])).unsqueeze(1)).tolist() == [
        [True, True, True, True, False]]


@interpreted
@pytest.mark.parametrize("vocab", [700, 3000])
def test_the_floor_kernel_finds_the_sorted_floor(vocab):
    """The floor found by the search over the values' keys is the sorted reference's: top-p, top-k, both,
    neither (top-p 1), one token kept, masked rows, 16-bit logits, ties at the floor, a greedy row."""
    rows = 8
    logits, temperature = _inputs(rows, vocab, seed=vocab + 1)
    logits[5, :40] = logits[5, 0]  # a tie of 40 tokens at the top
    top_p = torch.tensor([0.9, 0.5, 1.0, 1.0, 0.95, 0.01, 0.7, 0.999])
    top_k = torch.tensor([0, 0, 10, 0, 40, 0, 3, 1])
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=torch.Generator().manual_seed(6),
                            dtype=torch.int64).to(torch.int32)
    for dtype in (torch.float32, torch.float16):
        low = logits.to(dtype)
        for mask in (None, bitmask):
            scaled = low.float() / temperature.clamp_min(1e-6).unsqueeze(1)
            if mask is not None:
                scaled = scaled.masked_fill(~allowed_tokens(mask, vocab), float("-inf"))
            want = filter_floor_reference(scaled, top_p, top_k)
            got = filter_floor(low, temperature, top_p, top_k, mask)
            assert torch.equal(got, want), (got - want)
            kept = ((scaled >= got.unsqueeze(1)) & (scaled > float("-inf"))).sum(-1)
            assert kept[3] == (scaled[3] > float("-inf")).sum() and kept[7] == 1
    zeros = torch.full((4, vocab), -0.1)
    zeros[:, 0], zeros[:, 1] = -0.0, 0.0  # a float max may give either zero: the floor is still 0, not NaN
    ones = torch.ones(4)
    got = filter_floor(zeros, ones, ones, torch.ones(4, dtype=torch.int64))
    assert torch.equal(got, filter_floor_reference(zeros, ones, torch.ones(4, dtype=torch.int64)))


@interpreted
def test_rows_of_several_chunks_find_the_sorted_floor(monkeypatch):
    """Rows cut in several chunks (partial sums combined across programs; the last chunk short): flat and
    peaked rows, top-p alone (the first split by value), top-k alone (by key), both, a top-p so near 1 that
    almost all the row is kept, masked rows."""
    monkeypatch.setattr(floor_module, "CHUNK", 1024)  # (five chunks, the last short)
    rows, vocab = 8, 5000
    flat, temperature = _inputs(rows, vocab, seed=11)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.999, 0.95, 0.01, 0.7, 0.3])
    top_k = torch.tensor([0, 0, 10, 0, 40, 0, 3, 0])
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=torch.Generator().manual_seed(3),
                            dtype=torch.int64).to(torch.int32)
    for source in (flat, _peaked(rows, vocab, seed=12)):
        for mask in (None, bitmask):
            scaled = source / temperature.clamp_min(1e-6).unsqueeze(1)
            if mask is not None:
                scaled = scaled.masked_fill(~allowed_tokens(mask, vocab), float("-inf"))
            want = filter_floor_reference(scaled, top_p, top_k)
            got = filter_floor(source, temperature, top_p, top_k, mask)
            assert torch.equal(got, want), (got - want)


@interpreted
def test_rows_with_every_token_masked_or_one_allowed():
    """A row whose mask forbids every token has the floor -inf; a row that allows one token keeps it."""
    rows, vocab = 3, 700
    logits, temperature = _inputs(rows, vocab, seed=5)
    bitmask = torch.zeros(rows, -(-vocab // 32), dtype=torch.int32)
    bitmask[1, 3] = 1 << 4  # token 100 alone
    bitmask[2] = -1
    top_p, top_k = torch.full((rows,), 0.9), torch.zeros(rows, dtype=torch.int64)
    got = filter_floor(logits, temperature, top_p, top_k, bitmask)
    assert got[0] == float("-inf")
    assert got[1] == logits[1, 100] / temperature[1]
    scaled = logits[2:] / temperature[2:].unsqueeze(1)
    assert torch.equal(got[2:], filter_floor_reference(scaled, top_p[2:], top_k[2:]))


@interpreted
def test_the_value_split_holds_for_large_scaled_logits():
    """Scaled logits near 2^26 (8 apart there; a tiny temperature makes them): the first split's bound, rounded
    at that size, must still lie below the floor — the floor is the reference's, not a value above it
    (found by review: the bound summed in steps rounded past its margin and the floor came out A-4)."""
    big = 2.0 ** 26
    row = torch.tensor([[big] * 55 + [big - 8] * 100 + [big - 12]])
    one, top_p, top_k = torch.ones(1), torch.tensor([0.9997]), torch.zeros(1, dtype=torch.int64)
    want = filter_floor_reference(row, top_p, top_k)
    assert want.item() == big - 8
    assert torch.equal(filter_floor(row, one, top_p, top_k), want)
    assert torch.equal(filter_floor(row, one, top_p, top_k, winner=torch.tensor([big - 12])), want)
    tiny = torch.full((1,), 1e-6)  # the same order of size reached through the temperature
    logits = row * 1e-6
    scaled = logits / tiny
    assert torch.equal(filter_floor(logits, tiny, top_p, top_k), filter_floor_reference(scaled, top_p, top_k))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_compiled_floor_kernel_finds_the_sorted_floor_on_the_gpu(vocab):
    """Compiled, large rows (flat and peaked, masked and not, bf16): the floor of the sorted reference, but
    where a row's kept mass is within float rounding of its top-p (the sums' orders differ): at most 1% of rows."""
    rows = 512
    logits, temperature = (t.cuda() for t in _inputs(rows, vocab, seed=vocab + 3))
    peaked = _peaked(rows, vocab, seed=vocab, device="cuda")
    top_p = torch.rand(rows, device="cuda") * 0.5 + 0.5
    top_k = torch.where(torch.arange(rows, device="cuda") % 3 == 0, 50, 0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), device="cuda", dtype=torch.int64).to(torch.int32)
    for source in (logits, peaked):
        for mask in (None, bitmask):
            low = source.to(torch.bfloat16)
            scaled = low.float() / temperature.clamp_min(1e-6).unsqueeze(1)
            if mask is not None:
                scaled = scaled.masked_fill(~allowed_tokens(mask, vocab), float("-inf"))
            want = filter_floor_reference(scaled, top_p, top_k)
            got = filter_floor(low, temperature, top_p, top_k, mask)
            assert (got == want).float().mean() >= 0.99


@interpreted
@pytest.mark.parametrize("chunk", [1024, 8192])
def test_a_row_whose_draw_is_kept_needs_no_floor(monkeypatch, chunk):
    """Given each row's unfiltered draw (its token's logit): a row that keeps that token, and a greedy row,
    get the floor -inf (the draw stands); a row whose token is filtered out gets the sorted reference's
    floor (searched from the winner's value up), by mass (top-p) and by count (top-k)."""
    monkeypatch.setattr(floor_module, "CHUNK", chunk)
    rows, vocab = 8, 3000
    logits, temperature = _inputs(rows, vocab, seed=21)
    top_p = torch.tensor([0.9, 0.9, 0.5, 1.0, 1.0, 0.95, 0.7, 0.3])
    top_k = torch.tensor([0, 0, 0, 5, 5, 40, 0, 0])
    order = logits.argsort(-1, descending=True)
    # row 0 greedy; odd rows draw their best token (kept), even rows their 500th (filtered out)
    rank = torch.tensor([2000, 0, 2000, 0, 500, 0, 2500, 1])
    winner = logits.gather(1, order.gather(1, rank.unsqueeze(1))).squeeze(1)
    got = filter_floor(logits, temperature, top_p, top_k, winner=winner)
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    want = filter_floor_reference(scaled, top_p, top_k)
    kept = winner / temperature.clamp_min(1e-6) >= want
    assert kept.tolist() == [False, True, False, True, False, True, False, True]
    assert got[0] == float("-inf")  # greedy: the argmax stands whatever the filter
    for r in range(1, rows):
        assert got[r] == (float("-inf") if kept[r] else want[r]), r
    # fp16 logits under a bitmask, every winner an allowed token (row 2: every token masked, floor -inf)
    low = logits.half()
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=torch.Generator().manual_seed(8),
                            dtype=torch.int64).to(torch.int32)
    bitmask[2] = 0
    allowed = allowed_tokens(bitmask, vocab)
    masked = (low.float() / temperature.clamp_min(1e-6).unsqueeze(1)).masked_fill(~allowed, float("-inf"))
    want = filter_floor_reference(masked, top_p, top_k)
    pick = torch.stack([torch.nonzero(a)[r * 37 % max(1, int(a.sum()))] if a.any() else torch.zeros(1, dtype=torch.int64)
                        for r, a in enumerate(allowed)]).squeeze(1)
    winner = low.float().gather(1, pick.unsqueeze(1)).squeeze(1)
    got = filter_floor(low, temperature, top_p, top_k, bitmask, winner=winner)
    kept = (winner / temperature.clamp_min(1e-6) >= want) | (temperature == 0)
    assert got[2] == float("-inf")
    for r in range(rows):
        if r != 2:
            assert got[r] == (float("-inf") if kept[r] else want[r]), r


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_filtered_draws_on_the_gpu_are_the_sorted_filters_draws_also_in_a_cuda_graph(vocab):
    """``sampler.pick`` with top-p / top-k rows (the unfiltered draw, the floor where its token is filtered out,
    the draw again there), compiled, bf16 language-model-shaped logits, masked and not: the tokens of the
    sampler's PyTorch ops (a sort), but where a row's kept mass is within float rounding of its top-p (at most
    1% of rows); captured in a CUDA graph and replayed, the same tokens as eagerly."""
    from treegen.kernels import sampling
    from treegen.runtime import sampler

    rows = 512
    _, temperature = (t.cuda() for t in _inputs(rows, vocab, seed=vocab + 5))
    logits = _peaked(rows, vocab, seed=vocab + 6, device="cuda").to(torch.bfloat16)
    keys = torch.arange(rows, device="cuda") * 7919
    steps = torch.full((rows,), 3, device="cuda")
    top_p = torch.rand(rows, device="cuda") * 0.5 + 0.5
    top_k = torch.where(torch.arange(rows, device="cuda") % 3 == 0, 50, 0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), device="cuda", dtype=torch.int64).to(torch.int32)
    args = dict(temperature=temperature, top_p=top_p, top_k=top_k, keys=keys, steps=steps, filter_needed=True)
    for mask in (None, bitmask):
        got = sampler.pick(logits, bitmask=mask, **args)
        available = sampling.available
        try:
            sampling.available = lambda x: False  # the PyTorch ops
            want = sampler.pick(logits.float(), bitmask=None if mask is None else mask.clone(), **args)
        finally:
            sampling.available = available
        assert (got[0] == want[0]).float().mean() >= 0.99
        static = [None]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static[0] = sampler.pick(logits, bitmask=mask, **args)[0]
        graph.replay()
        assert torch.equal(static[0], got[0])


def test_a_redo_needs_a_floor_sampled_rows_and_an_earlier_draw_of_the_same_rows():
    from treegen.kernels.sampling import gumbel_argmax

    rows, vocab = 3, 100
    logits, temperature = _inputs(rows, vocab, seed=2)
    keys = steps = torch.zeros(rows, dtype=torch.int64)
    draw = (torch.zeros(rows, dtype=torch.int64), *(torch.zeros(rows) for _ in range(3)))
    floor = torch.zeros(rows)
    with pytest.raises(ValueError, match="redo draws again"):
        gumbel_argmax(logits, temperature, keys, steps, redo=draw)
    with pytest.raises(ValueError, match="redo draws again"):
        gumbel_argmax(logits, temperature, keys, steps, floor=floor, redo=draw, all_greedy=True)
    with pytest.raises(ValueError, match="earlier draw of these 3 rows"):
        gumbel_argmax(logits, temperature, keys, steps, floor=floor, redo=(draw[0][:2], *draw[1:]))
    with pytest.raises(ValueError, match="earlier draw of these 3 rows"):
        gumbel_argmax(logits, temperature, keys, steps, floor=floor, redo=(draw[0].float(), *draw[1:]))
