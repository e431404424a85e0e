"""Decode phases kept at padded sizes (treegen.runtime.phase_graphs): the sizes, padded attention plans
(the Triton kernels in the interpreter) that give each loaded plan's own outputs, and whole runs whose
phases run in kept buffers giving the tokens of runs without them. CUDA graphs of kept phases:
tests/test_runtime_gpu.py."""

import random

import pytest
import torch

from test_tree_attention import ground_truth, layout, make_queries, random_tree
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.phase_graphs import PhaseGraphs, _fits, _room, bucket, width_bucket
from treegen.runtime.sampler import SamplingParams


def test_sizes_round_up_by_at_most_a_quarter():
    assert [bucket(n) for n in (1, 8, 9, 64, 65, 80, 81, 96, 100, 128, 129, 1000, 1024, 1025)] == \
        [8, 8, 16, 64, 80, 80, 96, 96, 112, 128, 160, 1024, 1024, 1280]
    for n in range(1, 5000):
        assert n <= bucket(n) <= max(n + 7, n * 5 // 4)
    assert [width_bucket(n) for n in (1, 8, 9, 200, 256, 257)] == [8, 8, 16, 256, 256, 512]


def test_tables_fit_kept_capacities_with_bounded_padding():
    """A plan's tables fit capacities made with room for growth; work items (launched programs) only
    while their padding stays under about as many again."""
    sizes = (((40, 300), 500, 900, 2000),)  # one window: items of two launches, rows, merge_idx, partials
    room = _room(sizes)
    assert room == (((64, 512), 768, 1536, 3072),)
    assert _fits(room, sizes) and _fits(room, (((60, 440), 700, 1500, 3000),))
    assert not _fits(room, (((65, 300), 500, 900, 2000),))  # more items than room for
    assert not _fits(room, (((40, 300), 500, 900, 3073),))
    assert not _fits(room, (((40, 150), 500, 900, 2000),))  # 512 items for 150: too much padding
    assert not _fits(room, (((40,), 500, 900, 2000),))  # another launch list
    assert not _fits(room, sizes + sizes)  # another number of windows


def _plan(parent, length, start, pos, query_segment, query_pos, heads, kv_heads, **extra):
    return plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=query_segment, query_pos=query_pos, backend="triton",
                               num_heads=heads, num_kv_heads=kv_heads, **extra)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (6, 3)])
def test_a_padded_plan_gives_each_loaded_plans_outputs(seed, heads, kv_heads):
    """One padded plan, loaded with a tree's plan and then with the same tree a step later (every leaf
    one key longer: the next decode phase), gives each plan's own attention for the real rows."""
    rng = random.Random(seed)
    parent, length = random_tree(rng, max_depth=4, max_fanout=3, max_len=40)
    start, pos, slots = layout(parent, [n + 1 for n in length], rng)  # (room for a leaf's next key)
    head_dim, scale = 64, 0.125
    k_cache = torch.randn(slots, kv_heads, head_dim)
    v_cache = torch.randn(slots, kv_heads, head_dim)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=0)
    plan = _plan(parent, length, start, pos, query_segment, query_pos, heads, kv_heads)
    key = plan.shape_key()
    assert key is not None
    rows = bucket(len(query_pos) + 5)
    room = _room(plan.sizes())
    padded = plan.padded(rows, room, torch.zeros(rows, dtype=torch.int64))
    leaves = set(query_segment)
    later_len = [n + (s in leaves) for s, n in enumerate(length)]
    later_pos = [p + 1 for p in query_pos]
    later = _plan(parent, later_len, start, pos, query_segment, later_pos, heads, kv_heads)
    assert later.shape_key() == key and _fits((room,), (later.sizes(),))
    for each, lengths, positions in ((plan, length, query_pos), (later, later_len, later_pos)):
        padded.load(each)
        padded.query_pos[:len(positions)].copy_(each.query_pos)
        q = torch.randn(rows, heads, head_dim)
        got = tree_attention(q, k_cache, v_cache, padded, scale)[:len(positions)]
        want = tree_attention(q[:len(positions)], k_cache, v_cache, each, scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        truth = ground_truth(q[:len(positions)].double(), k_cache.double(), v_cache.double(), parent, start, lengths,
                             pos, query_segment, positions, scale)
        torch.testing.assert_close(got.double(), truth, atol=1e-4, rtol=1e-4)


def test_a_plan_with_a_library_segment_has_no_shape_key():
    from treegen.kernels.library_attention import LibrarySegment
    from treegen.kernels.triton_plan import TritonPlan

    plan = _plan([-1, 0], [8, 2], [0, 8], [0, 8], [1], [9], 4, 1)
    assert plan.shape_key() is not None
    with_library = TritonPlan(**{**{f: getattr(plan.triton, f) for f in ("launches", "rows", "merge_ptr", "merge_idx",
                                                                         "num_partials", "group", "use_tma",
                                                                         "warp_specialize")},
                                 "library": LibrarySegment(start=0, chunk_len=4, chunks=2, num_rows=1, rows=None)})
    assert with_library.shape_key() is None


def _ids(n, seed):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _two_rounds(model, tokenizer, keep: bool):
    """Six branches of uneven lengths below one prompt, then a second round forked from each: several
    phases of equal padded shape. Returns (every result, the run)."""
    engine = Engine(model, tokenizer)
    engine.attention_backend = "triton"
    run = engine.start()
    run.decoder.kept = PhaseGraphs() if keep else None
    tree = run.tree
    root = tree.add_node(None, _ids(20, 1))
    leaves = [tree.add_node(root, _ids(3 + i, 10 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, temperature=1.0 if i % 2 else 0.0)
              for i in range(6)]
    first, _ = run.execute([GenRequest(n, p, key=i) for i, (n, p) in enumerate(zip(leaves, params))], [])
    forks = [tree.add_node(n, _ids(2, 20 + i)) for i, n in enumerate(leaves)]
    second, _ = run.execute([GenRequest(n, p, key=10 + i) for i, (n, p) in enumerate(zip(forks, params))], [])
    return first + second, run


def test_phases_in_kept_buffers_give_the_same_tokens(model64, tokenizer, monkeypatch):
    """Phases run in kept, padded buffers (eagerly on the CPU: the same buffers a CUDA graph would
    replay) give the tokens and log-probabilities of phases in tensors of their own, and later phases
    of the same padded shape reuse earlier ones' buffers. (Mixed steps' kept buffers, which share the
    store, are off here: tests/test_mixed_graphs.py.)"""
    monkeypatch.setenv("TREEGEN_KEEP_MIXED_GRAPHS", "0")
    kept, run = _two_rounds(model64, tokenizer, keep=True)
    plain, _ = _two_rounds(model64, tokenizer, keep=False)
    assert [r.tokens for r in kept] == [r.tokens for r in plain]
    for a, b in zip(kept, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    graphs = run.decoder.kept
    assert graphs.misses >= 1 and graphs.hits >= 1, (graphs.hits, graphs.misses)
    assert any(b.rows > 6 for _, b in graphs.kept.values())  # padded
