"""Runtime modes and mechanics on a tiny random GQA Llama with the SmolLM2 tokenizer (CPU)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import treegen
from treegen.runtime.engine import Engine


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    return tiny_llama


@treegen.program
def samples(s, n):
    s += "The quick brown fox jumps over the lazy dog. " * 3
    b = s.fork(n, content=[f" Variant {i}:" for i in range(n)])
    b += lambda i: treegen.gen("x", max_tokens=3 + 2 * i)
    s.join(b)


def test_chunked_prefill_gives_the_same_logits(tiny_model):
    hf, model = tiny_model
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for chunk in (16384, 7):
        run = Engine(model, None, max_prefill_tokens=chunk).start()
        root = run.tree.add_node(None, ids[:25])
        leaves = [run.tree.add_node(root, ids[25:]), run.tree.add_node(root, ids[30:])]
        outs.append(run.prefill(leaves))
        assert run.forward_passes == (1 if chunk > 40 else -(-(25 + 15 + 10) // 7))
    for leaf in outs[0]:
        torch.testing.assert_close(outs[0][leaf], outs[1][leaf], atol=1e-5, rtol=1e-5)


def test_flat_mode_matches_tree_mode_and_stores_more(tiny_model, tokenizer):
    _, model = tiny_model
    results, kv = {}, {}
    for mode in ("tree", "flat"):
        engine = Engine(model, tokenizer, attention=mode)
        root = samples.run(engine, 4)
        results[mode] = root["x"]
        tree = root.tree
        kv[mode] = sum(len(tree.tokens(n)) for n in tree.graph)
    assert results["tree"] == results["flat"]
    assert kv["flat"] > 3 * kv["tree"] / 2


def test_no_attention_mode_runs_and_differs(tiny_model, tokenizer):
    _, model = tiny_model
    wrong = samples.run(Engine(model, tokenizer, attention="none"), 2)["x"]
    right = samples.run(Engine(model, tokenizer), 2)["x"]
    assert len(wrong) == 2 and wrong != right


def test_engine_options_are_validated(tiny_model):
    _, model = tiny_model
    with pytest.raises(ValueError, match="attention must be one of tree, flat, none"):
        Engine(model, None, attention="paged")
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(model, None, max_prefill_tokens=0)


def test_head_dims_the_kernels_lack_run_the_reference_attention_and_the_engine_says_so():
    from transformers import LlamaConfig

    from treegen.runtime.model import LlamaFamilyModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=96)
    engine = Engine(LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu"), None)
    assert engine.attention_backend == "reference" and "PyTorch reference attention" in repr(engine)
    run = engine.start()
    leaf = run.tree.add_node(run.tree.add_node(None, [1, 2, 3]), [4, 5])
    assert run.prefill([leaf])[leaf].shape == (2, 64)


def test_decode_phases_shrink_as_branches_finish(tiny_model, tokenizer):
    """Branches finishing early leave the batch: later phases plan fewer rows (and tokens stay exact)."""
    _, model = tiny_model
    engine = Engine(model, tokenizer)
    root = samples.run(engine, 6)
    lengths = [st.info["x"]["tokens"] for st in root._run.states[1:]]
    assert lengths == [3, 5, 7, 9, 11, 13]
    # a phase ends once at most half its branches are live; the next plans only those
    phases = root._run.tree_run.decode_phases
    assert phases[0] == 6 and len(phases) >= 3
    assert all(later <= earlier // 2 for earlier, later in zip(phases, phases[1:]))
    # one forward per step of the longest branch: 1 prefill + 12 decode steps, each in one phase
    tree_run = root._run.tree_run
    assert tree_run.forward_passes == 13
    assert len(tree_run.phase_passes) == len(phases) and sum(tree_run.phase_passes) == 13 - tree_run.mixed_steps


@treegen.program
def two_level(s, n):
    s += "Solve each problem. " * 4
    problems = s.fork(3, content=[f" Problem {k}: {k} plus {k} is" for k in range(3)])
    samples = problems.fork(n)
    samples += treegen.gen("x", max_tokens=6, temperature=0.8)
    problems.join(samples)
    s.join(problems)


def test_workload_over_the_kv_budget_waits_for_memory_with_the_same_outputs(tiny_model, tokenizer):
    _, model = tiny_model
    whole = Engine(model, tokenizer)
    want = two_level.run(whole, 4, seed=1)
    planned = two_level.compile(4, tokenizer=tokenizer).stats(whole.kv_shape).stored_bytes
    budget = planned // 2
    grouped = Engine(model, tokenizer, kv_budget_bytes=budget)
    got = two_level.run(grouped, 4, seed=1)
    assert got["x"] == want["x"]
    assert want._run.tree_run.scheduler.memory_waits == 0
    scheduler = got._run.tree_run.scheduler
    assert scheduler.memory_waits >= 1  # branches waited for finished ones to free their KV
    assert scheduler.peak_slots * whole.kv_shape.bytes_per_token <= budget
    assert max(got._run.tree_run.decode_phases) < 12  # never all twelve branches at once


def test_kv_pool_grows_only_by_the_shortfall_reusing_freed_spans():
    from treegen.runtime.kv_store import KVStore

    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=100)
    for node in range(10):
        kv.reserve(node, 10)
        kv.segments[node].computed = 10
    for node in range(0, 10, 2):
        kv.free(node)  # five 10-slot holes inside the pool
    grown = []
    real_grow = kv._grow
    kv._grow = lambda length: (grown.append(length), real_grow(length))
    kv.ensure_free(60)  # 50 slots are free in holes and at the end: grow by the 10 missing, not by 60
    assert grown == [10]
    assert sum(n for _, n in kv.free_spans.by_start) >= 60
    for node in range(10, 16):
        kv.reserve(node, 10)
    assert len(kv.segments) == 11


def test_a_grown_pool_frees_the_old_ones_memory_whoever_holds_the_tensor():
    """Growing copies each pool and frees the old one's memory at once, even while something still holds
    the old tensor (on a GPU something did: the second copy of a 64 x 4,096 run ran out of memory), and
    the KV moved with it."""
    from treegen.runtime.kv_store import KVStore

    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=16)
    kv.reserve(0, 16).computed = 16
    kv.write(0, torch.arange(16), torch.ones(16, 1, 4), 2 * torch.ones(16, 1, 4))
    held = (kv.k, kv.v, kv.layer(0))  # a stale holder of the old pools and their views
    kv.ensure_free(64)
    assert all(t.untyped_storage().nbytes() == 0 for t in held[:2])
    k, v, _, _ = kv.layer(0)
    assert k.shape[0] >= 80 and bool((k[:16] == 1).all()) and bool((v[:16] == 2).all())


def test_over_budget_branches_that_continue_are_offloaded_or_refused_with_offload_off(tiny_model, tokenizer):
    """Branches that may continue keep their KV: over the budget, offload moves the idle ones out and the
    run gives the unlimited run's tokens; with offload off it is refused rather than waited for forever."""
    @treegen.program
    def continues(s):
        s += "Count: one two"
        b = s.fork(4)
        b += treegen.gen("x", max_tokens=8)
        for branch in b:
            branch["x"]  # read mid-program: the branches may continue, so their KV stays
        b += " and then"
        b += treegen.gen("y", max_tokens=4)
        s.join(b)

    _, model = tiny_model
    tiny_budget = Engine(model, tokenizer).kv_shape.bytes_per_token * 24
    with pytest.raises(MemoryError, match="needs .* tokens .* held by branches that continue afterwards"):
        continues.run(Engine(model, tokenizer, kv_budget_bytes=tiny_budget, offload="off"))
    got = continues.run(Engine(model, tokenizer, kv_budget_bytes=tiny_budget))
    assert (got["x"], got["y"]) == (lambda r: (r["x"], r["y"]))(continues.run(Engine(model, tokenizer)))
    assert got._run.tree_run.offload_stats["nodes_offloaded"] > 0


def test_finished_final_branches_free_their_kv_when_their_phase_ends(tiny_model, tokenizer):
    _, model = tiny_model
    engine = Engine(model, tokenizer)
    reserved = []
    engine.on_step = lambda live, done, budget: reserved.append((live, run_holder[0].tree_run.kv.bytes_reserved()))
    run_holder = []

    @treegen.program
    def uneven(s):
        run_holder.append(s._run)
        s += "Count with me: one two three"
        b = s.fork(4)
        b += lambda i: treegen.gen("x", max_tokens=[2, 2, 3, 12][i])
        s.join(b)

    uneven.run(engine)
    lives = [live for live, _ in reserved]
    assert lives[0] == 4 and lives[-1] == 0
    # once the short branches are done and their phase has ended, less KV is reserved than at the start
    assert min(b for live, b in reserved if live == 1) < reserved[0][1]


def test_kv_pool_closes_holes_instead_of_growing_and_keeps_the_written_kv():
    from treegen.runtime.kv_store import KVStore

    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=100)
    for node in range(10):
        kv.reserve(node, 10)
        seg = kv.segments[node]
        kv.k[:, seg.start : seg.start + 7] = node  # 7 of 10 slots written
        kv.v[:, seg.start : seg.start + 7] = -node
        seg.computed = 7
    for node in range(0, 10, 2):
        kv.free(node)  # five 10-slot holes: 50 slots free, none 30 long
    grown = []
    real_grow = kv._grow
    kv._grow = lambda length: (grown.append(length), real_grow(length))
    kv.reserve(10, 30)
    assert grown == [] and kv.num_slots == 100
    for node in range(1, 10, 2):
        seg = kv.segments[node]
        assert (kv.k[:, seg.start : seg.start + 7] == node).all() and (kv.v[:, seg.start : seg.start + 7] == -node).all()
    spans = sorted((seg.start, seg.start + seg.capacity) for seg in kv.segments.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two segments overlap


def test_kv_layer_views_follow_the_pool_when_it_grows():
    """KVStore.layer hands out views made once per pool: after the pool grows (copied or made anew) they
    are views of the new pool, holding what was written, and no view keeps the old pool."""
    from treegen.runtime.kv_store import KVStore

    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", initial_slots=8)
    kv.reserve(0, 4)  # nothing written: growing makes a new pool
    k0, _, _, _ = kv.layer(1)
    assert k0.data_ptr() == kv.k[1].data_ptr() and kv.layer(1)[0] is k0  # the same view again
    kv.reserve(1, 16)
    assert kv.num_slots > 8 and kv.layer(1)[0].data_ptr() == kv.k[1].data_ptr()
    kv.layer(1)[0][kv.segments[0].start : kv.segments[0].start + 4] = 5.0  # written through the view
    kv.segments[0].computed = 4
    kv.reserve(2, 64)  # written KV: the pool is copied into a larger one
    k, v, ks, vs = kv.layer(1)
    assert k.data_ptr() == kv.k[1].data_ptr() and v.data_ptr() == kv.v[1].data_ptr() and ks is None and vs is None
    start = kv.segments[0].start
    assert (k[start : start + 4] == 5.0).all() and k.shape[0] == kv.num_slots


@treegen.program
def endings(s, stop=()):
    s += "The quick brown fox jumps over the lazy dog. " * 2
    b = s.fork(5, content=[f" Variant {i}:" for i in range(5)])
    b += lambda i: treegen.gen("x", max_tokens=3 + 3 * i, ignore_eos=i == 4, stop=stop)
    s.join(b)


def test_blocks_of_several_tokens_end_branches_where_single_tokens_do(tiny_model, tokenizer, monkeypatch):
    """The host takes a branch's tokens every few steps on a GPU (``sync_every``): a branch ends at its
    EOS or ``max_tokens`` inside a block exactly as when it takes them one at a time (the CPU's way),
    whether it takes a block at once (no stop strings) or token by token (a stop string that never
    matches sends it through the general loop)."""
    from treegen.runtime.decode import Decoder

    def generated(root):
        return [(st.gen_tokens("x"), st.info["x"]["finish_reason"]) for st in root._run.states[1:]]

    _, model = tiny_model
    one = generated(endings.run(Engine(model, tokenizer)))
    eos = one[3][0][6]  # drawn mid-block (the first token comes from the prefill step): as EOS it ends
    # the branches that reach it (not the ignore_eos one)
    monkeypatch.setattr(model, "eos_token_ids", model.eos_token_ids | {eos})
    runs = {}
    init = Decoder.__init__
    for every, stop in ((1, ()), (4, ()), (4, ("never in this text",))):
        def with_blocks(self, run, every=every):
            init(self, run)
            self.sync_every = every
        monkeypatch.setattr(Decoder, "__init__", with_blocks)
        runs[every, stop] = generated(endings.run(Engine(model, tokenizer), stop))
    assert runs[4, ()] == runs[1, ()] == runs[4, ("never in this text",)]
    runs[1] = runs[1, ()]
    assert [len(t) for t, _ in runs[1]][4] == 15 and ("eos" in [r for _, r in runs[1]])
