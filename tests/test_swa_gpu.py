"""Sparse window attention on the GPU (CUDA only): the Triton kernels over compacted segments, decode
phases captured as CUDA graphs with the query ring buffer inside, against plain masked attention over
each branch's whole sequence (hiding exactly what the compactions dropped) and brute-force ALISA choices.

Run on the device machine with TRITON_INTERPRET=0; skipped elsewhere.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from test_swa import _alisa_brute_per_head, _masked_reference_logits, _own_weights_brute, _visible  # noqa: E402
from treegen.runtime import swa
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)
VOCAB = 4096
# log-probabilities of a random model: fp32 kernels vs the fp32 plain reference; bf16 rounds the
# activations (the reference runs the same bf16 model, so only attention's order of sums differs)
TOL = {torch.float32: 2e-3, torch.bfloat16: 0.15}


def llama3_heads(dtype, layers=2):
    """Llama-3-8B's attention shape (32 query / 8 KV heads of 128), narrow otherwise."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=VOCAB, rope_theta=500000.0, max_position_embeddings=8192)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return LlamaFamilyModel.from_hf(hf)


def run_swa(model, keep, *, graphs=True, kv_dtype=None, every=16, history=8, branches=6, max_tokens=120):
    engine = Engine(model, IdTokenizer(), cuda_graphs=graphs, kv_dtype=kv_dtype, kv_keep_every=every,
                    kv_keep_history=history)
    run = engine.start()
    run.swa_log = {}
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    root = run.tree.add_node(None, rand(700))
    mid = run.tree.add_node(root, rand(40))
    leaves = [run.tree.add_node(mid if i % 2 else root, rand(3 + 11 * i)) for i in range(branches)]
    reqs = [GenRequest(leaf, SamplingParams(max_tokens=max_tokens - 9 * i, ignore_eos=True,
                                            kv_keep=keep if i < branches - 1 else None), key=i)
            for i, leaf in enumerate(leaves)]
    results, _ = run.execute(reqs, [])
    return run, (root, mid), leaves, results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swa_triton_with_graphs_equals_plain_attention_over_the_kept_tokens(dtype):
    model = llama3_heads(dtype)
    run, shared, leaves, results = run_swa(model, 0.3)
    assert run.engine.attention_backend == "auto" and run.decoder.captured_phases > 0
    assert run.decoder.kept_phases > 0  # (phases replay kept graphs, the query recorder inside)
    assert run.swa_compactions >= 10 and run.swa_dropped > 0
    for node in shared:
        assert run.kv.dropped(node) == 0
    for leaf, result in zip(leaves, results):
        tokens, visible = _visible(run, leaf, run.swa_log)
        logits = _masked_reference_logits(run.model, tokens, visible)
        rows = torch.arange(len(tokens) - len(result.tokens) - 1, len(tokens) - 1, device="cuda")
        want = logits[rows].log_softmax(-1).gather(1, torch.tensor(result.tokens, device="cuda")[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, device="cuda"), want, atol=TOL[dtype], rtol=0)
    # CUDA graphs change nothing: the same tokens and compactions without them
    plain, _, _, again = run_swa(model, 0.3, graphs=False)
    assert [r.tokens for r in again] == [r.tokens for r in results] and plain.swa_log == run.swa_log


def test_swa_importance_and_choice_on_the_gpu(monkeypatch):
    model = llama3_heads(torch.float32)
    expected, runs = [], []
    original = swa.own_attention

    def checked(kv, tree, m, nodes, queries, positions, chunk=32, per_head=False):
        assert per_head
        got = original(kv, tree, m, nodes, queries, positions, chunk, per_head)
        want = _own_weights_brute(runs[-1], nodes, queries, positions, per_head=True)
        for n, g_, w_ in zip(nodes, got, want):
            torch.testing.assert_close(g_.cpu(), w_.cpu(), atol=1e-3, rtol=1e-3)
            seg = kv.segments[n]
            expected.append(_alisa_brute_per_head(g_, seg.computed, seg.tokens, 0.3))
        return got

    monkeypatch.setattr(swa, "own_attention", checked)
    real_start = Engine.start

    def start(self):
        runs.append(real_start(self))
        keep_fn = runs[-1].kv.keep_many

        def keep_many(kept):
            for rows in kept.values():
                assert rows.tolist() == expected.pop(0)
            keep_fn(kept)

        runs[-1].kv.keep_many = keep_many
        return runs[-1]

    monkeypatch.setattr(Engine, "start", start)
    run, _, _, _ = run_swa(model, 0.3, branches=3, max_tokens=64)
    assert not expected and run.swa_compactions > 0


def test_swa_int8_cache_and_reserves_less():
    model = llama3_heads(torch.bfloat16)
    run, _, leaves, results = run_swa(model, 0.3, kv_dtype="int8")
    assert run.kv.format.quantized
    assert all(r.kv_dropped > 0 for r in results[:-1])
    for leaf in leaves[:-1]:  # not final: still held, compacted
        seg = run.kv.segments[leaf]
        assert seg.computed <= swa.kept_count(0.3, seg.tokens) + run.engine.kv_keep_every + swa.MIXED_STEPS
    dense, _, _, _ = run_swa(model, None)
    assert run.scheduler.peak_slots < dense.scheduler.peak_slots


@pytest.mark.parametrize("quant", [False, True])
def test_importance_kernel_bf16_equals_the_reference(quant):
    """The importance kernel in bf16 (and over INT8 keys) against its fp32-maths reference, Llama-3-8B's
    heads (32 query / 8 KV of 128), 8 recorded steps, a few hundred own keys per branch."""
    from treegen.kernels.own_importance import own_importance, own_importance_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    layers, branches, steps, kv_heads, slots = 3, 6, 8, 8, 4096
    q = torch.randn(layers, branches, steps, 32, 128, generator=g, device="cuda").bfloat16()
    if quant:
        k = torch.randint(-127, 128, (layers, slots, kv_heads, 128), generator=g, device="cuda", dtype=torch.int8)
        k_scale = torch.rand(layers, slots, kv_heads, generator=g, device="cuda") * 0.02 + 0.001
    else:
        k, k_scale = torch.randn(layers, slots, kv_heads, 128, generator=g, device="cuda").bfloat16(), None
    anc = torch.randn(layers, branches, steps, 32, generator=g, device="cuda") + 6
    written = torch.tensor([300, 17, 640, 1, 222, 513], device="cuda")
    start = torch.tensor([0, 700, 900, 1600, 1700, 2000], device="cuda")
    seg_pos = torch.full((branches,), 2048, device="cuda")
    qpos = seg_pos[:, None] + written[:, None] - steps + torch.arange(steps, device="cuda")
    want = own_importance_reference(q, k, k_scale, anc, start, written, qpos, seg_pos, 128**-0.5)
    got = own_importance(q, k, k_scale, anc, start, written, qpos, seg_pos, 128**-0.5, width=640)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-3)
