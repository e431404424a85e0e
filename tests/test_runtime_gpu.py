"""GPU runtime tests (CUDA only): a random model of real shape (Llama-3-8B dimensions, 2 layers).

Run on the device machine with TRITON_INTERPRET=0; skipped elsewhere.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.sampler import SamplingParams

pytestmark = pytest.mark.gpu  # skipped without CUDA and compiled kernels (tests/conftest.py)
# logits of a random model are O(1) (up to ~8 here); tolerances by dtype (fp32 kernels use IEEE fp32
# products). bf16: a few ulps of the largest logits (ulp 0.03 at 4..8) — our fused QKV and gate/up
# products round differently from HF's separate ones (measured 0.08 max vs HF, 0.055 unfused; argmax equal)
TOL = {torch.float32: 2e-3, torch.bfloat16: 1.2e-1}


def real_shape(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return hf, LlamaFamilyModel.from_hf(hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_tokens_tree_matches_flat_and_hf(dtype):
    hf, model = real_shape(dtype)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 128256, (n,), generator=g).tolist()  # noqa: E731
    prompt, suffixes = rand(300), [rand(k) for k in (1, 20, 37, 5)]
    forced = [rand(3) for _ in suffixes]
    logits = {}
    for layout in ("tree", "flat"):
        run = Engine(model, IdTokenizer()).start()
        tree = run.tree
        if layout == "tree":
            root = tree.add_node(None, prompt)
            leaves = [tree.add_node(root, s) for s in suffixes]
        else:
            leaves = [tree.add_node(None, prompt + s) for s in suffixes]
        first = run.prefill(leaves)
        got = {i: [first[leaf][-1:]] for i, leaf in enumerate(leaves)}
        for step in range(3):  # decode-shaped passes: one forced token per leaf
            for i, leaf in enumerate(leaves):
                tree.extend(leaf, [forced[i][step]])
            out = run.prefill(leaves)
            for i, leaf in enumerate(leaves):
                got[i].append(out[leaf])
        logits[layout] = {i: torch.cat(v).float() for i, v in got.items()}
    for i, s in enumerate(suffixes):
        ids = prompt + s + forced[i]
        with torch.no_grad():
            want = hf(torch.tensor([ids], device="cuda")).logits[0, -4:].float()
        torch.testing.assert_close(logits["tree"][i], want, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(logits["tree"][i], logits["flat"][i], atol=TOL[dtype], rtol=TOL[dtype])


def test_cuda_graph_decode_equals_eager_decode():
    _, model = real_shape(torch.bfloat16)
    prompt = torch.randint(0, 128256, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    outputs = {}
    for graphs in (False, True):
        run = Engine(model, IdTokenizer(), cuda_graphs=graphs).start()
        root = run.tree.add_node(None, prompt)
        leaves = [run.tree.add_node(root) for _ in range(16)]
        gens = [GenRequest(leaf, SamplingParams(max_tokens=5 + 3 * (i % 4), temperature=0.8 if i % 2 else 0.0,
                                                top_p=0.9, ignore_eos=True), key=i) for i, leaf in enumerate(leaves)]
        results, _ = run.execute(gens, [])
        outputs[graphs] = [r.tokens for r in results]
        assert [len(t) for t in outputs[graphs]] == [5 + 3 * (i % 4) for i in range(16)]
    assert outputs[True] == outputs[False]


def test_workload_larger_than_gpu_memory_runs_in_groups_with_the_same_outputs():
    """Branches whose KV together is ~1.3x the GPU's whole memory: the run admits as many as fit and
    the rest as finished ones free their KV (no OOM half way), and every branch's greedy tokens equal
    those of smaller runs that fit at once. fp32 (IEEE kernels) so batch composition cannot flip a
    greedy choice."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=8192)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cuda")
    engine = Engine(model, IdTokenizer())
    prompt_len, new = 2048, 4
    per_branch = (prompt_len + new) * engine.kv_shape.bytes_per_token
    total_memory = torch.cuda.get_device_properties(0).total_memory
    branches = int(1.3 * total_memory / per_branch) + 1
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 1000, (32,), generator=g).tolist()
    prompts = [torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for _ in range(branches)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    def generate(indices):
        run = engine.start()
        root = run.tree.add_node(None, shared)
        leaves = [run.tree.add_node(root, prompts[i]) for i in indices]
        results, _ = run.execute([GenRequest(leaf, params, key=i, final=True) for i, leaf in zip(indices, leaves)], [])
        waits, widest = run.scheduler.memory_waits, max(run.decode_phases)
        del run
        torch.cuda.empty_cache()
        return [r.tokens for r in results], waits, widest

    grouped, waits, widest = generate(range(branches))
    assert branches * per_branch > total_memory
    assert waits >= 1 and widest < branches
    size = widest // 2  # pieces small enough to fit in one go
    alone = []
    for begin in range(0, branches, size):
        tokens, piece_waits, _ = generate(range(begin, min(branches, begin + size)))
        assert piece_waits == 0
        alone += tokens
    assert grouped == alone


def _small_fp32_engine(seed: int):
    """A random 3-layer GQA Llama in fp32 on the GPU (IEEE kernels: batch composition cannot flip a greedy
    choice), token ids as text; a random generator seeded with ``seed``, and ``ids(n)``: n random ids from it,
    as text."""
    import random

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=8192)
    engine = Engine(LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cuda"), IdTokenizer())
    rng = random.Random(seed)
    return engine, rng, lambda n: " " + " ".join(str(rng.randrange(1, 1000)) for _ in range(n))


def _rounds_program(prefix: str, ignore_eos: bool):
    """A program that grows as it runs: the prefix and its question, then per round fork -> gen (each branch its
    length) -> join -> a follow-up built from the first answer."""
    import treegen

    @treegen.program
    def rounds(s, question, lengths):
        s += prefix + question
        for width in lengths:
            b = s.fork(len(width))
            b += lambda i: treegen.gen("a", max_tokens=width[i], ignore_eos=ignore_eos)
            s.join(b)
            s += " " + s["a"][0].split()[-1]
        return s["a"]

    return rounds


@pytest.mark.parametrize("ends_on_device", [False, True])
def test_continuous_batch_with_mixed_steps_equals_each_program_alone(ends_on_device, monkeypatch):
    """Programs that grow as they run, on the GPU with CUDA graphs: new work is prefilled in the same
    forward passes as the live branches' decode rows, phases are replanned as work joins and leaves,
    and every program's greedy tokens equal those of the program run alone (fp32: IEEE kernels, so
    batch composition cannot flip a greedy choice). ``ends_on_device``: EOS may end a branch, so phases
    watch the device's count of rows still generating and end early, with programs resuming between.
    A round's fork after one appended token joins a decode phase at its first step (captured, or in kept
    graphs): the same tokens as with mixed steps for those rounds too."""
    engine, rng, ids = _small_fp32_engine(seed=0)
    grows = _rounds_program(ids(300), ignore_eos=not ends_on_device)

    inputs = [{"question": ids(rng.randint(1, 40)),
               "lengths": [[rng.randint(1, 60) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 3))]}
              for _ in range(24 + 40 * ends_on_device)]
    roots = grows.run_batch(engine, inputs)
    run = roots[0]._run.tree_run
    assert run.mixed_steps >= 1 and run.phase_joins > 3 and len(run.decode_phases) > 3
    if ends_on_device:
        assert run.decoder.early_ends >= 1, run.decoder.early_ends
    for x, root in zip(inputs, roots):
        assert root.ret_value == grows.run(engine, **x).ret_value
    monkeypatch.setenv("TREEGEN_JOIN_PHASES", "0")
    mixed = grows.run_batch(engine, inputs)
    assert mixed[0]._run.tree_run.mixed_steps > 3 and mixed[0]._run.tree_run.phase_joins == 0
    assert [r.ret_value for r in mixed] == [r.ret_value for r in roots]


def test_mixed_steps_replayed_from_kept_graphs_give_each_program_alone(monkeypatch):
    """With kept mixed-step graphs (on by default, :mod:`treegen.runtime.mixed_graphs`): programs of equal
    shape, entering two at a time (``max_batch``: 6 branches), make mixed steps that replay an earlier one's
    graph, with padding rows writing their KV to a slot nothing reads — every program's greedy tokens are
    those of the program alone (fp32)."""
    monkeypatch.setenv("TREEGEN_KEEP_MIXED_GRAPHS", "1")
    engine, rng, ids = _small_fp32_engine(seed=1)
    engine.max_batch = 6
    rounds = _rounds_program(ids(200), ignore_eos=True)

    inputs = [{"question": ids(12), "lengths": [[24, 40, 16]] * 3} for _ in range(16)] + \
             [{"question": ids(rng.randint(1, 30)), "lengths": [[rng.randint(1, 50) for _ in range(3)]] * 2}
              for _ in range(8)]
    roots = rounds.run_batch(engine, inputs)
    run = roots[0]._run.tree_run
    captured, replayed = run.mixed_kept - run.mixed_reused, run.mixed_reused
    assert captured >= 1 and replayed >= 1, (captured, replayed, run.mixed_steps)
    for x, root in zip(inputs, roots):
        assert root.ret_value == rounds.run(engine, **x).ret_value


def test_inputs_arriving_while_others_decode_reuse_the_prefix_kv_with_the_tokens_of_each_alone(monkeypatch):
    """Inputs drawn from an iterator while the batch runs (:mod:`treegen.lang.arrivals`), on the GPU with CUDA
    graphs: later programs' prompts are attached below the live tree's prefix — a node holding KV split in
    two while phases decode below it — and every program's greedy tokens equal those of the program run
    alone (fp32)."""
    import time

    import treegen
    from treegen.runtime.kv_store import KVStore

    engine, rng, ids = _small_fp32_engine(seed=1)
    prefix = ids(400)

    @treegen.program
    def samples(s, question, lengths):
        s += prefix + question
        b = s.fork(len(lengths))
        b += lambda i: treegen.gen("a", max_tokens=lengths[i], ignore_eos=True)
        s.join(b)
        return s["a"]

    inputs = [{"question": ids(rng.randint(1, 30)), "lengths": [rng.randint(20, 200) for _ in range(rng.randint(2, 5))]}
              for _ in range(16)]
    splits = []
    split = KVStore.split

    def spy(kv, node, head, length):
        splits.append(kv.computed(node) >= length)
        split(kv, node, head, length)

    def trickle():
        for k, x in enumerate(inputs):
            yield x
            time.sleep(0.5 if k == 0 else 0.05)  # (the first program's prefix has KV when the second comes)

    alone = [samples.run(engine, **x).ret_value for x in inputs]  # (kernels compiled before the batch)
    monkeypatch.setattr(KVStore, "split", spy)
    roots = samples.run_batch(engine, trickle())
    assert any(splits), splits  # a node with the prefix's KV was split for a later program
    run = roots[0]._run
    assert run.pass_report["attached_tokens"] >= 10 * 400
    assert [root.ret_value for root in roots] == alone


def test_random_ops_work_after_a_capture_that_failed():
    """A capture that raises part way (here: a host read inside it) must not leave the default CUDA
    generator in capture mode; random ops after it run (the generic path probes capture this way)."""
    from treegen.runtime.cuda_graph import capture

    x = torch.ones(4, device="cuda")
    with pytest.raises(Exception):
        capture(lambda: (x * 2).sum().item())
    torch.cuda.synchronize()
    torch.manual_seed(3)
    a = torch.randn(8, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn(8, device="cuda"))


def test_a_cold_capture_records_without_running_and_replays():
    """``capture_cold``: the graph is recorded without running ``fn`` (its effect appears at the first
    replay), and a function that cannot be captured still raises (through the warm-up fallback)."""
    from treegen.runtime.cuda_graph import capture_cold

    x = torch.ones(4, device="cuda")
    graph, ran = capture_cold(lambda: x.mul_(3))
    torch.cuda.synchronize()
    assert not ran and x.tolist() == [1.0] * 4
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [9.0] * 4
    with pytest.raises(Exception):
        capture_cold(lambda: (x * 2).sum().item())


def test_later_phases_are_captured_without_a_warm_up_and_give_the_same_tokens():
    """After an engine's first captured phase, decode phases are captured without their eager warm-up
    step (``capture_cold``): none falls back, and sampled and greedy tokens equal an eager engine's."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=8192)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cuda")
    prompt = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    outputs = {}
    for graphs in (False, True):
        engine = Engine(model, IdTokenizer(), cuda_graphs=graphs)
        outputs[graphs] = []
        for _ in range(2):  # the second run's phases are captured cold
            run = engine.start()
            root = run.tree.add_node(None, prompt)
            leaves = [run.tree.add_node(root) for _ in range(12)]
            gens = [GenRequest(leaf, SamplingParams(max_tokens=20 + 7 * (i % 5), temperature=0.8 if i % 2 else 0.0,
                                                    ignore_eos=True), key=i) for i, leaf in enumerate(leaves)]
            results, _ = run.execute(gens, [])
            outputs[graphs].append([r.tokens for r in results])
            if graphs:
                assert run.decoder.cold_fallbacks == 0
        if graphs:
            assert engine.phases_captured >= 2
    assert outputs[True] == outputs[False]


def test_kept_phase_graphs_are_replayed_by_later_phases_with_the_same_tokens():
    """Decode phases of equal padded shape replay the CUDA graphs an earlier phase captured (in padded,
    kept buffers: treegen.runtime.phase_graphs), and every branch's tokens equal an eager engine's and
    those of an engine that captures every phase anew."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=8192)
    model = LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1000, (100,), generator=g).tolist()
    outputs, kept = {}, {}
    for mode in ("eager", "anew", "kept"):
        run = Engine(model, IdTokenizer(), cuda_graphs=mode != "eager").start()
        if mode == "anew":
            run.decoder.kept = None
        tree, tokens = run.tree, []
        nodes = [tree.add_node(tree.add_node(None, prompt), [7 + i]) for i in range(12)]
        for round_ in range(3):  # each round forks every branch again: phases of the same padded shape recur
            gens = [GenRequest(n, SamplingParams(max_tokens=12 + 5 * (i % 4), temperature=0.8 if i % 2 else 0.0,
                                                 ignore_eos=True), key=100 * round_ + i) for i, n in enumerate(nodes)]
            results, _ = run.execute(gens, [])
            tokens.append([r.tokens for r in results])
            nodes = [tree.add_node(n, [3]) for n in nodes]
        outputs[mode] = tokens
        kept[mode] = run.decoder.kept_phases
    assert outputs["kept"] == outputs["eager"] == outputs["anew"]
    assert kept["anew"] == 0 and kept["kept"] >= 1, kept


def test_a_written_kv_pool_grows_within_what_ensure_free_checks():
    """Growing a pool that holds KV copies it: the memory held on top of the old pool peaks at the new
    slots plus one old pool (k or v): what the check counts (the largest pool's copy), so a pool of half
    the free memory can still grow."""
    from treegen.runtime.kv_store import KVStore

    kv = KVStore(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    kv.reserve(0, 4096).computed = 4096  # (written KV: growing copies it)
    k = torch.randn(4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(4096, device="cuda")
    for layer in range(4):
        kv.write(layer, slots, k, -k)
    old_slots, per = kv.num_slots, kv.bytes_per_token
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kv.ensure_free(kv.slots_free() + 8192)
    added = kv.num_slots - old_slots
    assert added >= 8192
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= added * per + old_slots * per // 2 + 2**20, (peak, added * per, old_slots * per)
    k_cache, v_cache, _, _ = kv.layer(3)
    assert torch.equal(k_cache[:4096], k) and torch.equal(v_cache[:4096], -k)  # the KV moved with the pool
    assert not k_cache[old_slots:].any()  # and the new slots hold zeros
