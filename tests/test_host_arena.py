"""The host arena offloaded KV lives in (treegen.runtime.host_arena): exact spans carved from chunks kept
for the engine's lifetime, best fit, neighbours merged, spans behind an unfinished copy held back."""

import pytest
import torch

from treegen.runtime.engine import Engine
from treegen.runtime.host_arena import ALIGN, HostArena
from treegen.runtime.kv_store import KVStore

KiB = 1024


class Event:
    """A stand-in for a CUDA event: passed once ``done``; counts the waits."""

    def __init__(self) -> None:
        self.done, self.waits = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_spans_are_exact_aligned_and_carved_from_one_chunk_until_it_is_full():
    arena = HostArena(pinned=False, min_chunk=64 * KiB, max_chunk=256 * KiB)
    a, b = arena.take(1000), arena.take(3 * KiB)
    assert (a.chunk, a.offset, a.nbytes) == (0, 0, 2 * ALIGN) and (b.chunk, b.offset) == (0, 2 * ALIGN)
    assert arena.chunk_bytes == 64 * KiB and len(arena.chunks) == 1 and arena.span_bytes == a.nbytes + b.nbytes
    c = arena.take(62 * KiB)  # does not fit what is left of the first chunk: a second, as large as the arena
    assert c.chunk == 1 and arena.chunk_bytes == 128 * KiB
    d = arena.take(300 * KiB)  # larger than a chunk may be: a chunk of its own size
    assert d.chunk == 2 and arena.chunks[2].numel() == 300 * KiB
    assert arena.take(128 * KiB).chunk == 3 and arena.chunks[3].numel() == 256 * KiB  # doubling, capped


def test_given_back_spans_merge_with_free_neighbours_and_best_fit_reuses_them():
    arena = HostArena(pinned=False, min_chunk=64 * KiB)
    spans = [arena.take(8 * KiB) for _ in range(8)]  # the whole chunk
    arena.give(spans[1])
    arena.give(spans[3])
    arena.give(spans[2])  # joins both neighbours: one free span of 24 KiB
    assert arena.free_bytes() == 24 * KiB and len(arena._spans.by_start) == 1
    arena.give(spans[6])
    small = arena.take(8 * KiB)  # best fit: the 8 KiB hole, not the 24 KiB one
    assert (small.chunk, small.offset) == (0, spans[6].offset)
    big = arena.take(20 * KiB)
    assert big.offset == spans[1].offset and arena.free_bytes() == 4 * KiB and len(arena.chunks) == 1
    for s in (spans[0], spans[4], spans[5], spans[7], small, big):
        arena.give(s)
    assert arena.free_bytes() == 64 * KiB and len(arena._spans.by_start) == 1 and arena.span_bytes == 0


def test_a_span_behind_an_unfinished_copy_is_reused_only_once_its_event_passed():
    arena = HostArena(pinned=False, min_chunk=16 * KiB, max_chunk=16 * KiB)
    first = arena.take(16 * KiB)
    copy = Event()
    arena.give(first, after=copy)
    assert arena.free_bytes() == 0 and arena.span_bytes == 0
    # no free span holds it: the arena waits for the pending copy rather than pin more memory
    again = arena.take(16 * KiB)
    assert copy.waits == 1 and again == first and len(arena.chunks) == 1
    passed = Event()
    passed.done = True
    arena.give(again, after=passed)  # already passed: free at once
    assert arena.free_bytes() == 16 * KiB
    other = Event()
    held = arena.take(8 * KiB)
    arena.give(held, after=other)
    assert arena.take(8 * KiB).offset == 8 * KiB and other.waits == 0  # a free span fits: no wait
    other.done = True
    assert arena.take(8 * KiB).offset == 0  # collected once passed


def test_views_are_bounded_by_their_span_and_typed():
    arena = HostArena(pinned=False)
    span = arena.take(1000)
    v = arena.view(span, ALIGN, torch.float32, (2, 3))
    v.fill_(7)
    assert v.shape == (2, 3) and v.dtype == torch.float32
    assert torch.equal(arena.view(span, ALIGN, torch.float32, (6,)), torch.full((6,), 7.0))
    with pytest.raises(ValueError, match="does not fit a span of 1024"):
        arena.view(span, 1000, torch.float32, (10,))
    with pytest.raises(ValueError, match="positive size"):
        arena.take(0)
    with pytest.raises(ValueError, match="min_chunk"):
        HostArena(pinned=False, min_chunk=0)


def _fill(kv, names, sizes, slack=0):
    """Node ``i`` (of ``sizes``: node -> tokens) written with random values in every pool; returns them."""
    want = {}
    for node, n in sizes.items():
        seg = kv.reserve(node, n + slack)
        for name in names:
            pool = getattr(kv, name)
            data = torch.randint(-100, 100, (pool.shape[0], n, *pool.shape[2:])).to(pool.dtype)
            pool[:, seg.start : seg.start + n] = data
            want[node, name] = data
        seg.computed = n
    return want


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_offload_and_restore_reuse_the_arena_and_a_second_store_on_it_pins_nothing_more(kv_dtype):
    from treegen.kernels.kv_quant import kv_format

    arena = HostArena(pinned=False, min_chunk=64 * KiB)
    fmt = kv_format(kv_dtype, torch.float32, "cpu")

    def store():
        return KVStore(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=64,
                       fmt=fmt, arena=arena)

    kv = store()
    names = [n for n in ("k", "v", "k_scale", "v_scale") if getattr(kv, n) is not None]
    want = _fill(kv, names, {0: 30, 1: 7, 2: 17})
    for node in (0, 1, 2):
        kv.offload(node)
    held = arena.chunk_bytes
    assert arena.span_bytes >= 54 * kv.bytes_per_token and kv.counters.arena_bytes == held
    assert kv.offloaded[2].tensors["k"].shape == (3, 17, 2, 4)
    kv.restore({2: 20, 0: 30})
    kv.free(1)  # offloaded, never read again: its span goes back too
    assert arena.span_bytes == 0 and arena.free_bytes() == held
    for node in (0, 2):
        seg = kv.segments[node]
        for name in names:
            assert torch.equal(getattr(kv, name)[:, seg.start : seg.start + seg.computed], want[node, name])
    kv2 = store()  # the next run of the same engine
    seg = kv2.reserve(5, 30)
    seg.computed = 30
    kv2.offload(5)
    assert arena.chunk_bytes == held and kv2.counters.pin_seconds == 0


def test_an_engine_keeps_one_arena_for_all_its_runs():
    from treegen.runtime.loader import IdTokenizer
    from treegen.runtime.model import LlamaFamilyModel
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    engine = Engine(LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu"), IdTokenizer(), cuda_graphs=False)
    first, second = engine.start(), engine.start()
    assert first.kv.arena is engine.host_arena and second.kv.arena is engine.host_arena
    assert not engine.host_arena.pinned  # (CPU: nothing to pin)


def test_memory_reserved_up_front_serves_offloads_without_allocating_more():
    """``reserve`` holds the bytes asked for in chunks of at most ``max_chunk`` now (what
    ``Engine(host_reserve_bytes=)`` pins at start-up); offloads within it allocate nothing."""
    arena = HostArena(pinned=False, min_chunk=16 * KiB, max_chunk=64 * KiB)
    arena.reserve(150 * KiB)
    assert [c.numel() for c in arena.chunks] == [64 * KiB, 64 * KiB, 22 * KiB]  # (the last rounded to ALIGN)
    assert arena.chunk_bytes == arena.free_bytes() == 150 * KiB
    spans = [arena.take(n * KiB) for n in (60, 60, 20, 4, 4)]  # (a span never crosses chunks)
    assert arena.chunk_bytes == 150 * KiB and len(arena.chunks) == 3
    assert arena.reserve(100 * KiB) == 0 and len(arena.chunks) == 3  # held already: nothing more
    for span in spans:
        arena.give(span)
    with pytest.raises(ValueError, match="reserve needs a number of bytes >= 0"):
        arena.reserve(-1)


def test_an_engine_reserves_host_memory_when_made():
    from treegen.runtime.loader import IdTokenizer
    from treegen.runtime.model import LlamaFamilyModel
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu")
    engine = Engine(model, IdTokenizer(), cuda_graphs=False, offload="host", host_reserve_bytes=3 * 2**20)
    assert engine.host_arena.chunk_bytes == 3 * 2**20 and engine.host_reserve_seconds >= 0
    assert Engine(model, IdTokenizer(), cuda_graphs=False).host_arena.chunk_bytes == 0  # (default: nothing)


def test_free_spans_of_two_chunks_never_merge_into_one_that_crosses_them():
    arena = HostArena(pinned=False, min_chunk=16 * KiB, max_chunk=16 * KiB)
    a, b = arena.take(16 * KiB), arena.take(16 * KiB)  # two whole chunks, end to end in the arena's range
    assert (a.chunk, b.chunk) == (0, 1)
    arena.give(a)
    arena.give(b)
    assert arena.free_bytes() == 32 * KiB and len(arena._spans.by_start) == 2
    c = arena.take(24 * KiB)  # no chunk holds it: a new one, not a span across the first two
    assert c.chunk == 2 and c.offset == 0 and len(arena.chunks) == 3
    assert arena.view(c, 0, torch.uint8, (24 * KiB,)).numel() == 24 * KiB


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_offloading_many_nodes_at_once_batches_their_copies_and_keeps_every_value(kv_dtype, monkeypatch):
    """One offload call for many nodes (gathered in batches cut by COMPACT_BYTES: here a few nodes each,
    a node of no written KV among them) keeps every node's KV of every pool, 8-bit scales included; when
    the host has no room for a node, the nodes before it are offloaded all the same and the rest stay."""
    import treegen.runtime.kv_store as kv_store
    from treegen.kernels.kv_quant import kv_format

    fmt = kv_format(kv_dtype, torch.float32, "cpu")
    kv = KVStore(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=256,
                 fmt=fmt, arena=HostArena(pinned=False, min_chunk=64 * KiB))
    monkeypatch.setattr(kv_store, "COMPACT_BYTES", 20 * 3 * 2 * 4 * 4)  # ~20 slots of keys a batch
    names = [n for n in ("k", "v", "k_scale", "v_scale") if getattr(kv, n) is not None]
    sizes = [9, 0, 13, 1, 30, 6, 6, 17]
    want = _fill(kv, names, dict(enumerate(sizes)), slack=2)
    moved = kv.offload(list(range(len(sizes))))
    assert moved == sum(sizes) * kv.bytes_per_token and not kv.segments and kv.slots_free() == kv.num_slots
    assert kv.counters.nodes_offloaded == len(sizes) and kv.host_bytes == moved
    kv.restore({node: n + 1 for node, n in enumerate(sizes)})
    for node, n in enumerate(sizes):
        seg = kv.segments[node]
        for name in names:
            assert torch.equal(getattr(kv, name)[:, seg.start : seg.start + n], want[node, name]), (node, name)

    takes = []
    real_take = kv.arena.take

    def take(nbytes):  # the host runs out at the third node
        takes.append(nbytes)
        if len(takes) == 3:
            raise RuntimeError("no host memory left")
        return real_take(nbytes)

    monkeypatch.setattr(kv.arena, "take", take)
    with pytest.raises(RuntimeError, match="offloading node 2's KV .* needs host memory"):
        kv.offload([0, 1, 2, 3])
    assert sorted(kv.offloaded) == [0, 1] and sorted(kv.segments) == [2, 3, 4, 5, 6, 7]
    assert kv.host_bytes == (sizes[0] + sizes[1]) * kv.bytes_per_token
    monkeypatch.setattr(kv.arena, "take", real_take)
    kv.restore({0: 9, 1: 1})
    for node in (0, 1):
        seg = kv.segments[node]
        for name in names:
            assert torch.equal(getattr(kv, name)[:, seg.start : seg.start + sizes[node]], want[node, name])
