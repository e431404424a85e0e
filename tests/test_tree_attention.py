"""Tree attention vs plain softmax attention over each query's concatenated root-to-leaf KV."""

import random

import pytest
import torch

from treegen.kernels.tree_attention import (merge_attention_states, plan_tree_attention, tree_attention,
                                            tree_attention_reference, tree_lse_reference)


def random_tree(rng: random.Random, *, max_depth: int, max_fanout: int, max_len: int, min_len: int = 1):
    """Random unbalanced forest → (parent, length) lists; every leaf gets decode/prefill queries."""
    parent, length = [-1], [rng.randint(min_len, max_len)]
    frontier = [(0, 1)]
    while frontier:
        node, depth = frontier.pop()
        if depth >= max_depth:
            continue
        for _ in range(rng.randint(0 if node else 1, max_fanout)):
            parent.append(node)
            length.append(rng.randint(min_len, max_len))
            frontier.append((len(parent) - 1, depth + 1))
    return parent, length


def layout(parent, length, rng):
    """Place segments at shuffled, gapped slots; positions follow the root-to-node path."""
    order = list(range(len(parent)))
    rng.shuffle(order)
    start, cursor = [0] * len(parent), 0
    for s in order:
        start[s] = cursor
        cursor += length[s] + rng.randint(0, 3)
    pos = [0] * len(parent)
    for s in range(len(parent)):  # parents precede children by construction
        pos[s] = 0 if parent[s] == -1 else pos[parent[s]] + length[parent[s]]
    return start, pos, cursor


def ground_truth(q, k_cache, v_cache, parent, start, length, pos, query_segment, query_pos, scale, window=None,
                 softcap=None):
    """Plain softmax attention of each query row over its whole root-to-own-segment KV (fp64), causal,
    within a sliding ``window`` (HF: ``key_pos > query_pos - window``) and soft-capped if asked."""
    out = []
    for row, seg in enumerate(query_segment):
        path = []
        while seg != -1:
            path.append(seg)
            seg = parent[seg]
        path.reverse()
        slots = torch.cat([torch.arange(start[s], start[s] + length[s]) for s in path])
        kpos = torch.cat([torch.arange(pos[s], pos[s] + length[s]) for s in path])
        k, v = k_cache[slots].double(), v_cache[slots].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        hidden = kpos.unsqueeze(0) > query_pos[row]
        if window is not None:
            hidden |= kpos.unsqueeze(0) <= query_pos[row] - window
        s = s.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v))
    return torch.stack(out)


class DecodeTree:
    """A laid-out tree (see :func:`layout`) with one decode query at the last key of each of ``leaves``."""

    def __init__(self, parent, length, leaves, rng):
        self.parent, self.length, self.leaves = parent, length, leaves
        self.start, self.pos, self.slots = layout(parent, length, rng)
        self.query_pos = [self.pos[s] + length[s] - 1 for s in leaves]

    def plan(self, num_heads, num_kv_heads, **triton_options):
        return plan_tree_attention(segment_parent=self.parent, segment_start=self.start, segment_len=self.length,
                                   segment_pos=self.pos, query_segment=self.leaves, query_pos=self.query_pos,
                                   backend="triton", num_heads=num_heads, num_kv_heads=num_kv_heads, device="cpu",
                                   triton_options=triton_options or None)

    def check(self, q, k_cache, v_cache, plan):
        """The kernels' output equals plain attention (in fp64) within the inputs' dtype tolerance."""
        scale = q.shape[-1] ** -0.5
        got = tree_attention(q, k_cache, v_cache, plan, scale)
        want = ground_truth(q.float(), k_cache.float(), v_cache.float(), self.parent, self.start, self.length,
                            self.pos, self.leaves, self.query_pos, scale)
        tol = 1e-5 if q.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def make_queries(parent, length, pos, rng, prefill_rows):
    """Decode-style: one query at the end of each leaf; prefill-style: the last rows of random segments."""
    children = {p for p in parent if p != -1}
    query_segment, query_pos = [], []
    for s in range(len(parent)):
        if s not in children:
            query_segment.append(s)
            query_pos.append(pos[s] + length[s] - 1)
        elif prefill_rows and rng.random() < 0.5:
            for i in range(min(length[s], prefill_rows)):
                query_segment.append(s)
                query_pos.append(pos[s] + i)
    return query_segment, query_pos


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_random_trees_match_plain_attention(seed, num_heads, num_kv, head_dim):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 8), max_len=rng.choice([1, 17, 37, 300]))
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 5]))
    q = torch.randn(len(query_pos), num_heads, head_dim)
    k_cache = torch.randn(slots, num_kv, head_dim)
    v_cache = torch.randn(slots, num_kv, head_dim)
    scale = head_dim**-0.5
    plan = plan_tree_attention(
        segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
        query_segment=query_segment, query_pos=query_pos,
    )
    got = tree_attention(q, k_cache, v_cache, plan, scale)
    want = ground_truth(q, k_cache, v_cache, parent, start, length, pos, query_segment, query_pos, scale)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "keys-in-chunks"])
@pytest.mark.parametrize("seed", range(5))
def test_lse_reference_is_each_rows_log_sum_exp_over_what_it_sees(seed, chunked, monkeypatch):
    """``tree_lse_reference`` (values never read) equals the full reference's LSE and plain fp64
    log-sum-exp over each row's root-to-own keys — with windows and soft caps, rows that see no key
    (-inf, no NaN), GQA; also when a level's scores are made in chunks of keys (a bound of 64 score elements
    here, 1 GiB in use: long prompts under many rows)."""
    if chunked:
        from treegen.kernels import tree_attention as ta

        monkeypatch.setattr(ta, "LSE_SCORE_ELEMENTS", 64)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 6), max_len=rng.choice([1, 17, 90]))
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 5]))
    query_pos[0] = -1  # a row before every key: sees none
    num_heads, num_kv, head_dim = rng.choice([(4, 4), (9, 3), (8, 2)]) + (32,)
    window, softcap = rng.choice([None, 7]), rng.choice([None, 20.0])
    q, k, v = torch.randn(len(query_pos), num_heads, head_dim), torch.randn(slots, num_kv, head_dim), torch.randn(slots, num_kv, head_dim)
    plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=query_segment, query_pos=query_pos, window=window, softcap=softcap)
    scale = head_dim**-0.5
    got = tree_lse_reference(q, k, plan, scale)
    _, full = tree_attention_reference(q, k, v, plan, scale, return_lse=True)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    for row, seg in enumerate(query_segment):
        path = []
        while seg != -1:
            path.append(seg)
            seg = parent[seg]
        keys = torch.cat([torch.arange(start[s], start[s] + length[s]) for s in path])
        kpos = torch.cat([torch.arange(pos[s], pos[s] + length[s]) for s in path])
        sc = torch.einsum("hd,lhd->hl", q[row].double(), k[keys].double().repeat_interleave(num_heads // num_kv, 1)) * scale
        if softcap is not None:
            sc = torch.tanh(sc / softcap) * softcap
        hidden = kpos > query_pos[row]
        if window is not None:
            hidden |= kpos <= query_pos[row] - window
        want = torch.logsumexp(sc.masked_fill(hidden, float("-inf")), -1).float()
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(got[0]).all() and not got.isnan().any()
    # several layers in one call (leading dimensions on q, the cache and its scales): each layer's own LSE
    layers_q, layers_k = torch.stack([q, 2 * q, -q]), torch.stack([k, k.flip(0), 0.5 * k])
    scales = torch.rand(3, slots, num_kv) + 0.5
    stacked = tree_lse_reference(layers_q, layers_k, plan, scale, scales)
    for layer in range(3):
        torch.testing.assert_close(stacked[layer], tree_lse_reference(layers_q[layer], layers_k[layer], plan, scale,
                                                                       scales[layer]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fuse", [True, False])
def test_triton_kernels_match_plain_attention(seed, num_heads, num_kv, head_dim, dtype, fuse):
    """The Triton kernels (run by the interpreter on CPU) on random unbalanced trees, prefill and decode rows."""
    check_random_tree(seed, num_heads, num_kv, head_dim, dtype, fuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("library", [False, True])
@pytest.mark.usefixtures("short_library_chunks")
def test_merge_launch_fetching_partials_four_at_a_time_matches_plain_attention(dtype, library):
    """16 heads x 128: the merge launch fetches a row's partials four at a time. A 2,000-key root (cut into
    key chunks, or given to the library kernel in chunks) over a chain of six short segments, then 160 leaves:
    each row merges ten or more partials, so the blocked loop runs three times and ends on a partial block."""
    from treegen.kernels.tree_attention_triton import merge_block

    assert merge_block(16, 128) == merge_block(32, 128) == merge_block(16, 256) == 4
    assert merge_block(9, 64) == merge_block(32, 64) == merge_block(9, 128) == merge_block(64, 128) == 1
    rng = random.Random(23)
    torch.manual_seed(23)
    parent = [-1] + list(range(6)) + [6] * 160
    tree = DecodeTree(parent, [2000] + [9] * 6 + [rng.randint(1, 12) for _ in range(160)], list(range(7, 167)), rng)
    plan = tree.plan(16, 4, fuse_merge=False, library=library)
    assert not plan.triton.fused_merge and (plan.triton.library is not None) == library
    counts = (plan.triton.merge_ptr[1:] - plan.triton.merge_ptr[:-1]).tolist()
    assert min(counts) >= 10 and max(counts) % 4
    tree.check(*(torch.randn(n, h, 128).to(dtype) for n, h in ((160, 16), (tree.slots, 4), (tree.slots, 4))), plan)


def test_partials_of_16_bit_inputs_are_stored_in_fp16():
    """half_partials: fp16 partial outputs for 16-bit queries (fp32 ones keep fp32); the result moves by the
    partials' rounding only — different bits, the same attention within fp16 tolerance."""
    from treegen.kernels.tree_attention_triton import partial_dtype

    rng = random.Random(29)
    torch.manual_seed(29)
    parent = [-1] + [0] * 4 + [1 + i // 4 for i in range(16)]
    tree = DecodeTree(parent, [300] + [40] * 4 + [6] * 16, list(range(5, 21)), rng)
    half, full = tree.plan(8, 2), tree.plan(8, 2, half_partials=False)
    q16, q32 = torch.randn(16, 8, 64).half(), torch.randn(16, 8, 64)
    assert partial_dtype(half.triton, q16) == torch.float16 and partial_dtype(half.triton, q32) == torch.float32
    assert partial_dtype(full.triton, q16) == torch.float32
    kv = [torch.randn(tree.slots, 2, 64).half() for _ in range(2)]
    scale = 64 ** -0.5
    a, b = tree_attention(q16, *kv, half, scale), tree_attention(q16, *kv, full, scale)
    assert not torch.equal(a, b)
    tree.check(q16, *kv, half)
    tree.check(q16, *kv, full)


def check_random_tree(seed, num_heads, num_kv, head_dim, dtype, fuse):
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 4),
                                 max_len=rng.choice([1, 17, 37, 150]), min_len=rng.choice([0, 1]))
    length[0] = max(length[0], 1)
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 5]))
    keep = [i for i, (s, p) in enumerate(zip(query_segment, query_pos)) if p >= pos[s]]  # empty leaves: no own row
    query_segment, query_pos = [query_segment[i] for i in keep], [query_pos[i] for i in keep]
    q = torch.randn(len(query_pos), num_heads, head_dim).to(dtype)
    k_cache = torch.randn(max(slots, 1), num_kv, head_dim).to(dtype)
    v_cache = torch.randn(max(slots, 1), num_kv, head_dim).to(dtype)
    plan = plan_tree_attention(
        segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
        query_segment=query_segment, query_pos=query_pos, backend="triton", num_heads=num_heads, num_kv_heads=num_kv,
        triton_options={"fuse_merge": fuse},
    )
    got = tree_attention(q, k_cache, v_cache, plan, head_dim**-0.5)
    want = ground_truth(q.float(), k_cache.float(), v_cache.float(), parent, start, length, pos, query_segment,
                        query_pos, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_triton_plan_splits_long_segments():
    """A long shared prefix read by few queries is cut into key chunks (flash-decoding style)."""
    plan = plan_tree_attention(segment_parent=[-1, 0, 0], segment_start=[0, 5000, 5010], segment_len=[5000, 3, 3],
                               segment_pos=[0, 5000, 5000], query_segment=[1, 2], query_pos=[5002, 5002],
                               backend="triton", num_heads=8, num_kv_heads=1, device="cpu")
    items = [w for launch in plan.triton.launches for w in launch.work.tolist()]
    root_items = [w for w in items if w[0] == 0]
    assert len(root_items) > 4 and root_items[0][2:4] == [0, root_items[1][2]]
    assert plan.triton.merge_ptr.tolist()[-1] == 2 * (len(root_items) + 1)


def test_triton_plan_gives_leaves_small_tiles():
    """One query per leaf: leaves get 16-row tiles, the shared root 128-row tiles."""
    plan = plan_tree_attention(segment_parent=[-1] + [0] * 64, segment_start=[0] + [100 + i for i in range(64)],
                               segment_len=[100] + [1] * 64, segment_pos=[0] + [100] * 64,
                               query_segment=list(range(1, 65)), query_pos=[100] * 64, backend="triton",
                               num_heads=8, num_kv_heads=2, device="cpu")
    by_height = {launch.block_m: launch.work.shape[0] for launch in plan.triton.launches}
    assert by_height == {16: 16, 128: 2}  # (4 leaves of 4 query rows a 16-row tile: few programs pack all that fit)
    # each leaf is its query's own, unsplit item: that launch runs last and merges (no merge launch)
    assert plan.triton.fused_merge and [launch.block_m for launch in plan.triton.launches] == [128, 16]
    assert plan.triton.merge_ptr.tolist() == list(range(65))  # one ancestor partial (the root) per query


@pytest.mark.parametrize("leaves,num_heads,num_kv,want", [(64, 8, 2, 4), (128, 16, 4, 4), (1024, 32, 8, 4),
                                                           (512, 32, 8, 4), (300, 32, 8, 2), (256, 32, 8, 2),
                                                           (200, 32, 8, 1), (1024, 24, 8, 4), (1024, 9, 3, 2),
                                                           (256, 32, 32, 8), (128, 32, 32, 4), (64, 32, 32, 2)])
def test_leaves_share_tiles_while_enough_programs_remain(leaves, num_heads, num_kv, want):
    """A decode leaf's query row x its query heads fills part of a 16-row tile: a power of two of leaves share one,
    as many as fit (4 at 32/8 heads, 4 of 5 at 24/8 or 9/3, 16 for MHA) while about 1,024 programs remain (fewer
    leaves a tile where fewer would; none fewer than one a tile) — and all that fit where the leaves' programs
    number under 1,024 to begin with (8/2 heads at 64 leaves, 16/4 at 128)."""
    plan = plan_tree_attention(segment_parent=[-1] + [0] * leaves, segment_start=[0] + [600 + 3 * i for i in range(leaves)],
                               segment_len=[600] + [3] * leaves, segment_pos=[0] + [600] * leaves,
                               query_segment=list(range(1, leaves + 1)), query_pos=[602] * leaves, backend="triton",
                               num_heads=num_heads, num_kv_heads=num_kv, device="cpu")
    leaf = plan.triton.launches[-1]
    assert plan.triton.fused_merge and leaf.block_m == 16 and leaf.pack == want
    assert leaf.work.shape == (-(-leaves // want), 7 * want)
    with pytest.raises(ValueError, match="pack_leaves must be at least 1, got 0"):
        plan_tree_attention(segment_parent=[-1, 0], segment_start=[0, 5], segment_len=[5, 1], segment_pos=[0, 5],
                            query_segment=[1], query_pos=[5], backend="triton", num_heads=4, num_kv_heads=1,
                            device="cpu", triton_options={"pack_leaves": 0})


@pytest.mark.parametrize("leaf_keys,want", [(192, 4), (193, 1), (500, 1)])
def test_long_leaves_run_one_a_tile(leaf_keys, want):
    """Leaves averaging more than ``_PACK_MAX_MEAN_KEYS`` keys (192) are not packed (their keys would be read
    one leaf after another in a tile); an explicit ``pack_leaves`` still packs them."""
    leaves = 1024
    parent, start, length, pos = [-1], [0], [512], [0]
    for i in range(leaves):
        parent.append(0), start.append(512 + leaf_keys * i), length.append(leaf_keys), pos.append(512)
    kwargs = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=list(range(1, leaves + 1)), query_pos=[512 + leaf_keys - 1] * leaves,
                  backend="triton", num_heads=32, num_kv_heads=8, device="cpu")
    assert plan_tree_attention(**kwargs).triton.launches[-1].pack == want
    assert plan_tree_attention(**kwargs, triton_options={"pack_leaves": 4}).triton.launches[-1].pack == 4


def test_many_leaves_get_narrow_key_blocks_and_match_plain_attention():
    """A thousand leaf programs (128 leaves x 8 KV heads) take the launch shape for many small items
    (32-key blocks, one warp); leaves of 1..70 keys cover a partial block and a masked tail."""
    rng = random.Random(11)
    torch.manual_seed(11)
    tree = DecodeTree([-1] + [0] * 128, [40] + [rng.randint(1, 70) for _ in range(128)], list(range(1, 129)), rng)
    plan = tree.plan(8, 8)
    leaf = next(launch for launch in plan.triton.launches if launch.block_m == 16)
    assert (leaf.block_n, leaf.num_warps, leaf.num_stages) == (32, 1, 2) and plan.triton.fused_merge
    tree.check(*(torch.randn(n, 8, 64).half() for n in (128, tree.slots, tree.slots)), plan)


def test_leaf_merging_many_chunks_of_a_long_root_matches_plain_attention():
    """A 5000-key root read by five branches is split into ten chunks: each leaf item merges ten
    partials, fetched eight at a time (a full group and a partial one)."""
    torch.manual_seed(13)
    tree = DecodeTree([-1] + [0] * 5, [5000, 1, 7, 33, 40, 12], list(range(1, 6)), random.Random(13))
    plan = tree.plan(8, 2)
    per_row = plan.triton.merge_ptr.diff()
    assert plan.triton.fused_merge and per_row.min() == per_row.max() == 10
    tree.check(torch.randn(5, 8, 64), torch.randn(tree.slots, 2, 64), torch.randn(tree.slots, 2, 64), plan)


@pytest.mark.usefixtures("short_library_chunks")
def test_library_segment_is_the_large_shared_one_cut_into_chunks():
    """A 2051-key root read by 300 branches x 2 query heads per KV head goes to the library kernel:
    ~one wave of 128-row tiles (5 tiles x 2 KV heads -> 13 chunks, at most 2051 / 512 rounded = 4). Unfused,
    the last 3 keys stay with a Triton launch and each branch's merge list names its 4 library partials
    (negative entries), the tail's and its own leaf's; fused, the leaf items read the library partials by row
    and attend the 3 tail keys themselves: one launch, nothing in the merge lists. A 2,047-key root gets 4
    chunks too (rounded, not floored). Below the size limits, without the option, or when the largest
    shared segment is not most of the shared work, no segment goes to the library."""
    tree = DecodeTree([-1] + [0] * 300, [2051] + [3] * 300, list(range(1, 301)), random.Random(0))
    plan = tree.plan(4, 2, library=True, fuse_merge=False).triton
    lib = plan.library
    assert (lib.start, lib.chunks, lib.chunk_len, lib.num_rows, lib.rows) == (tree.start[0], 4, 512, 300, None)
    tail = [w for launch in plan.launches if launch.block_m == 128 for w in launch.work.tolist()]
    assert {(kb, ke) for _, _, kb, ke, *_ in tail} == {(2048, 2051)}
    idx = plan.merge_idx.tolist()
    assert plan.merge_ptr.diff().tolist() == [6] * 300 and idx[:4] == [-1, -301, -601, -901]
    fused = tree.plan(4, 2, library=True).triton
    assert fused.library_by_row and fused.merge_ptr.diff().tolist() == [0] * 300
    assert fused.leaf_tail == (tree.start[0] + 2048, tree.pos[0] + 2048, 3) and len(fused.launches) == 1
    assert fused.launches[0].block_m == 16
    odd = DecodeTree([-1] + [0] * 300, [2047] + [3] * 300, list(range(1, 301)), random.Random(0))
    assert (odd.plan(4, 2, library=True).triton.library.chunks, odd.plan(4, 2, library=True).triton.leaf_tail[2]) == (4, 3)
    assert tree.plan(4, 2, library=True, fuse_merge=False).triton.leaf_tail == (0, 0, 0)
    assert tree.plan(4, 2).triton.library is None
    small = DecodeTree([-1] + [0] * 300, [1000] + [3] * 300, list(range(1, 301)), random.Random(0))
    assert small.plan(4, 2, library=True).triton.library is None
    halves = DecodeTree([-1, -1] + [0, 1] * 150, [2051, 2051] + [3] * 300, list(range(2, 302)), random.Random(0))
    assert halves.plan(4, 2, library=True).triton.library is None  # each root is half of the shared work
    few = DecodeTree([-1] + [0] * 64, [16384] + [3] * 64, list(range(1, 65)), random.Random(0))
    assert few.plan(8, 1, library=True).triton.library is None  # 4 tiles would need 32 chunks (over 8)


@pytest.mark.usefixtures("short_library_chunks")
def test_library_segment_for_any_group(monkeypatch):
    """Where cuDNN is available, a large shared prefix goes to it for 4 query heads per KV head and for
    3 or 6 (Phi-4-mini's 24/8: folded into the rows, see test_folded_heads_give_the_gqa_partials) — a
    folded group only in at most two chunks (more spill the leaves' registers: triton_plan)."""
    from treegen.kernels import tree_attention as module

    monkeypatch.setattr(module, "library_available", lambda device, dtype: True)
    tree = DecodeTree([-1] + [0] * 300, [2051] + [3] * 300, list(range(1, 301)), random.Random(0))

    def planned(num_heads, num_kv_heads):
        return plan_tree_attention(segment_parent=tree.parent, segment_start=tree.start, segment_len=tree.length,
                                   segment_pos=tree.pos, query_segment=tree.leaves, query_pos=tree.query_pos,
                                   backend="triton", num_heads=num_heads, num_kv_heads=num_kv_heads, device="cpu",
                                   dtype=torch.bfloat16).triton.library

    assert all(planned(h, 2) is not None for h in (8, 16))
    assert planned(24, 8).chunks == 2  # 300 rows x 3 heads: 8 tiles of 128 x 8 KV heads; 2 chunks ~ one wave
    assert planned(6, 2) is None  # 8 tiles x 2 KV heads: 8 chunks would fill the GPU, 2051 // 512 caps it at 4 (> 2)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (9, 3), (24, 8)])
def test_folded_heads_give_the_gqa_partials(heads, kv_heads):
    """cuDNN gets a group that is not a power of two as multi-head attention over ``group`` times the rows
    (library_attention.fold_heads); unfolded, its partials are those of grouped-query attention."""
    from treegen.kernels import library_attention as lib

    assert lib.folds_heads(heads // kv_heads) and not lib.folds_heads(4) and not lib.folds_heads(1)
    torch.manual_seed(heads)
    chunks, rows, keys, dim = 3, 5, 7, 16
    q = torch.randn(rows, heads, dim)
    q4 = q.permute(1, 0, 2).unsqueeze(0).expand(chunks, -1, -1, -1)  # as _operands gives them
    k4, v4 = torch.randn(chunks, kv_heads, keys, dim), torch.randn(chunks, kv_heads, keys, dim)

    def attend(q4, group):  # plain softmax attention, key heads repeated for the group
        k, v = (t.repeat_interleave(group, 1) for t in (k4, v4))
        s = q4 @ k.transpose(-1, -2) * 0.3
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    want_out, want_lse = attend(q4, heads // kv_heads)
    folded = lib.fold_heads(q4, kv_heads)
    assert folded.shape == (chunks, kv_heads, heads // kv_heads * rows, dim)
    out, lse = lib.unfold_heads(*attend(folded, 1), heads)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.usefixtures("short_library_chunks")
def test_library_partials_read_by_row_match_plain_attention(fuse):
    """A 1537-key root under 64 branches (8/1 heads): three 512-key library chunks (not a power of two)
    and a one-key tail. Fused, each leaf reads its three library partials by its row; the leaves' rows
    are consecutive query rows, so their items name the row directly."""
    rng = random.Random(8)
    torch.manual_seed(8)
    tree = DecodeTree([-1] + [0] * 64, [1537] + [rng.randint(1, 9) for _ in range(64)], list(range(1, 65)), rng)
    plan = tree.plan(8, 1, library=True, fuse_merge=fuse).triton
    assert (plan.library.chunks, plan.library.chunk_len, plan.library_by_row) == (3, 512, fuse)
    assert all(launch.direct_rows for launch in plan.launches)
    tree.check(*(torch.randn(n, h, 64).half() for n, h in ((64, 8), (tree.slots, 1), (tree.slots, 1))),
               tree.plan(8, 1, library=True, fuse_merge=fuse))


def library_below_the_root_tree() -> DecodeTree:
    """A 1101-key middle node read by 70 of 75 decode branches (seeded: the same tree every call)."""
    rng = random.Random(5)
    torch.manual_seed(5)
    parent = [-1, 0, 0] + [2] * 5 + [1] * 70
    length = [40, 1101, 30] + [rng.randint(1, 20) for _ in range(75)]
    return DecodeTree(parent, length, list(range(3, 78)), rng)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.usefixtures("short_library_chunks")
def test_library_segment_below_the_root_matches_plain_attention(fuse, dtype):
    """The library segment is a middle node (1101 keys) read by 70 of the 75 branches, not the first
    ones: its query rows are gathered, its two 550-key chunks' partials read through the library
    output's strides and merged with the root's, its 1-key tail's and each leaf's."""
    tree = library_below_the_root_tree()
    plan = tree.plan(8, 1, library=True, fuse_merge=fuse)
    lib = plan.triton.library
    assert (lib.chunks, lib.chunk_len, lib.num_rows, lib.rows.tolist()) == (2, 550, 70, list(range(5, 75)))
    assert plan.triton.fused_merge == fuse
    tree.check(*(torch.randn(n, h, 64).to(dtype) for n, h in ((75, 8), (tree.slots, 1), (tree.slots, 1))), plan)


@pytest.mark.parametrize("fuse", [True, False])
def test_fused_merge_on_a_three_level_decode_tree_matches_plain_attention(fuse):
    """Root -> 3 middle nodes -> 6 leaves each, one decode query per leaf, 9 query / 3 KV heads: the
    leaf items merge the root's (split) and middle nodes' partials themselves."""
    parent, length = [-1] + [0] * 3 + [1 + i // 6 for i in range(18)], [700] + [37] * 3 + [17] * 18
    tree = DecodeTree(parent, length, list(range(4, 22)), random.Random(5))
    plan = tree.plan(9, 3, fuse_merge=fuse)
    assert plan.triton.fused_merge == fuse
    tree.check(torch.randn(18, 9, 64), torch.randn(tree.slots, 3, 64), torch.randn(tree.slots, 3, 64), plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scores_that_jump_between_key_blocks_match_plain_attention(dtype):
    """Scores rise and fall by tens between 64-key blocks of a long shared root (the running max moves
    far, both ways, and fp16 probabilities must not overflow); three leaves merge the root's chunks."""
    torch.manual_seed(3)
    tree = DecodeTree([-1, 0, 0, 0], [900, 5, 1, 17], [1, 2, 3], random.Random(3))
    head_dim, direction = 64, torch.randn(64).sign()
    q = (direction * 0.5).expand(3, 8, head_dim).clone() + 0.1 * torch.randn(3, 8, head_dim)
    k_cache, v_cache = torch.randn(tree.slots, 1, head_dim), torch.randn(tree.slots, 1, head_dim)
    block_level = torch.tensor([0.0, 4.0, 1.0, 9.0, 9.5, 2.0, 12.0, 3.0, 15.0, 0.0, 14.0, 1.0, 5.0, 16.0, 2.0])
    lift = block_level[torch.arange(900) // 64] * 2.0  # up to ~+64 in score between neighbouring blocks
    k_cache[tree.start[0]:tree.start[0] + 900, 0] += lift[:, None] * direction
    tree.check(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tree.plan(8, 1))


def test_empty_segment_gives_no_nan():
    # root of 5 keys, an empty child (a fork point with no tokens yet), and a leaf of 3 keys below it
    parent, length, start, pos = [-1, 0, 1], [5, 0, 3], [0, 5, 5], [0, 5, 5]
    q = torch.randn(2, 2, 64)
    k, v = torch.randn(8, 1, 64), torch.randn(8, 1, 64)
    plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=[2, 1], query_pos=[7, 4])
    got = tree_attention(q, k, v, plan, 0.125)
    assert not torch.isnan(got).any()
    want = ground_truth(q, k, v, parent, start, length, pos, [2, 1], [7, 4], 0.125)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_merge_with_empty_side_is_identity():
    o = torch.randn(3, 4, 8)
    lse = torch.randn(3, 4)
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    merged, merged_lse = merge_attention_states(o, lse, empty_o, empty_lse)
    torch.testing.assert_close(merged, o)
    torch.testing.assert_close(merged_lse, lse)
    both_o, both_lse = merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)
    assert not torch.isnan(both_o).any() and torch.isinf(both_lse).all()


def test_bad_inputs_are_named():
    plan = plan_tree_attention(segment_parent=[-1], segment_start=[0], segment_len=[2], segment_pos=[0],
                               query_segment=[0], query_pos=[1])
    with pytest.raises(ValueError, match="num_kv_heads"):
        tree_attention(torch.randn(1, 5, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), plan, 1.0)
    with pytest.raises(ValueError, match="plan was made for 1"):
        tree_attention(torch.randn(3, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), plan, 1.0)
    with pytest.raises(ValueError, match="segment 3"):
        plan_tree_attention(segment_parent=[-1], segment_start=[0], segment_len=[2], segment_pos=[0],
                            query_segment=[3], query_pos=[1])
    with pytest.raises(ValueError, match="cycle"):
        plan_tree_attention(segment_parent=[1, 0], segment_start=[0, 2], segment_len=[2, 2], segment_pos=[0, 2],
                            query_segment=[0], query_pos=[1])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sliding_window_and_soft_cap_match_plain_attention(seed, backend):
    """Windows shorter and longer than segments (prefill and decode rows, unbalanced trees), with and
    without soft-capping: both backends equal plain attention with HF's window rule."""
    rng = random.Random(300 + seed)
    torch.manual_seed(seed)
    (num_heads, num_kv), head_dim = rng.choice([(4, 4), (9, 3), (8, 1)]), rng.choice([64, 128, 256])
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 4),
                                 max_len=rng.choice([17, 37, 150]))
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 5]))
    window = rng.choice([1, 7, 40, 100])
    softcap = rng.choice([None, 5.0])
    dtype = torch.float32
    q = torch.randn(len(query_pos), num_heads, head_dim, dtype=dtype) * 3  # large scores: the cap matters
    k_cache = torch.randn(slots, num_kv, head_dim, dtype=dtype)
    v_cache = torch.randn(slots, num_kv, head_dim, dtype=dtype)
    plan = plan_tree_attention(
        segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
        query_segment=query_segment, query_pos=query_pos, backend=backend, num_heads=num_heads, num_kv_heads=num_kv,
        window=window, softcap=softcap, triton_options={"block_n": 16} if backend == "triton" else None,
    )
    scale = head_dim**-0.5
    got = tree_attention(q, k_cache, v_cache, plan, scale)
    want = ground_truth(q, k_cache, v_cache, parent, start, length, pos, query_segment, query_pos, scale,
                        window=window, softcap=softcap)
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=2e-5)


def test_window_plan_leaves_out_segments_no_row_can_see():
    """A root of 100 keys under two leaves of 30: with a window of 20 no leaf query sees the root, so the
    plan reads only the leaves (the reference has one level, the Triton plan no root work item)."""
    parent, length, pos, start = [-1, 0, 0], [100, 30, 30], [0, 100, 100], [0, 100, 130]
    kwargs = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=[1, 2], query_pos=[129, 129])
    assert len(plan_tree_attention(**kwargs, window=20).levels) == 1
    assert len(plan_tree_attention(**kwargs).levels) == 2
    tri = plan_tree_attention(**kwargs, window=20, backend="triton", num_heads=2, num_kv_heads=1).triton
    items = [item for launch in tri.launches for item in launch.work.reshape(-1, 7).tolist() if item[5]]
    assert sorted(item[0] for item in items) == [100, 130]  # (rows in each; a packed launch's empty items have none)
    with pytest.raises(ValueError, match="window"):
        plan_tree_attention(**kwargs, window=0)
    with pytest.raises(ValueError, match="softcap"):
        plan_tree_attention(**kwargs, softcap=-1.0)
    shared = torch.tensor([129, 129])
    assert plan_tree_attention(**kwargs, query_pos_buffer=shared).query_pos is shared  # not copied
    with pytest.raises(ValueError, match="query_pos_buffer"):
        plan_tree_attention(**kwargs, query_pos_buffer=torch.tensor([129]))


def test_each_launch_lists_its_longest_items_first_and_matches_plain_attention():
    """Programs start in work-table order: every launch's items go by decreasing key count (the long ones
    start first, short ones fill in), on an uneven two-level tree whose items have many lengths; the
    output is the same as with the segments' own order."""
    rng = random.Random(17)
    torch.manual_seed(17)
    parent, length = [-1], [300]
    for _ in range(6):
        p = len(parent)
        parent.append(0)
        length.append(rng.randint(20, 400))
        for _ in range(rng.randint(1, 12)):
            parent.append(p)
            length.append(rng.randint(1, 90))
    leaves = [s for s in range(len(parent)) if s not in set(parent)]
    tree = DecodeTree(parent, length, leaves, rng)
    ordered, plain = tree.plan(8, 2), tree.plan(8, 2, longest_first=False)
    for launch in ordered.triton.launches:
        keys = (launch.work[:, 3] - launch.work[:, 2]).tolist()
        assert keys == sorted(keys, reverse=True) and len(set(keys)) > 1
    assert any((a.work != b.work).any() for a, b in zip(ordered.triton.launches, plain.triton.launches))
    qkv = [torch.randn(n, h, 64) for n, h in ((len(leaves), 8), (tree.slots, 2), (tree.slots, 2))]
    for plan in (ordered, plain):
        tree.check(*qkv, plan)


def test_dependent_launches_wait_for_what_they_read():
    """Programmatic dependent launch: the first kernel of a call never depends on the one before; at level 1
    only the kernels that read the partials before them (fused leaves, the merge); at level 2 every later
    segment launch too; none at level 0. (This checks the choice only: the waits run on the GPU, where every
    tree-attention GPU test runs with level 2 — a missing wait would show there only as a race.)"""
    from treegen.kernels.tree_attention_triton import dependent_launches

    rng = random.Random(5)
    fused = DecodeTree([-1] + [0] * 64, [100] + [3] * 64, list(range(1, 65)), rng).plan(8, 2)
    assert fused.triton.fused_merge and [w.block_m for w in fused.triton.launches] == [128, 16]
    assert dependent_launches(fused.triton, 0) == [False, False, False]
    assert dependent_launches(fused.triton, 1) == dependent_launches(fused.triton, 2) == [False, True, False]
    # a three-level tree whose middle level is read by few rows: 16-row ancestors, so no fused merge
    parent = [-1] + [0] * 8 + [1 + i // 2 for i in range(16)]
    unfused = DecodeTree(parent, [600] + [50] * 8 + [5] * 16, list(range(9, 25)), rng).plan(8, 2)
    assert not unfused.triton.fused_merge and len(unfused.triton.launches) == 2
    assert dependent_launches(unfused.triton, 1) == [False, False, True]
    assert dependent_launches(unfused.triton, 2) == [False, True, True]
    assert dependent_launches(unfused.triton, 0) == [False, False, False]
    assert fused.triton.pdl == 0  # a CPU plan: no programmatic dependent launch


def test_segments_read_by_few_rows_get_a_64_row_launch_when_they_fill_half_a_wave():
    """Problems read by 8 branches x 4 heads (32 rows x heads) below a root read by all: enough of them
    (72 programs with 8 KV heads) get 64-row tiles in a launch of their own; the same tree with 2 KV heads
    (18 programs) keeps them in the 128-row launch. Both match plain attention (fp16 partials)."""
    rng = random.Random(19)
    torch.manual_seed(19)
    parent = [-1] + [0] * 9 + [1 + i // 8 for i in range(72)]
    tree = DecodeTree(parent, [200] + [30] * 9 + [5] * 72, list(range(10, 82)), rng)
    for heads, kv, mid in ((32, 8, True), (8, 2, False)):
        plan = tree.plan(heads, kv)
        assert (64 in [w.block_m for w in plan.triton.launches]) == mid
        assert 128 in [w.block_m for w in plan.triton.launches] and plan.triton.half_partials
        tree.check(*(torch.randn(n, h, 64).half() for n, h in ((72, heads), (tree.slots, kv), (tree.slots, kv))), plan)


@pytest.mark.parametrize("case", range(8))
def test_leaves_packed_into_shared_tiles_match_plain_attention(case):
    """Decode leaves of many lengths (some past a key block, some of one key) below a shared prefix, several
    leaves a 16-row tile: every group (MHA's 16 leaves a tile, 9/3's 5 with a padding row, 8/1's 2), a last
    tile with empty items, sliding windows and soft caps, 8-bit caches; equal to plain attention and to the
    plan with one leaf a tile."""
    from treegen.kernels.kv_quant import dequantize_reference, kv_format, quantize_reference

    rng = random.Random(700 + case)
    torch.manual_seed(case)
    num_heads, num_kv = [(4, 4), (9, 3), (8, 2), (8, 1)][case % 4]
    leaves = max(rng.choice([7, 13, 21]), 16 // (num_heads // num_kv) + 1)  # (the prefix: more than 16 rows)
    parent = [-1] + [0] * leaves
    length = [rng.randint(20, 70)] + [rng.choice([1, 2, 9, 33, 40]) for _ in range(leaves)]
    start, pos, slots = layout(parent, length, rng)
    # cases 4 and 5: leaves of 1-2 query rows (a leaf's last keys, as a mixed step's), listed in shuffled
    # order (no item's rows consecutive: rows read through the plan's list)
    rows_per_leaf = 2 if case in (4, 5) and num_heads // num_kv <= 4 else 1
    query_segment, query_pos = [], []
    for s in range(1, leaves + 1):
        r = min(rng.randint(1, rows_per_leaf), length[s])
        query_segment += [s] * r
        query_pos += [pos[s] + length[s] - r + i for i in range(r)]
    if rows_per_leaf > 1:
        order = list(range(len(query_pos)))
        rng.shuffle(order)
        query_segment, query_pos = [query_segment[i] for i in order], [query_pos[i] for i in order]
    window = 25 if case in (1, 6) else None
    softcap = 4.0 if case in (2, 6) else None
    quant = {3: "int8", 7: "fp8"}.get(case)
    dtype = torch.float16 if case == 5 else torch.float32
    q = (torch.randn(len(query_pos), num_heads, 64) * 2).to(dtype)
    k_cache, v_cache = (torch.randn(slots, num_kv, 64) for _ in range(2))
    scales = ()
    if quant:
        (k8, ks), (v8, vs) = (quantize_reference(x, kv_format(quant, torch.float32)) for x in (k_cache, v_cache))
        k_cache, v_cache = dequantize_reference(k8, ks), dequantize_reference(v8, vs)  # (what the reference sees)
        scales = (ks, vs)
    k_in, v_in = (k8, v8) if quant else (k_cache.to(dtype), v_cache.to(dtype))
    outs = []
    for pack in (16, 1):
        plan = plan_tree_attention(
            segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
            query_segment=query_segment, query_pos=query_pos, backend="triton", num_heads=num_heads,
            num_kv_heads=num_kv, window=window, softcap=softcap,
            triton_options={"block_n": 16, "pack_leaves": pack})
        leaf_launch = plan.triton.launches[-1]
        assert plan.triton.fused_merge and leaf_launch.block_m == 16
        assert leaf_launch.pack == min(pack, 16 // (num_heads // num_kv * rows_per_leaf), leaves)
        assert leaf_launch.direct_rows == (rows_per_leaf == 1)
        outs.append(tree_attention(q, k_in, v_in, plan, 64**-0.5, *scales).float())
    want = ground_truth(q.float(), k_cache.float(), v_cache.float(), parent, start, length, pos, query_segment,
                        query_pos, 64**-0.5, window=window, softcap=softcap)
    tol = 2e-3 if dtype == torch.float16 else 2e-5
    torch.testing.assert_close(outs[0], want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


@pytest.mark.usefixtures("short_library_chunks")
def test_packed_leaves_merge_a_library_segment_by_row_and_reload_into_padded_plans():
    """Leaves sharing tiles below a prefix the library kernel takes (its partials merged by row, its one key past
    the chunks attended by every packed tile), leaves of 1-3
    query rows; then a padded plan (kept phase graphs) loaded with that plan and with a smaller one of the same
    shape key: every row equals plain attention."""
    from treegen.runtime.phase_graphs import _room

    def tree(seed, leaves, root_len):
        rng = random.Random(seed)
        parent = [-1] + [0] * leaves
        length = [root_len] + [rng.choice([1, 3, 9, 20]) for _ in range(leaves)]
        start, pos, slots = layout(parent, length, rng)
        qs, qp = [], []
        for s in range(1, leaves + 1):
            r = min(rng.choice([1, 2, 3]), length[s])
            qs += [s] * r
            qp += [pos[s] + length[s] - r + i for i in range(r)]
        return parent, length, start, pos, slots, qs, qp

    def plan_of(t, **options):
        parent, length, start, pos, _, qs, qp = t
        return plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                                   query_segment=qs, query_pos=qp, backend="triton", num_heads=4, num_kv_heads=2,
                                   triton_options={"block_n": 16, "pack_leaves": 16, **options})

    torch.manual_seed(0)
    big = tree(1, 170, 1101)
    plan = plan_of(big, library=True)
    assert plan.triton.library is not None and plan.triton.library_by_row and plan.triton.launches[-1].pack == 2
    assert plan.triton.library.chunks == 2 and plan.triton.leaf_tail[2] == 1  # the packed leaves attend the tail
    parent, length, start, pos, slots, qs, qp = big
    q, k, v = torch.randn(len(qs), 4, 64), torch.randn(slots, 2, 64), torch.randn(slots, 2, 64)
    want = ground_truth(q, k, v, parent, start, length, pos, qs, qp, 64**-0.5)
    torch.testing.assert_close(tree_attention(q, k, v, plan, 64**-0.5), want.float(), atol=2e-5, rtol=2e-5)

    small = tree(2, 9, 40)
    plans = [plan_of(t) for t in (tree(3, 21, 40), small)]
    assert plans[0].shape_key() == plans[1].shape_key() and plans[0].triton.launches[-1].pack == 2
    rows = 64
    query_pos = torch.zeros(rows, dtype=torch.int64)
    padded = plans[0].padded(rows, _room(plans[0].sizes()), query_pos)
    for t, p in zip((tree(3, 21, 40), small), plans):
        parent, length, start, pos, slots, qs, qp = t
        padded.load(p)
        query_pos.zero_()
        query_pos[:len(qp)] = torch.tensor(qp)
        q, k, v = torch.randn(rows, 4, 64), torch.randn(slots, 2, 64), torch.randn(slots, 2, 64)
        got = tree_attention(q, k, v, padded, 64**-0.5)[:len(qs)]
        want = ground_truth(q[:len(qs)], k, v, parent, start, length, pos, qs, qp, 64**-0.5)
        torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=2e-5)
