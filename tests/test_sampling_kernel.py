"""The one-pass sampling kernel (treegen/kernels/sampling.py) against its PyTorch reference and the
sampler's own ops: the same tokens, the same scores and logits, the log-sum-exp within float rounding
(CPU: the Triton interpreter; GPU: compiled, in tests/test_runtime_gpu.py's run of the sampler)."""

import os

import pytest
import torch

from treegen.kernels import filter_floor, sampling
from treegen.kernels.sampling import gumbel_argmax, gumbel_argmax_reference
from treegen.runtime.sampler import sample

# the CPU cases run the kernel in Triton's interpreter (compiled kernels need CUDA tensors)
interpreted = pytest.mark.skipif(sampling.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs triton and TRITON_INTERPRET=1")


def _inputs(rows: int, vocab: int, seed: int, greedy_rows: bool = True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    if greedy_rows:
        temperature[0] = 0.0  # a greedy row among sampled ones
    keys = torch.randint(0, 2 ** 32, (rows,), generator=g)
    steps = torch.randint(0, 5000, (rows,), generator=g)
    return logits, temperature, keys, steps


@interpreted
@pytest.mark.parametrize("rows,vocab,start", [(6, 3000, 0), (3, 20000, 0), (5, 999, 4096), (1, 8193, 32)])
def test_kernel_draws_the_reference_tokens(rows, vocab, start):
    logits, temperature, keys, steps = _inputs(rows, vocab, seed=vocab)
    got = gumbel_argmax(logits, temperature, keys, steps, start=start)
    want = gumbel_argmax_reference(logits, temperature, keys, steps, start=start)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # (the interpreter's log is numpy's)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-5)
    if start == 0:  # the sampler's own ops (the CPU path) draw the same
        top = torch.ones(rows)
        assert sample(logits, temperature=temperature, top_p=top, top_k=torch.zeros(rows, dtype=torch.int64),
                      keys=keys, steps=steps, filter_needed=False).tolist() == got[0].tolist()


@interpreted
def test_kernel_honours_the_bitmask_and_greedy_rows():
    rows, vocab = 4, 20000
    logits, temperature, keys, steps = _inputs(rows, vocab, seed=1)
    g = torch.Generator().manual_seed(2)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0
    bitmask[1, 400] = 1 << 7  # row 1 allows one token: 400 * 32 + 7
    for all_greedy in (False, True):
        temps = torch.zeros(rows) if all_greedy else temperature
        got = gumbel_argmax(logits, temps, keys, steps, bitmask, all_greedy=all_greedy)
        want = gumbel_argmax_reference(logits, temps, keys, steps, bitmask, all_greedy=all_greedy)
        assert got[0].tolist() == want[0].tolist() and got[0][1] == 400 * 32 + 7
        allowed = sampling.allowed_tokens(bitmask, vocab)
        assert allowed[torch.arange(rows), got[0]].all()
        torch.testing.assert_close(got[3], logits.logsumexp(-1), rtol=1e-6, atol=1e-5)  # before the mask
    # a tensor-parallel rank's slice: its own words of the mask, the noise of its token ids
    got = gumbel_argmax(logits, temperature, keys, steps, bitmask, start=64000)
    want = gumbel_argmax_reference(logits, temperature, keys, steps, bitmask, start=64000)
    assert got[0].tolist() == want[0].tolist() and got[0][1] == 400 * 32 + 7
    assert gumbel_argmax(logits, torch.zeros(rows), keys, steps)[0].tolist() == logits.argmax(-1).tolist()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_logits_draw_what_their_fp32_copy_draws(dtype):
    """The decode step hands the kernel the model's own 16-bit logits (no fp32 copy of [rows, vocab]):
    tokens, scores, logits and log-sum-exps equal those of the same values in fp32, masked or not."""
    rows, vocab = 5, 9000
    logits, temperature, keys, steps = _inputs(rows, vocab, seed=11)
    low = logits.to(dtype)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=torch.Generator().manual_seed(4),
                            dtype=torch.int64).to(torch.int32)
    for mask in (None, bitmask):
        got = gumbel_argmax(low, temperature, keys, steps, mask)
        want = gumbel_argmax(low.float(), temperature, keys, steps, mask)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@interpreted
def test_ties_go_to_the_lowest_token_and_bad_input_is_named():
    logits = torch.zeros(2, 9000)
    logits[:, 10] = logits[:, 8500] = 5.0  # equal best logits in different chunks
    token = gumbel_argmax(logits, torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))[0]
    assert token.tolist() == [10, 10]
    with pytest.raises(ValueError, match="fp32, fp16 or bf16 logits"):
        gumbel_argmax(logits.double(), torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="bitmask must be int32"):
        gumbel_argmax(logits, torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                      torch.zeros(2, 3, dtype=torch.int32))


@interpreted
def test_filtered_rows_draw_in_one_pass_past_the_floor():
    """Top-p / top-k rows through the kernel (their floor from filter_floor): the tokens of the sampler's
    PyTorch ops, masked and not, greedy rows among them; log-probabilities of the unfiltered distribution."""
    from treegen.runtime import sampler

    rows, vocab = 6, 3000
    logits, temperature, keys, steps = _inputs(rows, vocab, seed=9)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.8, 0.95, 0.3])
    top_k = torch.tensor([0, 20, 5, 0, 100, 0])
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=torch.Generator().manual_seed(5),
                            dtype=torch.int64).to(torch.int32)
    args = dict(temperature=temperature, top_p=top_p, top_k=top_k, keys=keys, steps=steps, filter_needed=True)
    for mask in (None, bitmask):
        want = sampler.pick(logits.clone(), bitmask=None if mask is None else mask.clone(), **args)
        sampling_available = sampling.available
        try:
            sampling.available = lambda x: True  # the kernel's path, in the interpreter
            got = sampler.pick(logits.clone(), bitmask=None if mask is None else mask.clone(), **args)
        finally:
            sampling.available = sampling_available
        assert got[0].tolist() == want[0].tolist()
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    floor = filter_floor.filter_floor_reference(logits / temperature.clamp_min(1e-6).unsqueeze(1), top_p, top_k)
    got = gumbel_argmax(logits, temperature, keys, steps, floor=floor)
    want = gumbel_argmax_reference(logits, temperature, keys, steps, floor=floor)
    assert got[0].tolist() == want[0].tolist() and torch.equal(got[2], want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_compiled_kernel_draws_the_sampler_ops_tokens_on_the_gpu(vocab):
    """Compiled (libdevice's logf, rounded division): the tokens of the sampler's PyTorch ops on the GPU,
    for every row of a large batch, masked and not, with a top-p / top-k floor and without; inside a CUDA
    graph too."""
    rows = 512
    logits, temperature, keys, steps = (t.cuda() for t in _inputs(rows, vocab, seed=vocab))
    g = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=g, dtype=torch.int64).to(torch.int32)
    from treegen.kernels.filter_floor import filter_floor_reference as filter_floor

    def floor_of(mask):  # top-p 0.9 and top-k 50 of the distribution the rows draw from (masked)
        scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
        if mask is not None:
            scaled = scaled.masked_fill(~sampling.allowed_tokens(mask, vocab), float("-inf"))
        return filter_floor(scaled, torch.full((rows,), 0.9, device="cuda"), torch.full((rows,), 50, device="cuda"))

    for mask, filtered in ((None, False), (bitmask.cuda(), False), (None, True), (bitmask.cuda(), True)):
        low = floor_of(mask) if filtered else None
        want = gumbel_argmax_reference(logits, temperature, keys, steps, mask, floor=low)
        got = gumbel_argmax(logits, temperature, keys, steps, mask, floor=low)
        assert got[0].tolist() == want[0].tolist()
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-5)
    static = [torch.empty(rows, dtype=torch.int64, device="cuda")]
    gumbel_argmax(logits, temperature, keys, steps)  # (compiled before capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static[0].copy_(gumbel_argmax(logits, temperature, keys, steps)[0])
    steps += 1
    graph.replay()
    assert static[0].tolist() == gumbel_argmax_reference(logits, temperature, keys, steps)[0].tolist()


def test_the_cpu_noise_has_the_reference_bits():
    """The CPU's numpy noise (wrapping 32-bit arithmetic) equals the int64 PyTorch definition bit for bit."""
    g = torch.Generator().manual_seed(5)
    keys = torch.cat([torch.randint(0, 2 ** 32, (6,), generator=g), torch.tensor([0, 2 ** 32 - 1])])
    steps = torch.cat([torch.randint(0, 10 ** 6, (6,), generator=g), torch.tensor([0, 123456])])
    for vocab, start in ((4099, 0), (1000, 64000)):
        assert torch.equal(sampling.uniform_noise(keys, steps, vocab, start),
                           sampling.uniform_noise_reference(keys, steps, vocab, start))


@pytest.mark.parametrize("spread", [1.0, 8.0, 40.0])
def test_the_cpu_draw_with_noise_only_where_a_token_can_win_is_the_whole_draw(spread):
    """gumbel_argmax_sparse (the CPU sampler) equals the argmax over every token's noise: peaked rows
    (few tokens within the noise's range of the best), flat ones, filtered (-inf) tokens, huge scaled logits."""
    g = torch.Generator().manual_seed(int(spread))
    rows, vocab = 24, 5000
    scaled = torch.randn(rows, vocab, generator=g) * spread
    scaled[0, 100:] = float("-inf")  # a filtered row
    scaled[1] *= 1e6  # a greedy row's logits over the clamped temperature
    scaled[2, 7] = scaled[2, 4000] = scaled[2].max() + 100.0  # two far above the rest: their noise decides
    keys = torch.randint(0, 2 ** 32, (rows,), generator=g)
    steps = torch.randint(0, 1000, (rows,), generator=g)
    want = (scaled + sampling.gumbel_noise(keys, steps, vocab)).argmax(-1)
    assert sampling.gumbel_argmax_sparse(scaled, keys, steps).tolist() == want.tolist()
    assert want[2] in (7, 4000)


def test_the_cpu_draw_of_rows_without_a_finite_best_is_the_whole_draw():
    """A row whose best scaled logit is NaN or inf (no bound to prune by) draws as the definition does,
    never an id past the vocabulary."""
    g = torch.Generator().manual_seed(9)
    scaled = torch.randn(4, 1000, generator=g) * 50
    scaled[0, 5], scaled[1, 7] = float("nan"), float("inf")
    keys, steps = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    want = (scaled + sampling.gumbel_noise(keys, steps, 1000)).argmax(-1)
    got = sampling.gumbel_argmax_sparse(scaled, keys, steps)
    assert got.tolist() == want.tolist() and got[0] == 5 and got[1] == 7


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pick_takes_the_models_16bit_logits(dtype):
    """The decode step hands ``pick`` the model's own logits (fp32_logits=False): every path — the PyTorch
    ops of top-p / top-k filtering, a constraint's bitmask, plain sampling — draws the tokens and
    log-probabilities of the same values in fp32 (those paths copy them to fp32 first; the kernel reads them)."""
    from treegen.runtime.sampler import pick

    rows, vocab = 6, 3000
    logits, temperature, keys, steps = _inputs(rows, vocab, seed=21)
    low = logits.to(dtype)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab // 32)), generator=torch.Generator().manual_seed(5),
                            dtype=torch.int64).to(torch.int32)
    top_p, top_k = torch.full((rows,), 0.9), torch.full((rows,), 50, dtype=torch.int64)
    for filtered in (False, True):
        for mask in (None, bitmask):
            args = dict(temperature=temperature, top_p=top_p if filtered else torch.ones(rows),
                        top_k=top_k if filtered else torch.zeros(rows, dtype=torch.int64), keys=keys, steps=steps,
                        filter_needed=filtered)
            got = pick(low, bitmask=None if mask is None else mask.clone(), **args)
            want = pick(low.float(), bitmask=None if mask is None else mask.clone(), **args)
            assert torch.equal(got[0], want[0]) and got[1].dtype == torch.float32
            torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    assert low.dtype == dtype  # (the caller's logits are not changed in place)
