"""The library segment's keys past its chunks (``TritonPlan.leaf_tail``), attended by every fused leaf program.

cuDNN reads a large shared segment in equal chunks; when every query row reads it and the leaves fuse the merge,
the few keys past the chunks are attended by each leaf's own program (no launch of their own). These tests run the
Triton kernels under the interpreter on random trees where that happens — the segment the root or a middle node,
leaves packed or not, rows of prefill and decode, fp32/fp16/bf16 queries, 8-bit caches, groups of 1-8 query heads
per KV head, head_dim 64-256 — against plain attention, and check the planner's chunk rule at the lengths where
rounding and the old floor differ (against the loop reference planner too).
"""

import random

import pytest
import torch

from test_tree_attention import ground_truth, layout
from test_triton_plan import assert_same_plan
from treegen.kernels import triton_plan
from treegen.kernels.kv_quant import dequantize_reference, kv_format, quantize_reference
from treegen.kernels.row_paths import row_paths
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention
from triton_plan_reference import reference_paths, reference_plan_triton

# small trees with several library chunks of ~512 keys (the planner's own chunks hold 2,048 and fill half a wave)
pytestmark = pytest.mark.usefixtures("short_library_chunks")


def library_tree(rng, *, group, lib_len, middle, multi_rows):
    """Leaves (enough rows x heads for the library) below one long segment every query row reads: the root, or
    (``middle``) a node under a short root. ``multi_rows``: leaves of up to 16 // group query rows, at the end or
    anywhere in the leaf (prefill rows), listed in shuffled order. Returns the plan's inputs."""
    leaves = -(-512 // group) + rng.randint(0, 8)
    top = [-1, 0] if middle else [-1]
    parent = top + [len(top) - 1] * leaves
    length = ([rng.randint(1, 40)] if middle else []) + [lib_len] + [rng.choice([1, 2, 5, 16, 17, 40])
                                                                     for _ in range(leaves)]
    start, pos, slots = layout(parent, length, rng)
    most = max(1, 16 // group) if multi_rows else 1
    qs, qp = [], []
    for s in range(len(top), len(parent)):
        r = min(rng.randint(1, most), length[s])
        at = (range(pos[s] + length[s] - r, pos[s] + length[s]) if rng.random() < 0.5
              else sorted(rng.sample(range(pos[s], pos[s] + length[s]), r)))
        qs += [s] * r
        qp += list(at)
    if multi_rows:
        order = list(range(len(qs)))
        rng.shuffle(order)
        qs, qp = [qs[i] for i in order], [qp[i] for i in order]
    return parent, start, length, pos, slots, qs, qp


# (query heads per KV head, KV heads, head_dim, query dtype, 8-bit cache, pack_leaves, middle, multi_rows, length)
CASES = [
    (8, 1, 64, torch.float32, None, 1, False, False, 2047),
    (8, 1, 64, torch.float32, None, 2, False, True, 1537),
    (4, 2, 64, torch.float16, None, 4, True, False, 1279),
    (2, 1, 64, torch.float32, None, 8, False, True, 2051),
    (3, 1, 64, torch.float32, None, 5, False, True, 1027),  # folded (not a power of two), 2 chunks at most
    (7, 1, 64, torch.float32, None, 1, True, True, 1101),
    (8, 1, 256, torch.float32, None, 2, False, False, 1283),  # fp32 x head_dim 256: the launch's halved key block
    (8, 2, 64, torch.float32, "int8", 2, False, True, 3071),
    (4, 1, 128, torch.float32, "fp8", 4, True, False, 1790),
    (8, 1, 64, torch.bfloat16, "fp8", 2, True, True, 2049),  # bf16 queries over FP8: products in fp16
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{str(c[3])[6:]}-{c[4]}-p{c[5]}"
                                                      f"{'-mid' if c[6] else ''}{'-rows' if c[7] else ''}-{c[8]}")
def test_leaf_tail_on_random_trees_matches_plain_attention(case):
    group, kv, head_dim, dtype, quant, pack, middle, multi_rows, lib_len = case
    rng = random.Random(lib_len * group)
    torch.manual_seed(lib_len)
    parent, start, length, pos, slots, qs, qp = library_tree(rng, group=group, lib_len=lib_len, middle=middle,
                                                             multi_rows=multi_rows)
    heads = group * kv
    plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=qs, query_pos=qp, backend="triton", num_heads=heads, num_kv_heads=kv,
                               device="cpu", triton_options={"library": True, "pack_leaves": pack, "block_n": 16})
    t = plan.triton
    lib = t.library
    assert lib is not None and t.library_by_row and 0 < t.leaf_tail[2] == lib_len - lib.chunks * lib.chunk_len < lib.chunks
    assert all(w.block_m == 16 for w in t.launches) != middle  # the tail has no launch of its own (the short
    # root above a middle library segment has its 128-row launch)
    q = (torch.randn(len(qs), heads, head_dim) * 1.5).to(dtype)
    if quant:
        fmt = kv_format(quant, torch.float32)
        (k, ks), (v, vs) = (quantize_reference(torch.randn(slots, kv, head_dim), fmt) for _ in range(2))
        scales, kf, vf = (ks, vs), dequantize_reference(k, ks), dequantize_reference(v, vs)
    else:
        k, v = (torch.randn(slots, kv, head_dim).to(dtype) for _ in range(2))
        scales, kf, vf = (), k.float(), v.float()
    got = tree_attention(q, k, v, plan, head_dim**-0.5, *scales)
    want = ground_truth(q.float(), kf, vf, parent, start, length, pos, qs, qp, head_dim**-0.5)
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("pack", [1, 4])
def test_leaf_tail_with_shared_segments_between_the_library_and_the_leaves(pack):
    """Library root (2,051 keys: 4 chunks + 3 tail keys) -> 8 middle nodes (their own wide launch, merged by every
    row) -> 136 leaves of 1-2 query rows, 4/1 heads, fp16."""
    rng = random.Random(77)
    torch.manual_seed(77)
    parent = [-1] + [0] * 8 + [1 + i % 8 for i in range(136)]
    length = [2051] + [rng.randint(5, 60) for _ in range(8)] + [rng.randint(1, 30) for _ in range(136)]
    start, pos, slots = layout(parent, length, rng)
    qs, qp = [], []
    for s in range(9, len(parent)):
        r = min(rng.randint(1, 2), length[s])
        qs += [s] * r
        qp += [pos[s] + length[s] - r + i for i in range(r)]
    plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=qs, query_pos=qp, backend="triton", num_heads=4, num_kv_heads=1,
                               device="cpu", triton_options={"library": True, "pack_leaves": pack})
    t = plan.triton
    assert t.library_by_row and t.leaf_tail[2] == 3 and len(t.launches) == 2 and t.launches[-1].pack == min(pack, 2)
    q = torch.randn(len(qs), 4, 64).half()
    k, v = torch.randn(slots, 1, 64).half(), torch.randn(slots, 1, 64).half()
    got = tree_attention(q, k, v, plan, 0.125)
    want = ground_truth(q.float(), k.float(), v.float(), parent, start, length, pos, qs, qp, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)


def one_root_plans(length, group, kv, rows, fuse=True):
    """(numpy plan, loop reference plan) of ``rows`` one-query leaves below a root of ``length`` keys."""
    parent = [-1] + [0] * rows
    lens = [length] + [2] * rows
    start = [0] + [length + 2 * i for i in range(rows)]
    pos = [0] + [length] * rows
    qs, qp = list(range(1, rows + 1)), [length + 1] * rows
    rows_of, paths, local = reference_paths(parent, pos, lens, qs, qp)
    common = dict(segment_start=start, segment_len=lens, segment_pos=pos, num_kv_heads=kv, group=group, device="cpu",
                  library=True, fuse_merge=fuse)
    return (triton_plan.plan_triton(paths=row_paths(parent, qs), **common),
            reference_plan_triton(rows_of=rows_of, paths=paths, path_local=local, **common))


def test_chunk_count_is_the_length_rounded_but_never_declines_what_the_floor_took():
    """2,047 keys get the 4 chunks of 2,048 (rounded, not floored); where rounding up would pass the group's limit
    and the floor does not (8/1 heads x 64 rows at 4,352-4,607 keys: 9 > 8; groups of 3 at 1,280-1,535 keys:
    3 > 2), the segment still goes to the library at the limit. Both planners agree table for table."""
    for length, group, kv, rows, chunks in [(2047, 4, 2, 130, 4), (2047, 8, 1, 128, 4), (4352, 8, 1, 64, 8),
                                            (4607, 8, 1, 64, 8), (1280, 3, 1, 200, 2), (1535, 3, 8, 256, 2)]:
        got, want = one_root_plans(length, group, kv, rows)
        assert_same_plan(got, want)
        assert got.library is not None and got.library.chunks == chunks, (length, group, kv, rows)
        assert got.leaf_tail[2] == length - chunks * got.library.chunk_len
    assert one_root_plans(4608, 8, 1, 64)[0].library is None  # the floor (9) passes the limit too: declined


def test_planners_agree_around_the_rounding_threshold():
    for length in list(range(1024, 1300, 23)) + [2046, 2047, 2048, 2049, 4351, 4352, 4607, 4608]:
        for group, kv, rows in ((8, 1, 64), (4, 2, 130), (3, 1, 171), (1, 1, 512)):
            for fuse in (True, False):
                got, want = one_root_plans(length, group, kv, rows, fuse)
                assert_same_plan(got, want)
                if got.library is not None and not (fuse and got.library_by_row):
                    assert got.leaf_tail == (0, 0, 0)
