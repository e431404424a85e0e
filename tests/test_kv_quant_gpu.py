"""GPU tests of 8-bit KV (CUDA only, TRITON_INTERPRET=0): the compiled tree-attention kernels over an INT8 /
FP8 cache against the 8-bit PyTorch reference, the fused RoPE kernel's quantizing cache write against the
reference rule, and a model of real shape run end to end against plain attention on the same weights."""

import random

import pytest
import torch

from test_kv_quant import QuantizedPackedCache
from test_runtime_gpu import real_shape
from test_tree_attention import layout, make_queries, random_tree
from treegen.kernels.fused_ops import rope_, rope_reference
from treegen.kernels.kv_quant import dequantize, dequantize_reference, kv_format, quantize_reference
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention, tree_attention_reference
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.sampler import SamplingParams

pytestmark = pytest.mark.gpu
FORMATS = ["int8", "fp8"]


def cache(slots, kv, head_dim, name):
    fmt = kv_format(name, torch.bfloat16, "cuda")
    out = []
    for _ in range(2):
        out += quantize_reference(torch.randn(slots, kv, head_dim, device="cuda", dtype=torch.bfloat16), fmt)
    k8, ks, v8, vs = out
    return k8, v8, ks, vs


def check(parent, length, start, pos, query_segment, query_pos, heads, kv, head_dim, name, tol=2e-2):
    slots = max(s + n for s, n in zip(start, length))
    q = torch.randn(len(query_pos), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k8, v8, ks, vs = cache(slots, kv, head_dim, name)
    common = dict(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                  query_segment=query_segment, query_pos=query_pos, device="cuda", num_heads=heads, num_kv_heads=kv)
    ref = plan_tree_attention(**common, backend="reference")
    want = tree_attention_reference(q.float(), k8, v8, ref, head_dim**-0.5, ks, vs)
    # as the runtime plans (a large shared segment dequantized for cuDNN on Hopper), and all by Triton
    for fast in (plan_tree_attention(**common, dtype=torch.bfloat16), plan_tree_attention(**common, dtype=None)):
        assert fast.backend == "triton"
        got = tree_attention(q, k8, v8, fast, head_dim**-0.5, ks, vs)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("batch,prefix,suffix", [(64, 1024, 32), (256, 4096, 256), (1024, 1024, 32), (3, 16384, 1)])
@pytest.mark.parametrize("heads,kv,head_dim", [(8, 1, 128), (32, 8, 128), (9, 3, 64)])
def test_paper_grid_shapes_over_an_8bit_cache(name, batch, prefix, suffix, heads, kv, head_dim):
    torch.manual_seed(0)
    check([-1] + [0] * batch, [prefix] + [suffix] * batch, [0] + [prefix + i * suffix for i in range(batch)],
          [0] + [prefix] * batch, list(range(1, batch + 1)), [prefix + suffix - 1] * batch, heads, kv, head_dim, name)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", FORMATS)
def test_random_unbalanced_trees_over_an_8bit_cache(seed, name):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv, head_dim = rng.choice([(8, 1, 128), (9, 3, 64), (32, 8, 128), (4, 4, 64)])
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 8),
                                 max_len=rng.choice([17, 37, 300, 2000]))
    start, pos, _ = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 40]))
    check(parent, length, start, pos, query_segment, query_pos, heads, kv, head_dim, name)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("heads,kv,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_fused_rope_quantizes_into_the_cache_like_the_reference(name, heads, kv, head_dim):
    torch.manual_seed(1)
    fmt = kv_format(name, torch.bfloat16, "cuda")
    t, slots_total = 37, 100
    qkv = torch.randn(t, heads + 2 * kv, head_dim, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(t, head_dim, device="cuda")
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    slots = torch.randperm(slots_total, device="cuda")[:t]
    k8 = torch.zeros(slots_total, kv, head_dim, device="cuda", dtype=fmt.storage)
    v8, ks, vs = torch.zeros_like(k8), torch.zeros(slots_total, kv, device="cuda"), torch.zeros(slots_total, kv, device="cuda")
    rotated = rope_(qkv.clone(), cos, sin, heads, kv)  # the kernel's own rotated keys (what it quantizes)
    torch.testing.assert_close(rotated[:, heads:heads + kv], rope_reference(qkv[:, heads:heads + kv], cos[:, None],
                                                                            sin[:, None]), atol=2e-2, rtol=2e-2)
    k_ref = rotated[:, heads:heads + kv]
    v_ref = qkv[:, heads + kv:].clone()
    rope_(qkv, cos, sin, heads, kv, store=(k8, v8, slots, ks, vs))
    for stored, scale, x in ((k8, ks, k_ref), (v8, vs, v_ref)):
        want_q, want_s = quantize_reference(x, fmt)
        torch.testing.assert_close(scale[slots], want_s, atol=0, rtol=1e-6)
        # the same 8-bit value, or (a quotient rounded the other way at a tie) the neighbouring one
        got, want = dequantize_reference(stored[slots], scale[slots]), dequantize_reference(want_q, want_s)
        if name == "int8":  # one step of amax / 127
            step = want_s.unsqueeze(-1).expand_as(want)
        else:  # one e4m3 step: an eighth of the value, or a subnormal step (2^-9 of the scale)
            step = torch.maximum(want.abs() / 8, want_s.unsqueeze(-1) * 2.0**-9)
        assert ((got - want).abs() <= step * 1.0001).all()
        assert ((got - want).abs() > 0).float().mean() < 0.01


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_kernel_equals_the_reference(name):
    k8, _, ks, _ = cache(1000, 8, 128, name)
    torch.testing.assert_close(dequantize(k8, ks, torch.bfloat16), dequantize_reference(k8, ks).bfloat16(), atol=0, rtol=0)


@pytest.mark.parametrize("name", FORMATS)
def test_real_shape_with_8bit_kv_matches_plain_attention_and_decodes_with_graphs(name):
    """Llama-3-8B dimensions (2 layers), bf16: forced-token logits of a tree with a shared prefix equal the
    plain-attention reference storing the same 8-bit KV; CUDA-graph decode equals eager decode."""
    _, model = real_shape(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 128256, (n,), generator=g).tolist()  # noqa: E731
    prompt, suffixes = rand(300), [rand(k) for k in (1, 20, 37, 5)]
    run = Engine(model, IdTokenizer(), kv_dtype=name).start()
    assert run.kv.k.dtype == kv_format(name, torch.bfloat16, "cuda").storage
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root, s) for s in suffixes]
    got = run.prefill(leaves)
    fmt = kv_format(name, torch.bfloat16, "cuda")
    for leaf, s in zip(leaves, suffixes):
        ids = torch.tensor(prompt + s, device="cuda")
        ref = QuantizedPackedCache(model, fmt)
        want = ref.forward(torch.zeros(len(ids), dtype=torch.long, device="cuda"), ids,
                           torch.arange(len(ids), device="cuda"))[300:]
        torch.testing.assert_close(got[leaf], want, atol=1.5e-1, rtol=1.5e-1)
    outputs = {}
    for graphs in (False, True):
        run = Engine(model, IdTokenizer(), cuda_graphs=graphs, kv_dtype=name).start()
        root = run.tree.add_node(None, prompt)
        gens = [GenRequest(run.tree.add_node(root), SamplingParams(max_tokens=6 + i % 3, temperature=0.8 if i % 2 else 0.0,
                                                                   ignore_eos=True), key=i) for i in range(8)]
        results, _ = run.execute(gens, [])
        outputs[graphs] = [r.tokens for r in results]
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("name", FORMATS)
def test_phase_copy_of_the_library_segment_gives_the_per_call_tokens(name, monkeypatch):
    """Llama-3-8B dimensions (2 layers), bf16, an 8-bit cache: 160 branches (640 rows x heads) below a 1,100-key
    prompt give it to cuDNN; the decode phases (CUDA graphs) read each layer's copy made once a phase
    (``TreeRun.library_copies``) and draw the tokens of phases that dequantize the segment every call."""
    from treegen.kernels.library_attention import library_available
    from treegen.runtime.tree_run import TreeRun

    if not library_available("cuda", torch.bfloat16):
        pytest.skip("cuDNN fused attention is not available here")
    _, model = real_shape(torch.bfloat16)
    prompt = torch.randint(0, 128256, (1100,), generator=torch.Generator().manual_seed(2)).tolist()
    copies, made = TreeRun.library_copies, []

    def spy(self, plan, written=()):
        made.append(copies(self, plan, written))
        return made[-1]

    outputs = {}
    for with_copies in (True, False):
        monkeypatch.setattr(TreeRun, "library_copies", spy if with_copies else lambda self, plan, written=(): {})
        run = Engine(model, IdTokenizer(), kv_dtype=name).start()
        root = run.tree.add_node(None, prompt)
        gens = [GenRequest(run.tree.add_node(root), SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0.0,
                                                                   ignore_eos=True), key=i) for i in range(160)]
        results, _ = run.execute(gens, [])
        outputs[with_copies] = [r.tokens for r in results]
        assert run.decoder.captured_phases > 0
    assert made and all(set(m) == {0, 1} for m in made)  # every phase: both layers' copies
    assert outputs[True] == outputs[False]
