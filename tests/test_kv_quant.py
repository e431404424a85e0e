"""8-bit KV (INT8 and FP8 e4m3, a scale per token and KV head) on the CPU: the quantization rule, tree
attention over an 8-bit cache (PyTorch reference and the Triton kernels in the interpreter) against plain
attention over the dequantized cache, and whole runs against a plain-attention model on the same weights."""

import random

import pytest
import torch

import treegen
from test_end_to_end import gen_records
from test_model import PackedCache
from test_runtime import two_level
from test_tree_attention import ground_truth, library_below_the_root_tree, layout, make_queries, random_tree
from treegen.kernels.kv_quant import dequantize_reference, kv_format, quantize_reference
from treegen.kernels.tree_attention import plan_tree_attention, tree_attention
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.kv_store import KVStore
from treegen.runtime.loader import load_tokenizer
from treegen.runtime.sampler import SamplingParams

FORMATS = ["int8", "fp8"]


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_round_trip_is_within_half_a_step(name):
    fmt = kv_format(name, torch.float32)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero head: scale 0, reads back zeros
    stored, scale = quantize_reference(x, fmt)
    assert stored.dtype == fmt.storage and scale.shape == (50, 3) and scale.dtype == torch.float32
    back = dequantize_reference(stored, scale)
    assert (back[7, 1] == 0).all() and scale[7, 1] == 0
    amax = x.abs().amax(-1, keepdim=True)
    if name == "int8":  # uniform steps of amax / 127: error at most half a step
        assert ((back - x).abs() <= scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    else:  # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 above the subnormals (2^-6 * scale)
        tol = torch.maximum(x.abs() / 16, 2.0**-10 * scale.unsqueeze(-1))
        assert ((back - x).abs() <= tol * (1 + 1e-5)).all()
    assert (back.abs().amax(-1, keepdim=True) - amax).abs().max() <= 1e-5 * amax.max()  # the largest value is exact


def test_kv_format_names_the_choices_and_the_sizes():
    with pytest.raises(ValueError, match=r"kv_dtype must be one of None, 'int8', 'fp8'.*got 'int4'"):
        kv_format("int4", torch.bfloat16)
    plain = kv_format(None, torch.bfloat16)
    assert not plain.quantized and plain.storage == torch.bfloat16 and plain.name == "bfloat16"
    assert kv_format("fp8", torch.bfloat16).storage == torch.float8_e4m3fn
    # Llama-3-8B shape: 32 layers x 8 KV heads x 128: bf16 131072 bytes a token, 8-bit 67584 (0.52 of it)
    sizes = {}
    for name in (None, "int8"):
        kv = KVStore(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cpu",
                     initial_slots=1, fmt=kv_format(name, torch.bfloat16))
        sizes[name] = kv.bytes_per_token
    assert sizes == {None: 131072, "int8": 67584}


def test_fp8_on_a_gpu_without_fp8_names_its_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100-SXM4-80GB has 8.0: use kv_dtype='int8'"):
        kv_format("fp8", torch.bfloat16, "cuda")
    assert kv_format("int8", torch.bfloat16, "cuda").storage == torch.int8


def kv_quantized(slots, num_kv, head_dim, name):
    fmt = kv_format(name, torch.float32)
    k8, ks = quantize_reference(torch.randn(slots, num_kv, head_dim), fmt)
    v8, vs = quantize_reference(torch.randn(slots, num_kv, head_dim), fmt)
    return k8, v8, ks, vs


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("backend,dtype", [("reference", torch.float32), ("triton", torch.float32),
                                           ("triton", torch.float16), ("triton", torch.bfloat16)])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(8, 1, 128), (9, 3, 64), (4, 4, 64)])
def test_tree_attention_over_an_8bit_cache_matches_plain_attention_over_its_values(seed, name, backend, dtype,
                                                                                   num_heads, num_kv, head_dim):
    """Random unbalanced trees, decode and prefill rows; the kernels dequantize in registers. (bf16 queries
    over FP8 run fp16 products; over INT8 bf16 ones, which the Triton interpreter computes wrongly.)"""
    if dtype == torch.bfloat16 and name == "int8":
        pytest.skip("INT8 under bf16 queries takes bf16 tl.dot, wrong in the Triton interpreter (GPU tests cover it)")
    rng = random.Random(200 + seed)
    torch.manual_seed(seed)
    parent, length = random_tree(rng, max_depth=rng.randint(1, 4), max_fanout=rng.randint(1, 4),
                                 max_len=rng.choice([17, 37, 150]))
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=rng.choice([0, 5]))
    q = torch.randn(len(query_pos), num_heads, head_dim).to(dtype)
    k8, v8, ks, vs = kv_quantized(slots, num_kv, head_dim, name)
    plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=query_segment, query_pos=query_pos, backend=backend,
                               num_heads=num_heads, num_kv_heads=num_kv, dtype=k8.dtype,
                               triton_options={"fuse_merge": seed % 2 == 0} if backend == "triton" else None)
    got = tree_attention(q, k8, v8, plan, head_dim**-0.5, ks, vs)
    want = ground_truth(q.float(), dequantize_reference(k8, ks), dequantize_reference(v8, vs), parent, start, length,
                        pos, query_segment, query_pos, head_dim**-0.5)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}[dtype]  # (bf16: its output rounding)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_bf16_queries_over_an_fp8_cache_beyond_fp16_range():
    """bf16 queries over an FP8 cache run the kernels' products in fp16 (``FP8_PRODUCTS``): queries
    beyond fp16's range (|q| > 65504) are scaled by a power of two, not overflowed."""
    name = "fp8"
    rng = random.Random(7)
    torch.manual_seed(7)
    parent, length = random_tree(rng, max_depth=3, max_fanout=3, max_len=40)
    start, pos, slots = layout(parent, length, rng)
    query_segment, query_pos = make_queries(parent, length, pos, rng, prefill_rows=3)
    k8, v8, ks, vs = kv_quantized(slots, 2, 64, name)
    ks, vs = ks * 1e-4, vs  # scores of order |q| * 1e-4 * 8 (a soft, not one-hot, softmax)
    plan = plan_tree_attention(segment_parent=parent, segment_start=start, segment_len=length, segment_pos=pos,
                               query_segment=query_segment, query_pos=query_pos, backend="triton",
                               num_heads=4, num_kv_heads=2, dtype=k8.dtype)
    for size in (1.0, 2e5):  # within fp16's range, and beyond it
        q = (torch.randn(len(query_pos), 4, 64) * size).to(torch.bfloat16)
        got = tree_attention(q, k8, v8, plan, 64**-0.5, ks, vs)
        want = ground_truth(q.float(), dequantize_reference(k8, ks), dequantize_reference(v8, vs), parent, start,
                            length, pos, query_segment, query_pos, 64**-0.5)
        assert got.isfinite().all()
        torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


def assert_8bit_plan_matches(tree, plan, name):
    """The plan's attention over an 8-bit cache of random values equals plain attention over its dequantized values."""
    q = torch.randn(len(tree.leaves), 8, 64)
    k8, v8, ks, vs = kv_quantized(tree.slots, 1, 64, name)
    got = tree_attention(q, k8, v8, plan, 0.125, ks, vs)
    want = ground_truth(q, dequantize_reference(k8, ks), dequantize_reference(v8, vs), tree.parent, tree.start,
                        tree.length, tree.pos, tree.leaves, tree.query_pos, 0.125)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.usefixtures("short_library_chunks")
def test_library_segment_of_an_8bit_cache_is_dequantized_for_it(name, fuse):
    """The large shared middle node goes to the library kernel (its PyTorch reference on the CPU), which
    reads the 8-bit cache's keys dequantized; merged with the Triton partials as usual."""
    tree = library_below_the_root_tree()
    plan = tree.plan(8, 1, library=True, fuse_merge=fuse)
    assert plan.triton.library is not None
    assert_8bit_plan_matches(tree, plan, name)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.usefixtures("short_library_chunks")
def test_library_tail_of_an_8bit_cache_is_attended_by_the_fused_leaves(name):
    """A 1,537-key root under 64 branches: three library chunks read by row, and the one key past them
    attended by each fused leaf's program from the 8-bit cache (its scale applied like any other key)."""
    from test_tree_attention import DecodeTree

    rng = random.Random(8)
    tree = DecodeTree([-1] + [0] * 64, [1537] + [rng.randint(1, 9) for _ in range(64)], list(range(1, 65)), rng)
    plan = tree.plan(8, 1, library=True)
    assert plan.triton.library_by_row and plan.triton.leaf_tail[2] == 1 and len(plan.triton.launches) == 1
    assert_8bit_plan_matches(tree, plan, name)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.usefixtures("short_library_chunks")
def test_library_copy_is_read_instead_of_the_cache(name, fuse):
    """A decode phase dequantizes its library segment once (``library_copy``) and passes it to every call:
    the result equals the per-call dequantization's, and the cache's own bytes of the segment are not read
    (overwriting them after the copy changes nothing) while the other segments' are."""
    from treegen.kernels.tree_attention import library_copy, library_copy_bytes

    tree = library_below_the_root_tree()
    plan = tree.plan(8, 1, library=True, fuse_merge=fuse)
    lib = plan.triton.library
    q = torch.randn(len(tree.leaves), 8, 64)
    k8, v8, ks, vs = kv_quantized(tree.slots, 1, 64, name)
    per_call = tree_attention(q, k8, v8, plan, 0.125, ks, vs)
    copy = library_copy(plan, k8, v8, ks, vs, q.dtype)
    assert copy[0].shape == (lib.chunks * lib.chunk_len, 1, 64) and copy[0].dtype == q.dtype
    assert library_copy_bytes(plan, k8, q.dtype) == 2 * copy[0].numel() * 4
    keys = slice(lib.start, lib.start + lib.chunks * lib.chunk_len)
    ks_changed = ks.clone()
    ks_changed[keys] *= 3.0  # the segment's keys scaled in the cache: the copy is what is read
    torch.testing.assert_close(tree_attention(q, k8, v8, plan, 0.125, ks_changed, vs, library_kv=copy), per_call,
                               atol=1e-6, rtol=1e-6)
    assert not torch.allclose(tree_attention(q, k8, v8, plan, 0.125, ks_changed, vs), per_call, atol=1e-3)
    assert library_copy(plan, k8.float(), v8.float(), None, None, q.dtype) is None  # (the cache holds the values)
    with pytest.raises(ValueError, match="library_kv must be two"):
        tree_attention(q, k8, v8, plan, 0.125, ks, vs, library_kv=(copy[0][1:], copy[1][1:]))
    plain = tree.plan(8, 1)
    assert library_copy(plain, k8, v8, ks, vs, q.dtype) is None and library_copy_bytes(plain, k8, q.dtype) == 0
    with pytest.raises(ValueError, match="library_kv is for a plan with a library segment"):
        tree_attention(q, k8, v8, plain, 0.125, ks, vs, library_kv=copy)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_kernel_rounds_like_the_reference(name):
    """The CUDA path's one-launch dequantization (run by the interpreter here): 300 rows, a partial block."""
    import triton

    from treegen.kernels.kv_quant import _dequantize_kernel

    stored, scale = quantize_reference(torch.randn(100, 3, 64), kv_format(name, torch.float32))
    out = torch.empty(stored.shape, dtype=torch.float16)
    _dequantize_kernel[(triton.cdiv(300, 64),)](stored, scale, out, 300, HEAD_DIM=64, BLOCK_R=64)
    assert torch.equal(out, dequantize_reference(stored, scale).half())


def test_8bit_cache_inputs_are_checked():
    k8, v8, ks, vs = kv_quantized(10, 2, 64, "int8")
    plan = plan_tree_attention(segment_parent=[-1], segment_start=[0], segment_len=[10], segment_pos=[0],
                               query_segment=[0], query_pos=[9])
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="an 8-bit cache needs k_scale and v_scale"):
        tree_attention(q, k8, v8, plan, 0.1)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        tree_attention(q, k8, v8, plan, 0.1, ks, None)
    with pytest.raises(ValueError, match=r"v_scale must be fp32 \[num_slots, num_kv_heads\]"):
        tree_attention(q, k8, v8, plan, 0.1, ks, vs[:5])
    with pytest.raises(ValueError, match="k_scale/v_scale are for an 8-bit cache"):
        tree_attention(q, k8.float(), v8.float(), plan, 0.1, ks, vs)


class QuantizedPackedCache(PackedCache):
    """The plain-attention reference model, its keys/values stored through the 8-bit rule."""

    def __init__(self, model, fmt):
        super().__init__(model)
        self.fmt = fmt

    def attend(self, layer, q, k, v):
        k, v = (dequantize_reference(*quantize_reference(x, self.fmt)).to(x.dtype) for x in (k, v))
        return super().attend(layer, q, k, v)


@pytest.mark.parametrize("name", FORMATS)
def test_engine_with_8bit_kv_matches_plain_attention_on_the_same_weights(tiny_llama, name):
    """A shared prefix and three children, prefilled in chunks (later chunks read the earlier ones from the
    8-bit cache): every child's logits equal the reference model's with the same 8-bit KV."""
    _, model = tiny_llama
    ids = torch.randint(0, 49152, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    run = Engine(model, None, kv_dtype=name, max_prefill_tokens=16).start()
    assert run.kv.k.dtype == kv_format(name, torch.float32).storage
    root = run.tree.add_node(None, ids[:30])
    leaves = [run.tree.add_node(root, ids[30 + 10 * i: 40 + 10 * i]) for i in range(3)]
    logits = run.prefill(leaves)
    for i, leaf in enumerate(leaves):
        seq = torch.tensor(ids[:30] + ids[30 + 10 * i: 40 + 10 * i])
        ref = QuantizedPackedCache(model, kv_format(name, torch.float32))
        want = ref.forward(torch.zeros(len(seq), dtype=torch.long), seq, torch.arange(len(seq)))
        torch.testing.assert_close(logits[leaf], want[30:], atol=1e-4, rtol=1e-4)
    plain = Engine(model, None).start()
    root = plain.tree.add_node(None, ids[:30])
    other = plain.prefill([plain.tree.add_node(root, ids[30:40])])
    assert not torch.allclose(next(iter(other.values())), logits[leaves[0]], atol=1e-4)  # 8 bits do change them


@treegen.program
def samples(s):
    s += "The quick brown fox jumps over the lazy dog. " * 3
    b = s.fork(4, content=[f" Variant {i}:" for i in range(4)])
    b += lambda i: treegen.gen("x", max_tokens=4 + 2 * i)
    s.join(b)


@pytest.mark.parametrize("name", FORMATS)
def test_greedy_program_with_8bit_kv_equals_the_reference_decode(tiny_llama, name):
    """Greedy decoding of every branch (tree engine: shared prefix, decode phases, 8-bit KV) equals
    step-by-step decoding of that branch's ids by the plain-attention reference storing the same 8-bit KV."""
    _, model = tiny_llama
    root = samples.run(Engine(model, load_tokenizer(), kv_dtype=name))
    records = gen_records(root)
    assert len(records) == 4
    fmt = kv_format(name, torch.float32)
    for prompt, generated, info, st in records:
        ref = QuantizedPackedCache(model, fmt)
        logits = ref.forward(torch.zeros(len(prompt), dtype=torch.long), torch.tensor(prompt),
                             torch.arange(len(prompt)), torch.tensor([len(prompt) - 1]))
        want = []
        while len(want) < info["max_tokens"]:
            want.append(int(logits[-1].argmax()))
            if want[-1] in model.eos_token_ids:
                break
            logits = ref.forward(torch.zeros(1, dtype=torch.long), torch.tensor(want[-1:]),
                                 torch.tensor([len(prompt) + len(want) - 1]))
        assert generated == want, f"branch {st.path}: {generated} vs the reference's {want}"


def test_decode_phase_dequantizes_its_library_segment_once(model64, tokenizer, monkeypatch):
    """A decode phase whose plan gives the shared prompt to the library kernel (forced here: its reference
    on the CPU, thresholds lowered for a 40-token prompt) over an INT8 cache makes each layer's copy
    once (``TreeRun.library_copies``) and passes it to every step: the tokens and log-probabilities equal
    those of phases that dequantize per call."""
    from treegen.kernels import tree_attention as planning
    from treegen.kernels import triton_plan
    from treegen.runtime.tree_run import TreeRun

    monkeypatch.setattr(planning, "library_available", lambda device, dtype: True)
    for name, value in (("_LIBRARY_MIN_ROWS", 4), ("_LIBRARY_MIN_KEYS", 16), ("_LIBRARY_MIN_CHUNK_8BIT", 8)):
        monkeypatch.setattr(triton_plan, name, value)
    made = []
    copies = TreeRun.library_copies

    def spy(self, plan, written=()):
        made.append(copies(self, plan, written))
        return made[-1]

    def run(with_copies: bool):
        monkeypatch.setattr(TreeRun, "library_copies", spy if with_copies else lambda self, plan, written=(): {})
        engine = Engine(model64, tokenizer, kv_dtype="int8")
        engine.attention_backend = "triton"
        tree_run = engine.start()
        root = tree_run.tree.add_node(None, torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3)).tolist())
        leaves = [tree_run.tree.add_node(root, [100 + i]) for i in range(6)]
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        results, _ = tree_run.execute([GenRequest(n, params, key=i) for i, n in enumerate(leaves)], [])
        return results

    with_copies, per_call = run(True), run(False)
    assert made and all(set(m) == {0, 1} for m in made), made  # both layers' copies, every phase
    assert made[0][0][0].shape == (40, 1, 64) and made[0][0][0].dtype == torch.float32  # 5 chunks of 8 keys
    assert [r.tokens for r in with_copies] == [r.tokens for r in per_call]
    for a, b in zip(with_copies, per_call):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_engine_refuses_an_unknown_kv_dtype(tiny_llama):
    _, model = tiny_llama
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        Engine(model, None, kv_dtype="e5m2")


def test_a_kv_budget_holds_about_twice_the_branches_with_8bit_kv(tiny_llama):
    """Under the same byte budget (half of what the workload stores with the model's fp32 KV), the model-dtype
    run waits for memory while the 8-bit run keeps all twelve branches live at once; neither exceeds it."""
    _, model = tiny_llama
    tok = load_tokenizer()
    program = two_level
    plain = Engine(model, tok)
    budget = program.compile(4, tokenizer=tok).stats(plain.kv_shape).stored_bytes // 2
    runs = {name: program.run(Engine(model, tok, kv_budget_bytes=budget, kv_dtype=name), 4, seed=1)
            for name in (None, "int8")}
    # fp32 KV of this model (2 layers x 2 KV heads x 16 dims): 512 bytes a token; int8: 2 x 2 x 2 x (16 + 4) = 160
    assert plain.kv_shape.bytes_per_token == 512 and Engine(model, tok, kv_dtype="int8").kv_shape.bytes_per_token == 160
    peak = {}
    for name, root in runs.items():
        scheduler = root._run.tree_run.scheduler
        per_token = root._run.tree_run.kv.bytes_per_token
        assert scheduler.peak_slots * per_token <= budget
        peak[name] = max(root._run.tree_run.decode_phases)
    assert runs[None]._run.tree_run.scheduler.memory_waits >= 1
    assert runs["int8"]._run.tree_run.scheduler.memory_waits == 0 and peak["int8"] == 12 > peak[None]


def test_rope_store_into_an_8bit_cache_is_checked():
    """The fused RoPE cache write into an 8-bit cache without its scales (or with mismatched ones) would
    store the keys/values truncated to int8/e4m3 with no scale: refused, naming what is wrong."""
    from treegen.kernels.fused_ops import rope_

    heads, kv, d = 4, 2, 64
    qkv = torch.randn(3, heads + 2 * kv, d)
    cos, sin = torch.ones(3, d), torch.zeros(3, d)
    slots = torch.tensor([0, 2, 4])
    k8 = torch.zeros(8, kv, d, dtype=torch.int8)
    ks = torch.zeros(8, kv)
    with pytest.raises(ValueError, match=r"\(8-bit\) cache needs its scales"):
        rope_(qkv, cos, sin, heads, kv, store=(k8, torch.zeros_like(k8), slots))
    with pytest.raises(ValueError, match="v_cache"):
        rope_(qkv, cos, sin, heads, kv, store=(k8, torch.zeros(8, kv, d, dtype=torch.float8_e4m3fn), slots, ks,
                                               torch.zeros_like(ks)))
    with pytest.raises(ValueError, match="fp32 scales"):
        rope_(qkv, cos, sin, heads, kv, store=(k8, torch.zeros_like(k8), slots, ks, torch.zeros_like(ks).half()))
    with pytest.raises(ValueError, match="fp32 scales"):
        rope_(qkv, cos, sin, heads, kv, store=(k8, torch.zeros_like(k8), slots, ks, torch.zeros(4, kv)))


@pytest.mark.parametrize("name", FORMATS)
def test_kv_store_moves_compacts_and_grows_the_scales_with_the_values(name):
    """A segment moved to grow, the pool compacted, the pool grown: every written token still reads back its
    own keys/values (the scales travel with the 8-bit values; the engine tests never move a written segment)."""
    fmt = kv_format(name, torch.float32)
    kv = KVStore(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", initial_slots=16,
                 fmt=fmt)
    torch.manual_seed(0)
    want = {}

    def write(node, n):
        seg = kv.reserve(node, n)
        k, v = torch.randn(2, n, 2, 16) * torch.logspace(-2, 1, n)[:, None, None]  # a scale per token
        for layer in range(2):
            kv.write(layer, torch.arange(seg.start, seg.start + n), k * (layer + 1), v * (layer + 1))
        seg.computed = n
        want[node] = [dequantize_reference(*quantize_reference(x * (layer + 1), fmt)) for layer in range(2)
                      for x in (k, v)]

    def check():
        for node, values in want.items():
            seg = kv.segments[node]
            rows = slice(seg.start, seg.start + seg.computed)
            got = [dequantize_reference(cache[layer, rows], scales[layer, rows]) for layer in range(2)
                   for cache, scales in ((kv.k, kv.k_scale), (kv.v, kv.v_scale))]
            for g, w in zip(got, values):
                assert torch.equal(g, w), f"node {node} at {seg}"

    write(1, 4)
    write(2, 5)
    write(3, 3)
    start = kv.segments[1].start
    kv.reserve(1, 9)  # no room after it: moves
    assert kv.segments[1].start != start
    check()
    kv.free(2)
    del want[2]
    kv.reserve(4, kv.slots_free() - 1)  # enough room, but in pieces: compacts
    assert kv.compactions == 1
    check()
    slots = kv.num_slots
    kv.reserve(5, 40)  # grows the written pool
    assert kv.num_slots > slots and kv.k_scale.shape[1] == kv.num_slots
    check()


@pytest.mark.parametrize("heads,kv", [(9, 3), (4, 4), (6, 1)])
def test_fused_rope_quantizes_into_an_int8_cache_on_the_cpu(heads, kv):
    """The fused RoPE kernel's INT8 cache write (under the interpreter): each token's rotated keys and its
    values at its slot, quantized by the reference rule, scales at [slot, KV head]; other slots untouched.
    (FP8 is left to the GPU test: the Triton interpreter's fp32 -> e4m3 cast rounds some values wrongly,
    e.g. 124 -> 64.)"""
    from treegen.kernels.fused_ops import rope_

    torch.manual_seed(2)
    fmt = kv_format("int8", torch.float32)
    t, d, total = 7, 64, 20
    qkv = torch.randn(t, heads + 2 * kv, d) * torch.logspace(-2, 1, heads + 2 * kv)[None, :, None]
    ang = torch.rand(t, d)
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(total)[:t]
    k8, v8 = torch.zeros(total, kv, d, dtype=torch.int8), torch.zeros(total, kv, d, dtype=torch.int8)
    ks, vs = torch.zeros(total, kv), torch.zeros(total, kv)
    keys = rope_(qkv.clone(), cos, sin, heads, kv)[:, heads:heads + kv]  # the kernel's own rotated keys
    values = qkv[:, heads + kv:].clone()
    rope_(qkv, cos, sin, heads, kv, store=(k8, v8, slots, ks, vs))
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[slots] = False
    for stored, scale, x in ((k8, ks, keys), (v8, vs, values)):
        want_q, want_s = quantize_reference(x, fmt)
        torch.testing.assert_close(scale[slots], want_s, atol=0, rtol=1e-6)
        assert (stored[slots].int() - want_q.int()).abs().max() <= 1  # a tie may round the other way
        assert (stored[slots] != want_q).float().mean() < 0.01
        assert not stored[untouched].any() and not scale[untouched].any()


def test_gens_joining_a_phase_see_the_key_they_write_into_a_library_segment(monkeypatch):
    """Forks right after a gen join a decode phase, one row writing the gen's last token's KV into the node they
    share — a library segment (the kernel's PyTorch reference on the CPU, its thresholds scaled to this tree) whose
    8-bit KV a phase dequantizes once: a layer whose library range takes a write at the first step reads the cache
    rather than a copy made before it (which would hold the slot's old bytes): the tokens of mixed steps."""
    import random as _random

    from transformers import LlamaConfig

    from treegen.kernels import tree_attention as tree_attention_module, triton_plan
    from treegen.runtime.loader import IdTokenizer
    from treegen.runtime.model import LlamaFamilyModel
    from treegen.runtime.tree_run import TreeRun

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu", std=1.0)
    monkeypatch.setattr(tree_attention_module, "library_available", lambda device, dtype: True)
    monkeypatch.setattr(triton_plan, "_LIBRARY_MIN_ROWS", 4)
    monkeypatch.setattr(triton_plan, "_LIBRARY_MIN_KEYS", 16)
    copies, library_copies = [], TreeRun.library_copies

    def counted(self, plan, written=()):
        made = library_copies(self, plan, written)
        copies.append((len(made), len(written)))
        return made

    monkeypatch.setattr(TreeRun, "library_copies", counted)
    prefix = " " + " ".join(str(_random.Random(7).randrange(1, 300)) for _ in range(40))

    @treegen.program
    def expands(s, width):
        s += prefix
        s += treegen.gen("t", max_tokens=3, ignore_eos=True)
        b = s.fork(width)
        b += lambda i: treegen.gen("a", max_tokens=4 + i % 3, temperature=1.0, ignore_eos=True)
        s.join(b)
        return s["a"]

    got = {}
    for join in (True, False):
        monkeypatch.setenv("TREEGEN_JOIN_PHASES", "1" if join else "0")
        engine = Engine(model, IdTokenizer(), kv_dtype="int8")
        engine.attention_backend = "triton"
        copies.clear()
        root = expands.run(engine, width=8, seed=3)
        logprobs = [st.info["a"]["logprob"] for st in root._run.states if "logprob" in st.info.get("a", {})]
        got[join] = root.ret_value, logprobs, root._run.tree_run.phase_joins, list(copies)
    assert got[True][0] == got[False][0] and got[True][1] == pytest.approx(got[False][1], abs=1e-5)
    assert got[True][2] == 8 and got[False][2] == 0
    joined, mixed = got[True][3], got[False][3]  # per phase: (layers copied, slots the first step writes into ancestors)
    assert any(w for _, w in joined) and all(c == 0 for c, w in joined if w)  # (the joined phase read the cache)
    assert max(c for c, _ in mixed) == 2  # (phases that write no ancestor copy every layer's library)
