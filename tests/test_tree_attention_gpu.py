"""GPU tests of the Triton tree attention (compiled, not interpreted): bf16/fp16 vs the fp32 reference.

Run on a CUDA machine with TRITON_INTERPRET=0; skipped elsewhere.
"""

import random

import pytest
import torch

from test_tree_attention import ground_truth, layout, make_queries, random_tree
from treegen.kernels.library_attention import library_available
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention, tree_attention_reference

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def plans(parent, start, length, pos, query_segment, query_pos, heads, kv, dtype):
    """The plan the runtime makes for ``dtype`` (a large shared segment goes to cuDNN on Hopper), and the reference's."""
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=query_segment, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv)
    return plan_tree_attention(**common, dtype=dtype), plan_tree_attention(**common, backend="reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,prefix,suffix", [(64, 1024, 32), (256, 4096, 256), (1024, 1024, 32), (3, 16384, 1)])
@pytest.mark.parametrize("heads,kv,head_dim", [(8, 1, 128), (32, 8, 128), (32, 32, 128), (9, 3, 64), (16, 8, 256),
                                               (24, 8, 128)])
def test_paper_grid_shapes(dtype, batch, prefix, suffix, heads, kv, head_dim):
    torch.manual_seed(0)
    parent = [-1] + [0] * batch
    length = [prefix] + [suffix] * batch
    start = [0] + [prefix + i * suffix for i in range(batch)]
    pos = [0] + [prefix] * batch
    query_segment = list(range(1, batch + 1))
    query_pos = [prefix + suffix - 1] * batch
    slots = prefix + batch * suffix
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    fast, ref = plans(parent, start, length, pos, query_segment, query_pos, heads, kv, dtype)
    assert fast.backend == "triton"
    got = tree_attention(q, k, v, fast, head_dim**-0.5)
    want = tree_attention_reference(q.float(), k.float(), v.float(), ref, head_dim**-0.5)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_trees(seed, dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv, head_dim = rng.choice([(8, 1, 128), (9, 3, 64), (4, 4, 64)])
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 8),
                                 max_len=rng.choice([17, 37, 300, 2000]))
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 40]))
    q = torch.randn(len(query_pos), heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    fast, _ = plans(parent, start, length, pos, query_segment, query_pos, heads, kv, dtype)
    got = tree_attention(q, k, v, fast, head_dim**-0.5)
    want = ground_truth(q.cpu().float(), k.cpu().float(), v.cpu().float(), parent, start, length, pos,
                        query_segment, query_pos, head_dim**-0.5)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("heads", [32, 24])
def test_library_segment_below_the_root(dtype, fuse, heads):
    """cuDNN attends a 4099-key middle node read by 200 of 210 branches (its rows gathered, keys in two
    chunks plus a one-key Triton tail); the result equals the Triton-only plan's and plain attention's.
    24/8 heads (400 of 410 branches): the groups of 3 folded into cuDNN's rows."""
    if not library_available("cuda", dtype):
        pytest.skip("no cuDNN fused attention on this GPU")
    rng = random.Random(3)
    torch.manual_seed(3)
    below = {32: 200, 24: 400}[heads]  # (24/8: enough rows for two chunks, the most a folded group gets)
    parent = [-1, 0, 0] + [2] * 10 + [1] * below
    length = [100, 4099, 50] + [rng.randint(1, 40) for _ in range(10 + below)]
    start, pos, slots = layout(parent, length, rng)
    query_segment = list(range(3, 13 + below))
    query_pos = [pos[s] + length[s] - 1 for s in query_segment]
    kv, head_dim = 8, 128
    q = torch.randn(len(query_pos), heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=query_segment, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv,
                  dtype=dtype)
    fast = plan_tree_attention(**common, triton_options={"fuse_merge": fuse})
    lib = fast.triton.library
    assert lib is not None and lib.rows is not None and (lib.chunks, lib.chunk_len) == (2, 2049)
    triton_only = plan_tree_attention(**common, triton_options={"fuse_merge": fuse, "library": False})
    got = tree_attention(q, k, v, fast, head_dim**-0.5)
    torch.testing.assert_close(got, tree_attention(q, k, v, triton_only, head_dim**-0.5), atol=TOL[dtype], rtol=TOL[dtype])
    want = ground_truth(q.cpu().float(), k.cpu().float(), v.cpu().float(), parent, start, length, pos,
                        query_segment, query_pos, head_dim**-0.5)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    with pytest.raises(ValueError, match="fp16/bf16"):
        tree_attention(q.float(), k.float(), v.float(), fast, head_dim**-0.5)


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
@pytest.mark.parametrize("prefix, leaves", [(2047, 256), (2048, 256), (2045, 128)])
@pytest.mark.usefixtures("short_library_chunks")  # (the planner's own chunks of 2K make no tail of a 2K prompt)
def test_library_tail_attended_by_the_fused_leaves(kv_dtype, prefix, leaves):
    """Llama-3-8B's decode shape (32/8 x 128, bf16 queries): cuDNN takes the prefix in chunks, the keys past
    them (1 of 2,047 in 2 chunks; 1 of 2,045 in 4) are attended by every fused leaf program, packed (256
    leaves) or not (128): equal to the Triton-only plan and to plain attention over the same cache."""
    from treegen.kernels.kv_quant import dequantize_reference, kv_format, quantize_reference

    if not library_available("cuda", torch.bfloat16):
        pytest.skip("no cuDNN fused attention on this GPU")
    rng = random.Random(prefix)
    torch.manual_seed(prefix)
    parent = [-1] + [0] * leaves
    length = [prefix] + [rng.randint(1, 70) for _ in range(leaves)]
    start, pos, slots = layout(parent, length, rng)
    query_segment = list(range(1, leaves + 1))
    query_pos = [pos[s] + length[s] - 1 for s in query_segment]
    heads, kv, head_dim = 32, 8, 128
    q = torch.randn(leaves, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    scales = ()
    if kv_dtype is not None:
        fmt = kv_format(kv_dtype, torch.bfloat16, "cuda")
        (k, ks), (v, vs) = quantize_reference(k, fmt), quantize_reference(v, fmt)
        scales = (ks, vs)
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=query_segment, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv,
                  dtype=torch.bfloat16)
    fast = plan_tree_attention(**common)
    lib, tail = fast.triton.library, fast.triton.leaf_tail
    assert lib is not None and fast.triton.library_by_row and tail[2] == prefix - lib.chunks * lib.chunk_len
    assert len(fast.triton.launches) == 1 and (fast.triton.launches[0].pack > 1) == (leaves == 256)
    triton_only = plan_tree_attention(**common, triton_options={"library": False})
    got = tree_attention(q, k, v, fast, head_dim**-0.5, *scales)
    torch.testing.assert_close(got, tree_attention(q, k, v, triton_only, head_dim**-0.5, *scales), atol=2e-2, rtol=2e-2)
    kf, vf = (dequantize_reference(c, s).float() for c, s in zip((k, v), scales)) if scales else (k.float(), v.float())
    want = ground_truth(q.cpu().float(), kf.cpu(), vf.cpu(), parent, start, length, pos, query_segment, query_pos,
                        head_dim**-0.5)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_sliding_window_and_soft_cap_on_random_trees(seed, dtype, kv_dtype):
    """Windows shorter and longer than segments (decode and prefill rows), soft-capped or not, on a
    plain and an 8-bit cache: the compiled kernels vs the fp32 reference (same window, same cap)."""
    from treegen.kernels.kv_quant import kv_format, quantize_reference

    rng = random.Random(500 + seed)
    torch.manual_seed(seed)
    heads, kv, head_dim = rng.choice([(8, 1, 128), (9, 3, 64), (32, 8, 128), (16, 8, 256)])
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 8),
                                 max_len=rng.choice([37, 300, 2000]))
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 40]))
    window, softcap = rng.choice([16, 100, 512, 1500]), rng.choice([None, 30.0])
    q = torch.randn(len(query_pos), heads, head_dim, device="cuda", dtype=dtype) * 2
    k = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(slots, kv, head_dim, device="cuda", dtype=dtype)
    scales = ()
    if kv_dtype is not None:
        fmt = kv_format(kv_dtype, dtype, "cuda")
        (k, ks), (v, vs) = quantize_reference(k, fmt), quantize_reference(v, fmt)
        scales = (ks, vs)
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=query_segment, query_pos=query_pos, device="cuda", num_heads=heads,
                  num_kv_heads=kv, window=window, softcap=softcap)
    fast = plan_tree_attention(**common, dtype=dtype)
    ref = plan_tree_attention(**common, backend="reference")
    assert fast.backend == "triton" and fast.triton.library is None
    got = tree_attention(q, k, v, fast, head_dim**-0.5, *scales)
    want = tree_attention_reference(q.float(), k if scales else k.float(), v if scales else v.float(), ref,
                                    head_dim**-0.5, *scales)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
