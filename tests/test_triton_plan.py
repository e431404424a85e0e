"""The Triton work-table planner (numpy over all segments at once) against the planner it replaced
(``triton_plan_reference.py``: one Python iteration per item and partial), table for table, on random
trees: deep chains, wide forks, prefill rows beside decode rows, empty segments, sliding windows, a
large shared root the library kernel may take, and every planning knob."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from treegen.kernels.row_paths import row_paths
from treegen.kernels.triton_plan import plan_triton
from triton_plan_reference import reference_paths, reference_plan_triton


def random_tree(rng: random.Random, big_root: bool = False):
    """A random forest of segments and query rows: (parent, start, length, pos, query_segment, query_pos)."""
    n = rng.randint(1, 60)
    parent, length = [], []
    for s in range(n):
        roll = rng.random()
        if s == 0 or roll < 0.05:
            parent.append(-1)
        elif roll < 0.45:
            parent.append(s - 1)  # chains: depths up to a dozen and more
        else:
            parent.append(rng.randrange(s))
        length.append(rng.choice([0, 1, 1, 2, 5, 17, 64, 130, 700]))
    if big_root:
        length[0] = rng.choice([1024, 1300, 2047, 2600, 4400, 16384])
    # shuffle the ids so that parents are not always before children
    perm = list(range(n))
    rng.shuffle(perm)
    inv = {old: new for new, old in enumerate(perm)}
    parent = [inv[parent[perm[i]]] if parent[perm[i]] >= 0 else -1 for i in range(n)]
    length = [length[perm[i]] for i in range(n)]
    start, at = [], 0
    for ln in length:
        start.append(at)
        at += ln + rng.randint(0, 3)
    pos = [0] * n

    def position(s):
        p, total = parent[s], 0
        while p >= 0:
            total += length[p]
            p = parent[p]
        return total

    pos = [position(s) for s in range(n)]
    children = {p for p in parent if p >= 0}
    leaves = [s for s in range(n) if s not in children]
    query_segment, query_pos = [], []
    for s in range(n):
        if s in leaves and length[s] > 0:  # decode rows: one per leaf (sometimes a few, for several branches)
            for _ in range(rng.choice([1, 1, 1, 3]) if not big_root else rng.choice([8, 40])):
                query_segment.append(s)
                query_pos.append(pos[s] + length[s] - 1)
        elif length[s] > 0 and rng.random() < 0.15:  # prefill rows of an inner segment
            for i in range(rng.randint(1, min(4, length[s]))):
                query_segment.append(s)
                query_pos.append(pos[s] + i)
    if not query_segment:
        query_segment, query_pos = [0], [pos[0]]
    return parent, start, length, pos, query_segment, query_pos


def assert_same_plan(got, want):
    assert len(got.launches) == len(want.launches)
    for g, w in zip(got.launches, want.launches):
        assert (g.block_m, g.block_n, g.num_warps, g.num_stages, g.direct_rows) == \
            (w.block_m, w.block_n, w.num_warps, w.num_stages, w.direct_rows)
        # a packed launch (fused leaves sharing tiles) holds the same items in order, regrouped, and
        # empty items after them to fill its last program
        items = g.work.reshape(-1, 7)
        n = w.work.shape[0]
        assert torch.equal(items[:n], w.work), (g.work, w.work)
        assert not items[n:].any() and len(items) - n < g.pack
        assert g.pack == 1 or (got.fused_merge and g.block_m == 16 and g.pack * int(w.work[:, 5].max()) * got.group <= 16)
    for name in ("rows", "merge_ptr", "merge_idx"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.num_partials, got.group, got.fused_merge, got.library_by_row, got.leaf_tail, got.use_tma, got.pdl) == \
        (want.num_partials, want.group, want.fused_merge, want.library_by_row, want.leaf_tail, want.use_tma, want.pdl)
    assert (got.library is None) == (want.library is None)
    if got.library is not None:
        g, w = got.library, want.library
        assert (g.start, g.chunk_len, g.chunks, g.num_rows) == (w.start, w.chunk_len, w.chunks, w.num_rows)
        assert (g.rows is None) == (w.rows is None)
        if g.rows is not None:
            assert torch.equal(g.rows, w.rows)


@pytest.mark.parametrize("seed", range(60))
def test_row_paths_and_plans_equal_the_reference_planner(seed):
    rng = random.Random(seed)
    big = seed % 4 == 3
    parent, start, length, pos, qseg, qpos = random_tree(rng, big_root=big)
    window = rng.choice([None, None, 3, 40, 600]) if not big else None
    paths = row_paths(parent, qseg, query_pos=qpos, segment_pos=pos, segment_len=length, window=window)
    rows_of, ref_paths, ref_local = reference_paths(parent, pos, length, qseg, qpos, window)
    assert paths.rows_of() == rows_of
    assert paths.row.tolist() == [q for q, p in enumerate(ref_paths) for _ in p]
    assert paths.seg.tolist() == [s for p in ref_paths for s in p]
    assert paths.local.tolist() == [i for loc in ref_local for i in loc]
    for knobs in ({}, {"fuse_merge": False}, {"mid_tiles": True}, {"mid_tiles": False}, {"longest_first": False},
                  {"target_programs": 7, "block_n": 16}, {"library": True}, {"library": True, "fuse_merge": False},
                  {"library": True, "kv_quantized": True},
                  {"leaf_shape": (16, 2, 1)}):
        for group, kv_heads in ((1, 8), (3, 3), (4, 8), (8, 1)):
            common = dict(segment_start=start, segment_len=length, segment_pos=pos, num_kv_heads=kv_heads,
                          group=group, device="cpu", **knobs)
            got = plan_triton(paths=paths, **common)
            want = reference_plan_triton(rows_of=rows_of, paths=ref_paths, path_local=ref_local, **common)
            assert_same_plan(got, want)


def test_the_library_segment_is_chosen_alike():
    """A 16K root under many rows: the library kernel takes it (both planners agree on its chunks)."""
    parent = [-1] + [0] * 64
    length = [16384] + [3] * 64
    start = [0] + [16384 + 3 * i for i in range(64)]
    pos = [0] + [16384] * 64
    qseg = list(range(1, 65))
    qpos = [16386] * 64
    paths = row_paths(parent, qseg)
    rows_of, ref_paths, ref_local = reference_paths(parent, pos, length, qseg, qpos)
    common = dict(segment_start=start, segment_len=length, segment_pos=pos, num_kv_heads=8, group=8, device="cpu",
                  library=True)
    got = plan_triton(paths=paths, **common)
    assert got.library is not None and got.fused_merge
    assert_same_plan(got, reference_plan_triton(rows_of=rows_of, paths=ref_paths, path_local=ref_local, **common))


@pytest.mark.parametrize("parent,qseg,message", [
    ([-1, 5], [1], "segment 1 has parent 5, outside \\[-1, 2\\)"),
    ([-1, -2], [1], "segment 1 has parent -2"),
    ([2, 0, 1, -1], [3], "cycle through segment [012]"),
    ([1, 1], [0], "cycle through segment 1"),
    ([-1, 0], [1, 2], "query row 1 names segment 2, outside \\[0, 2\\)"),
    ([-1, 0], [-1], "query row 0 names segment -1"),
])
def test_bad_trees_are_named(parent, qseg, message):
    with pytest.raises(ValueError, match=message):
        row_paths(parent, qseg)


def test_a_window_keeps_the_own_segment_and_drops_old_ancestors():
    # root [0, 10), child [10, 12), grandchild [12, 13): a row at 12 with window 2 sees keys 11, 12 only
    paths = row_paths([-1, 0, 1], [2], query_pos=[12], segment_pos=[0, 10, 12], segment_len=[10, 2, 1], window=2)
    assert paths.seg.tolist() == [1, 2] and paths.local.tolist() == [0, 0]
    assert np.array_equal(paths.count, [0, 1, 1])


@pytest.mark.parametrize("root_last", [False, True])
def test_launch_order_with_fused_leaves_and_two_wide_heights(root_last):
    """Fused leaves after both wide launches, which keep the order their segments first use them in: a
    root of 64 rows (128-row tiles) and eight middle nodes of 8 rows each (64-row tiles, forced), the root's
    id before or after theirs."""
    mids = list(range(1, 9)) if not root_last else list(range(0, 8))
    root = 0 if not root_last else 8
    parent = [0] * 73
    parent[root] = -1
    for m in mids:
        parent[m] = root
    leaves = list(range(9, 73))
    for i, leaf in enumerate(leaves):
        parent[leaf] = mids[i // 8]
    length = [300 if s == root else 40 if s in mids else 3 for s in range(73)]
    start = list(np.cumsum([0] + length[:-1]))
    pos = [0 if s == root else 300 if s in mids else 340 for s in range(73)]
    qpos = [342] * len(leaves)
    paths = row_paths(parent, leaves)
    rows_of, ref_paths, ref_local = reference_paths(parent, pos, length, leaves, qpos)
    common = dict(segment_start=start, segment_len=length, segment_pos=pos, num_kv_heads=8, group=4, device="cpu",
                  mid_tiles=True)
    got = plan_triton(paths=paths, **common)
    assert got.fused_merge and [w.block_m for w in got.launches] == ([64, 128, 16] if root_last else [128, 64, 16])
    assert_same_plan(got, reference_plan_triton(rows_of=rows_of, paths=ref_paths, path_local=ref_local, **common))


def test_shared_chunks_fit_one_wave_when_that_is_no_slower():
    """Phi-4-mini's decode tree (24/8 heads: 42 branches a 128-row tile) over 256 leaves below a 2K prompt: the
    balanced chunks (960, 960 and 128 keys x 56 tile programs = 168 programs) become 2 of 1,024 (112, one wave);
    with ``one_wave=False`` the 168 stay. A long segment beside many short ones keeps its chunks: one wave would
    put the whole long segment in one program."""
    from treegen.kernels import triton_plan as tp

    def decode_plan(leaves, **knobs):
        parent, length = [-1] + [0] * leaves, [2048] + [32] * leaves
        start = [0] + [2048 + 32 * i for i in range(leaves)]
        qseg, qpos = list(range(1, leaves + 1)), [2048 + 31] * leaves
        paths = row_paths(parent, qseg, query_pos=qpos, segment_pos=[0] + [2048] * leaves, segment_len=length)
        plan = plan_triton(segment_start=start, segment_len=length, segment_pos=[0] + [2048] * leaves, paths=paths,
                           num_kv_heads=8, group=3, device="cpu", **knobs)
        wide = plan.launches[0].work
        return wide.shape[0] * 8, sorted({int(k) for k in (wide[:, 3] - wide[:, 2])})

    assert decode_plan(256) == (112, [1024])
    assert decode_plan(256, one_wave=False) == (168, [128, 960])
    assert decode_plan(1024) == (200, [2048])  # 25 tiles x 8 heads: over a wave already with one chunk each
    keys, programs = np.array([8192, 512]), np.array([8, 120])
    assert tp._one_wave_chunk(1024, keys, programs, 64) == 1024
    assert tp._makespan(keys, programs, 1024) < tp._makespan(keys, programs, 8192)


@pytest.mark.parametrize("seed", range(40))
def test_one_wave_chunk_is_the_shortest_that_fits(seed):
    """Against a search of every chunk: the rule lengthens the chunks to the shortest multiple of the key block
    whose programs fit one wave, exactly when there is one, the plan's own chunks do not fit, and its estimated
    time is within the slack of theirs."""
    from treegen.kernels import triton_plan as tp
    rng = np.random.default_rng(seed)
    keys = rng.integers(1, 9000, size=rng.integers(1, 6))
    programs = rng.integers(1, 60, size=len(keys))
    chunk = int(rng.integers(8, 40)) * 64

    def count(c):
        return int((-(-keys // c) * programs).sum())

    fitting = [c for c in range(chunk, int(keys.max()) + 64, 64) if count(c) <= tp._SMS]
    shortest = fitting[0] if fitting else None
    wanted = chunk if count(chunk) <= tp._SMS or shortest is None or tp._makespan(keys, programs, shortest) > \
        tp._ONE_WAVE_SLACK * tp._makespan(keys, programs, chunk) else shortest
    assert tp._one_wave_chunk(chunk, keys, programs, 64) == wanted


def test_the_library_takes_chunks_of_2k_that_make_half_a_wave():
    """The measured rule (triton_plan's _LIBRARY_MIN_CHUNK, _LIBRARY_MIN_PROGRAMS): cuDNN takes a shared prompt
    in chunks of ~2,048 keys whose tiles make at least half a wave; shorter chunks or fewer tiles stay with the
    Triton kernels. (chunks, keys each) or None, for leaves x prompt keys x heads."""

    def library(leaves, prefix, heads, kv_heads, **knobs):
        parent, length = [-1] + [0] * leaves, [prefix] + [32] * leaves
        start, pos = [0] + [prefix + 32 * i for i in range(leaves)], [0] + [prefix] * leaves
        qseg = list(range(1, leaves + 1))
        plan = plan_triton(segment_start=start, segment_len=length, segment_pos=pos, num_kv_heads=kv_heads,
                           group=heads // kv_heads, device="cpu", library=True, paths=row_paths(parent, qseg), **knobs)
        return (plan.library.chunks, plan.library.chunk_len) if plan.library is not None else None

    assert library(512, 2048, 32, 8) == (1, 2048)  # 128 tiles
    assert library(256, 2048, 32, 8) is None  # 64 tiles: two chunks of 1,024 measured even, one is half a wave
    assert library(256, 2048, 16, 4) is None  # 32 tiles: four chunks of 512 measured slower
    assert library(1024, 2048, 16, 4) == (1, 2048)
    assert library(256, 16384, 8, 1) == (8, 2048)  # 16 tiles
    assert library(1024, 4096, 8, 1) == (2, 2048)
    assert library(64, 16384, 8, 1) is None  # 4 tiles: 8 chunks make 32 programs
    # an 8-bit cache keeps the rule measured for it: chunks of ~512 keys, however few programs
    assert library(256, 2048, 16, 4, kv_quantized=True) == (4, 512)
    assert library(256, 2048, 32, 8, kv_quantized=True) == (2, 1024)
