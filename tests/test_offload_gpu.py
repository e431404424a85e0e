"""KV offload / recompute on CUDA (issue 19): pinned host copies, restores on a side stream waited for
per layer, and a workload of branches that continue, 3x the KV budget, giving the tokens of the run
with every KV in memory. fp32 (IEEE kernels) so batch composition cannot flip a greedy choice.

Run on the device machine with TRITON_INTERPRET=0; skipped elsewhere.
"""

import pytest
import torch
from transformers import LlamaConfig

from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.kv_store import KVStore
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_offload_and_restore_round_trip_through_pinned_memory_on_a_side_stream(kv_dtype, grouped, monkeypatch):
    """(``grouped``: the nodes offloaded in one call, gathered together, and restored with the layers in
    groups of two — as when many nodes come back at once — each layer's wait covering its group.)"""
    import treegen.runtime.kv_host as kv_host
    from treegen.kernels.kv_quant import kv_format

    if grouped:
        monkeypatch.setattr(kv_host, "RESTORE_COPIES", 2 * 2 * (4 if kv_dtype else 2))

    fmt = kv_format(kv_dtype, torch.float32, "cuda")
    kv = KVStore(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, device="cuda", initial_slots=64,
                 fmt=fmt)
    pools = [name for name in ("k", "v", "k_scale", "v_scale") if getattr(kv, name) is not None]
    want = {}
    for node, n in ((0, 300), (1, 7), (2, 1000)):
        seg = kv.reserve(node, n + 5)
        for name in pools:
            pool = getattr(kv, name)
            data = torch.randint(-100, 100, (pool.shape[0], n, *pool.shape[2:]), device="cuda").to(pool.dtype)
            pool[:, seg.start : seg.start + n] = data
            want[node, name] = data
        seg.computed = n
    if grouped:
        kv.offload([0, 2])
    else:
        kv.offload(0)
        kv.offload(2)
    assert kv.offloaded[0].tensors["k"].is_pinned() and kv.host_bytes == 1300 * kv.bytes_per_token
    # the freed slots are written at once by new work on the current stream (ordered after the copy out)
    other = kv.reserve(3, 1300)
    for name in pools:
        getattr(kv, name)[:, other.start : other.start + 1300] = 0
    kv.free(3)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the current stream busy: the restores queue behind it, then overlap
        big = big @ big / 64
    kv.restore({0: 310, 2: 1000})
    assert kv._copy_stream is not None and kv._layer_ready is not None and len(kv._layer_ready) == 4
    for layer in range(4):
        kv.wait_layer(layer)
        for node in (0, 2):
            seg = kv.segments[node]
            for name in pools:
                got = getattr(kv, name)[layer, seg.start : seg.start + seg.computed]
                assert torch.equal(got, want[node, name][layer]), (node, name, layer)
    kv.wait_restores()
    assert kv.segments[0].capacity == 310 and kv.segments[0].computed == 300 and not kv.offloaded
    stats = kv.counters.as_dict()
    assert stats["bytes_restored"] == stats["bytes_offloaded"] == 1300 * kv.bytes_per_token
    assert stats["copy_seconds"] > 0


def test_an_offload_right_after_a_restore_does_not_overwrite_the_span_still_being_read():
    """The arena's span of a restored node comes back behind the restore's copies: an offload issued while
    they still queue on the side stream must take other memory (or wait), never that span."""
    from treegen.runtime.host_arena import HostArena

    arena = HostArena(pinned=True, min_chunk=2**20, max_chunk=2**20)  # room for one node at a time
    kv = KVStore(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, device="cuda", initial_slots=64,
                 arena=arena)
    n = 400  # 4 layers x 2 pools x 400 x 2 x 64 x 4 bytes = 1.6 MiB: over a chunk
    want = {}
    for node in (0, 1):
        seg = kv.reserve(node, n)
        for name in ("k", "v"):
            data = torch.randn((4, n, 2, 64), device="cuda")
            getattr(kv, name)[:, seg.start : seg.start + n] = data
            want[node, name] = data
        seg.computed = n
    kv.offload(0)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):  # the restore's copies queue behind this
        big = big @ big / 64
    kv.restore({0: n})
    kv.offload(1)  # into node 0's span only after the copies reading it: the arena waits for them here
    assert arena.chunk_bytes < 2 * 1.7 * 2**20
    kv.wait_restores()
    torch.cuda.synchronize()
    seg = kv.segments[0]
    for name in ("k", "v"):
        assert torch.equal(getattr(kv, name)[:, seg.start : seg.start + n], want[0, name])
        assert torch.equal(kv.offloaded[1].tensors[name].cuda(), want[1, name])


def model_fp32():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=8192)
    return LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cuda")


def follow_up(engine, prompt, branches, first, second, temperature):
    """Each branch generates ``first`` tokens (not final: its KV is read again), one token is appended,
    then ``second`` more (final). Returns every branch's tokens and the run."""
    run = engine.start()
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root) for _ in range(branches)]
    out, errors = {}, []

    def then(i, leaf):
        def on_done(job):
            if job.error is not None:
                errors.append(job.error)
                return
            out[i] = list(job.result.tokens)
            run.tree.extend(leaf, [7])
            params = SamplingParams(max_tokens=second, temperature=temperature, ignore_eos=True)
            run.submit(GenRequest(leaf, params, key=1000 + i, final=True),
                       on_done=lambda j: errors.append(j.error) if j.error else out[i].extend(j.result.tokens))
        return on_done

    params = SamplingParams(max_tokens=first, temperature=temperature, ignore_eos=True)
    for i, leaf in enumerate(leaves):
        run.submit(GenRequest(leaf, params, key=i, final=False), on_done=then(i, leaf))
    while run.busy() and not errors and run.advance():
        pass
    if errors:
        raise errors[0]
    return out, run


@pytest.fixture(scope="module")
def fp32_model():
    return model_fp32()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_workload_3x_the_kv_budget_gives_the_unlimited_runs_tokens(fp32_model, temperature):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 1000, (512,), generator=g).tolist()
    args = dict(prompt=prompt, branches=24, first=96, second=8, temperature=temperature)
    want, run = follow_up(Engine(fp32_model, IdTokenizer()), **args)
    need = run.scheduler.peak_slots * run.kv.bytes_per_token
    assert run.scheduler.memory_waits == 0
    del run
    for mode in ("host", "recompute", "auto"):
        engine = Engine(fp32_model, IdTokenizer(), kv_budget_bytes=need // 3, offload=mode)
        got, run = follow_up(engine, **args)
        assert got == want, mode
        stats = run.offload_stats
        assert run.scheduler.peak_slots * run.kv.bytes_per_token <= need // 3
        if mode == "recompute":
            assert stats["tokens_recomputed"] > 0 and stats["bytes_offloaded"] == 0
        elif mode == "host":
            assert stats["bytes_restored"] > 0 and stats["copy_seconds"] > 0 and run.kv._copy_stream is not None
        else:  # a copy over PCIe is far cheaper than a prefill on this model: auto moves KV to the host
            rates = engine.offload_rates
            assert rates.to_device > 1e9 and rates.prefill_tokens > 0
            assert stats["bytes_offloaded"] > 0
        del run
    with pytest.raises(MemoryError, match="not final"):
        follow_up(Engine(fp32_model, IdTokenizer(), kv_budget_bytes=need // 3, offload="off"), **args)


def test_int8_kv_offloaded_on_cuda_gives_the_same_tokens(fp32_model):
    g = torch.Generator().manual_seed(4)
    args = dict(prompt=torch.randint(1, 1000, (256,), generator=g).tolist(), branches=12, first=64, second=4,
                temperature=0.0)
    want, run = follow_up(Engine(fp32_model, IdTokenizer(), kv_dtype="int8"), **args)
    need = run.scheduler.peak_slots * run.kv.bytes_per_token
    del run
    got, run = follow_up(Engine(fp32_model, IdTokenizer(), kv_dtype="int8", kv_budget_bytes=need // 3,
                                offload="host"), **args)
    assert got == want and run.offload_stats["nodes_restored"] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sliced_gens_paused_and_resumed_under_a_third_of_the_budget_give_the_unlimited_runs_tokens(
        fp32_model, temperature, monkeypatch):
    """Gens reserving a slice at a time (CUDA graphs, pipelined phases, the host arena): branches pause at the
    end of each slice, wait on the host when memory is short, and resume with the tokens of the run that had
    all the memory it wanted — and in fewer forward passes than whole reservations."""
    g = torch.Generator().manual_seed(5)
    args = dict(prompt=torch.randint(1, 1000, (256,), generator=g).tolist(), branches=24, first=96, second=4,
                temperature=temperature)
    want, run = follow_up(Engine(fp32_model, IdTokenizer()), **args)
    need = run.scheduler.peak_slots * run.kv.bytes_per_token
    del run
    passes = {}
    for slice_tokens in (16, None):
        engine = Engine(fp32_model, IdTokenizer(), kv_budget_bytes=need // 3, offload="host", slice_tokens=slice_tokens)
        got, run = follow_up(engine, **args)
        assert got == want, slice_tokens
        assert run.scheduler.peak_slots * run.kv.bytes_per_token <= need // 3
        assert (run.decoder.pauses > 0) == (slice_tokens == 16) and not run.decoder.paused
        passes[slice_tokens] = run.forward_passes
        del run
    assert passes[16] < passes[None]
