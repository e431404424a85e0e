"""Sparse window attention (ALISA SWA, :mod:`treegen.runtime.swa`) on a tiny random GQA Llama (CPU).

The ground truth is unfused: every branch's whole token sequence run through the same model with plain
masked softmax attention, where a query sees a key iff it is causal and not dropped by a compaction
made before that query ran (from the run's ``swa_log``); the importance that chose the dropped tokens
is checked against a brute-force softmax over each row's concatenated root-to-leaf keys.
"""

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import treegen
from treegen.lang.tg import TgError, loads
from treegen.runtime import swa
from treegen.runtime.engine import Engine
from treegen.runtime.requests import GenRequest, Job
from treegen.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama[1]


def _ids(n, seed):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, True, "0.3", float("nan")])
def test_kv_keep_outside_0_1_is_refused_naming_the_value_and_where(model, tokenizer, bad):
    with pytest.raises(ValueError, match=rf"kv_keep must be a number in \(0, 1\].*got {bad!r}"):
        SamplingParams(kv_keep=bad)
    with pytest.raises(ValueError, match=r"gen\('x'\): kv_keep must be a number in \(0, 1\]"):
        treegen.gen("x", kv_keep=bad)
    with pytest.raises(ValueError, match=r"Engine\(kv_keep=\.\.\.\) must be a number in \(0, 1\]"):
        Engine(model, tokenizer, kv_keep=bad)
    if not isinstance(bad, (bool, str)) and not math.isnan(bad):
        with pytest.raises(TgError, match=r"gen x: kv_keep must be a number in \(0, 1\]") as e:
            loads(f'"Q:"\ngen x(max_tokens=4, kv_keep={bad})\n')
        assert e.value.line == 2


def test_swa_periods_are_validated(model, tokenizer):
    with pytest.raises(ValueError, match=r"Engine\(kv_keep_every=\.\.\.\) must be an integer >= 1, got 0"):
        Engine(model, tokenizer, kv_keep_every=0)
    with pytest.raises(ValueError, match=r"Engine\(kv_keep_history=\.\.\.\) must be an integer >= 1"):
        Engine(model, tokenizer, kv_keep_history=1.5)


def test_sliding_window_models_refuse_swa_by_name(model, tokenizer):
    windowed = copy.copy(model)
    windowed.layer_window = [6, None]
    with pytest.raises(ValueError, match=r"Engine\(kv_keep=\.\.\.\): sparse window attention is not supported "
                                         r"on a model with sliding-window layers \(windows \[6\]\)"):
        Engine(windowed, tokenizer, kv_keep=0.3)
    run = Engine(windowed, tokenizer).start()
    leaf = run.tree.add_node(run.tree.add_node(None, _ids(8, 0)), _ids(3, 1))
    with pytest.raises(ValueError, match=rf"gen into node {leaf} with kv_keep=0.5: sparse window attention is not "
                                         "supported on a model with sliding-window layers"):
        run.submit(GenRequest(leaf, SamplingParams(max_tokens=4, kv_keep=0.5), key=0))


def test_a_window_as_long_as_the_context_does_not_refuse_swa(tiny_llama, tokenizer):
    """A sliding window at least as long as the model's longest context never masks a key (Phi-4-mini:
    262,144 against 131,072 positions): the model has none (``model.effective_window``), so sparse window
    attention runs, and gives what the same weights give without a window; one position shorter is a window."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from treegen.runtime.model import LlamaFamilyModel

    hf = tiny_llama[0]

    def mistral(window):  # the tiny Llama's weights under a Mistral config with this sliding window
        cfg = MistralConfig(**{k: getattr(hf.config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                    "num_hidden_layers", "num_attention_heads",
                                                                    "num_key_value_heads", "max_position_embeddings")},
                            sliding_window=window, head_dim=16)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        model.load_state_dict(hf.state_dict())
        return LlamaFamilyModel.from_hf(model)

    longest = hf.config.max_position_embeddings
    windowed, plain = mistral(longest), mistral(None)
    assert windowed.layer_window == [None, None]
    outs = []
    for m in (plain, windowed):
        run = Engine(m, tokenizer, kv_keep=0.5).start()
        leaf = run.tree.add_node(run.tree.add_node(None, _ids(8, 0)), _ids(3, 1))
        results, _ = run.execute([GenRequest(leaf, SamplingParams(max_tokens=6, ignore_eos=True), key=0)], [])
        outs.append(results[0].tokens)
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match=r"sliding-window layers \(windows \[%d\]\)" % (longest - 1)):
        Engine(mistral(longest - 1), tokenizer, kv_keep=0.3)


# --- selection -----------------------------------------------------------------------------------------
def _alisa_brute(importance: list[float], written: int, tokens: int, keep: float) -> list[int]:
    m = min(tokens, max(1, math.ceil(keep * tokens - 1e-9)))
    if m >= written:
        return list(range(written))
    local = (m + 1) // 2
    earlier = sorted(range(written - local), key=lambda s: (-importance[s], s))[: m - local]
    return sorted(earlier + list(range(written - local, written)))


@pytest.mark.parametrize("written,tokens,keep", [(6, 10, 0.4), (40, 40, 0.3), (37, 101, 0.1), (5, 5, 1.0),
                                                 (9, 30, 0.3), (3, 3, 0.01)])
def test_alisa_select_is_algorithm_1(written, tokens, keep):
    g = torch.Generator().manual_seed(written * 7 + tokens)
    importance = torch.rand(written, generator=g)
    importance[::3] = importance[0]  # ties go to the earlier token
    got = swa.alisa_select(importance, written, tokens, keep).tolist()
    assert got == _alisa_brute(importance.tolist(), written, tokens, keep)
    assert swa.alisa_select(torch.tensor([5.0, 1, 9, 2, 0, 3]), 6, 10, 0.4).tolist() == [0, 2, 4, 5]  # the doc's


def test_alisa_select_chooses_per_row_of_a_batch():
    """Importance ``[layers, kv_heads, written]`` (per_head): each row chooses as it would alone."""
    g = torch.Generator().manual_seed(3)
    importance = torch.rand(3, 2, 30, generator=g)
    got = swa.alisa_select(importance, 30, 45, 0.3)
    assert got.shape == (3, 2, swa.kept_count(0.3, 45) if swa.kept_count(0.3, 45) < 30 else 30)
    for layer in range(3):
        for head in range(2):
            assert got[layer, head].tolist() == swa.alisa_select(importance[layer, head], 30, 45, 0.3).tolist()
    assert swa.alisa_select(importance, 30, 30, 1.0).tolist() == [[list(range(30))] * 2] * 3


def test_reservations_shrink_with_kv_keep():
    assert swa.reserve_slots(10, 1000, None, 32) == 1010
    assert swa.reserve_slots(10, 1000, 0.3, 32) == math.ceil(0.3 * 1010) + 32 + swa.MIXED_STEPS + 1
    assert swa.reserve_slots(500, 100, 0.3, 32) == 500 + 32 + swa.MIXED_STEPS + 1  # its prompt is written densely first
    assert swa.reserve_slots(500, 30, 0.3, 32) == 530  # never more than dense
    assert swa.reserve_slots(10, 20, 1.0, 32) == 30


# --- the weights that rank the tokens ---------------------------------------------------------------------
def _path_keys(run, node, layer):
    """(keys [K, Hkv, D] fp32, mask positions [K]) of node's ancestors, then its own written keys."""
    kv, keys, pos = run.kv, [], []
    for s in run.tree.path(node):
        seg = kv.segments[s]
        keys.append(kv.k[layer, seg.start: seg.start + seg.computed].float())
        base = run.tree.position(s) + seg.dropped
        pos += list(range(base, base + seg.computed))
    return torch.cat(keys), torch.tensor(pos)


def _own_weights_brute(run, nodes, queries, positions, per_head=False):
    """The attention weight of each node's own written keys, summed over layers, heads and steps, from a
    plain softmax over each row's concatenated root-to-leaf keys (ancestors, and own keys up to its position).
    ``per_head``: summed over steps and each KV head's group of query heads only, ``[layers, kv_heads, own]``."""
    model, out = run.model, []
    group = model.num_heads // model.num_kv_heads
    for n, q, ps in zip(nodes, queries, positions):
        own = run.kv.segments[n].computed
        total = torch.zeros(model.num_layers, model.num_kv_heads, own, device=run.kv.k.device)
        for layer in range(model.num_layers):
            keys, kpos = _path_keys(run, n, layer)
            kpos = kpos.to(keys.device)
            keys = keys.repeat_interleave(group, dim=1)  # [K, H, D]
            for t, p in enumerate(ps):
                s = torch.einsum("hd,khd->hk", q[layer, t].float(), keys) * model.attn_scale
                s[:, kpos > p] = float("-inf")
                total[layer] += s.softmax(-1)[:, -own:].view(model.num_kv_heads, group, own).sum(1)
        out.append(total if per_head else total.sum(dim=(0, 1)))
    return out


def _alisa_brute_per_head(weights, written, tokens, keep):
    """:func:`_alisa_brute` of every layer's and KV head's row of ``weights [layers, kv_heads, written]``."""
    return [[_alisa_brute(row, written, tokens, keep) for row in layer] for layer in weights.tolist()]


@pytest.mark.parametrize("one_layer_a_call", [False, True])
def test_own_attention_is_the_softmax_over_the_whole_path_after_a_compaction(model, tokenizer, monkeypatch,
                                                                             one_layer_a_call):
    if one_layer_a_call:  # (by default the tiny model's layers all go in one call)
        monkeypatch.setattr(swa, "SCORE_ELEMENTS", 1)
    run = Engine(model, tokenizer).start()
    tree = run.tree
    root = tree.add_node(None, _ids(20, 0))
    a, b = tree.add_node(root, _ids(15, 1)), tree.add_node(root, _ids(9, 2))
    run.prefill([a, b])
    run.kv.keep(a, torch.tensor([1, 4, 5, 12, 13, 14]))  # drops 9 of a's 15
    tree.extend(a, _ids(3, 3))
    run.prefill([a])  # written after the compaction: slots 6..8, mask positions just before the queries
    assert (run.kv.segments[a].computed, run.kv.dropped(a), run.kv.computed(a)) == (9, 9, 18)
    g = torch.Generator().manual_seed(4)
    queries = [torch.randn(model.num_layers, 3, model.num_heads, model.head_dim, generator=g) for _ in (a, b)]
    positions = [[tree.position(a) + i for i in (15, 16, 17)], [tree.position(b) + i for i in (6, 7, 8)]]
    got = swa.own_attention(run.kv, tree, model, [a, b], queries, positions, chunk=1)
    want = _own_weights_brute(run, [a, b], queries, positions)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-5)
    # the last step's own keys: a's third new key is visible only to the last query
    assert got[0].shape == (9,) and got[1].shape == (9,)
    per_head = swa.own_attention(run.kv, tree, model, [a, b], queries, positions, per_head=True)
    for g_, w_ in zip(per_head, _own_weights_brute(run, [a, b], queries, positions, per_head=True)):
        torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-5)


def test_own_attention_of_a_node_without_a_parent_beside_ones_with_one(model, tokenizer):
    """A sequence of its own (no shared prompt: its own keys are all it sees) weighed in one call with
    branches below a prompt, and alone."""
    run = Engine(model, tokenizer).start()
    tree = run.tree
    root = tree.add_node(None, _ids(12, 0))
    a, lone = tree.add_node(root, _ids(10, 1)), tree.add_node(None, _ids(14, 2))
    run.prefill([a, lone])
    g = torch.Generator().manual_seed(6)
    queries = [torch.randn(model.num_layers, 2, model.num_heads, model.head_dim, generator=g) for _ in (a, lone)]
    positions = [[tree.position(a) + i for i in (8, 9)], [tree.position(lone) + i for i in (12, 13)]]
    for nodes, qs, ps in (([a, lone], queries, positions), ([lone], queries[1:], positions[1:])):
        got = swa.own_attention(run.kv, tree, model, nodes, qs, ps, per_head=True)
        for g_, w_ in zip(got, _own_weights_brute(run, nodes, qs, ps, per_head=True)):
            torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-5)


def test_own_attention_per_head_sums_to_the_shared_importance(model, tokenizer):
    """``per_head``: each layer's and KV head's weights, which summed over both are the shared importance."""
    run = Engine(model, tokenizer).start()
    tree = run.tree
    root = tree.add_node(None, _ids(20, 0))
    a = tree.add_node(root, _ids(15, 1))
    run.prefill([a])
    g = torch.Generator().manual_seed(5)
    queries = [torch.randn(model.num_layers, 3, model.num_heads, model.head_dim, generator=g)]
    positions = [[tree.position(a) + i for i in (12, 13, 14)]]
    shared = swa.own_attention(run.kv, tree, model, [a], queries, positions)[0]
    per = swa.own_attention(run.kv, tree, model, [a], queries, positions, per_head=True)[0]
    assert per.shape == (model.num_layers, model.num_kv_heads, 15)
    torch.testing.assert_close(per.sum(dim=(0, 1)), shared, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(per[0, 0], per[-1, -1])  # (layers and heads weigh the tokens differently)


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_keep_per_layer_and_head_moves_each_ones_own_slots(model, tokenizer, kv_dtype):
    run = Engine(model, tokenizer, kv_dtype=kv_dtype).start()
    root = run.tree.add_node(None, _ids(5, 0))
    leaf = run.tree.add_node(root, _ids(12, 1))
    run.prefill([leaf])
    kv, seg = run.kv, run.kv.segments[leaf]
    g = torch.Generator().manual_seed(6)
    kept = torch.stack([torch.stack([torch.randperm(12, generator=g)[:5].sort().values for _ in range(kv.num_kv_heads)])
                        for _ in range(kv.num_layers)])  # [layers, kv_heads, 5]
    before = {name: getattr(kv, name)[:, seg.start: seg.start + 12].clone() for name in kv._pools()}
    kv.keep(leaf, kept)
    for name in kv._pools():
        after = getattr(kv, name)[:, seg.start: seg.start + 5]
        for layer in range(kv.num_layers):
            for head in range(kv.num_kv_heads):
                want = before[name][layer, kept[layer, head], head]
                assert torch.equal(after[layer, :, head].view(torch.uint8) if want.element_size() == 1
                                   else after[layer, :, head], want.view(torch.uint8) if want.element_size() == 1 else want)
    assert (seg.computed, seg.dropped) == (5, 7)
    with pytest.raises(ValueError, match="kept must be"):
        kv.keep(leaf, kept[:1])


def test_keep_moves_the_kept_kv_to_the_front_in_every_layer(model, tokenizer):
    run = Engine(model, tokenizer, kv_dtype="int8").start()
    root = run.tree.add_node(None, _ids(5, 0))
    leaf = run.tree.add_node(root, _ids(12, 1))
    run.prefill([leaf])
    kv, seg = run.kv, run.kv.segments[leaf]
    kept = [0, 3, 7, 10, 11]
    before = {name: getattr(kv, name)[:, seg.start: seg.start + 12].clone() for name in kv._pools()}
    root_before = {name: getattr(kv, name)[:, kv.segments[root].start: kv.segments[root].start + 5].clone()
                   for name in kv._pools()}
    kv.keep(leaf, torch.tensor(kept))
    for name in kv._pools():
        torch.testing.assert_close(getattr(kv, name)[:, seg.start: seg.start + 5], before[name][:, kept])
        start = kv.segments[root].start
        torch.testing.assert_close(getattr(kv, name)[:, start: start + 5], root_before[name])
    assert (seg.computed, seg.dropped, seg.tokens, kv.computed(leaf)) == (5, 7, 12, 12)


# --- decoding ----------------------------------------------------------------------------------------------
def _masked_reference_logits(model, tokens, visible):
    """Logits of the whole sequence with plain softmax attention under ``visible [layers, kv_heads, T, T]``
    (query, key: what each layer's KV head shows its query heads)."""
    group = model.num_heads // model.num_kv_heads

    def attend(layer, q, k, v):
        k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
        s = torch.einsum("qhd,khd->hqk", q.float(), k) * model.attn_scale
        s.masked_fill_(~visible[layer].repeat_interleave(group, dim=0), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)

    n, device = len(tokens), model.device
    visible = visible.to(device)
    return model.forward(torch.tensor(tokens, device=device), torch.arange(n, device=device), attend)


def _visible(run, leaf, log):
    """[layers, kv_heads, T, T] bool over the leaf's root-to-leaf tokens: causal, less the leaf's own tokens
    that layer's KV head dropped in a compaction before the query ran (compaction c ran after the tokens it
    accounted for, before the next; the log holds each one's kept tokens per layer and KV head)."""
    tokens = run.tree.path_tokens(leaf)
    n, start = len(tokens), run.tree.position(leaf)
    layers, heads = run.kv.num_layers, run.kv.num_kv_heads
    visible = torch.ones(n, n).tril().bool().expand(layers, heads, n, n).clone()
    for covered, kept in log.get(leaf, []):
        for layer in range(layers):
            for head in range(heads):
                held = set(kept[layer][head])
                dropped = [start + i for i in range(covered) if i not in held]
                visible[layer, head, start + covered:, dropped] = False
    return tokens, visible


def _run_swa(model, tokenizer, keep, *, backend="reference", every=4, history=3, max_tokens=40, check=None):
    engine = Engine(model, tokenizer, kv_keep_every=every, kv_keep_history=history)
    engine.attention_backend = backend
    run = engine.start()
    run.swa_log = {}
    tree = run.tree
    root = tree.add_node(None, _ids(24, 10))
    leaves = [tree.add_node(root, _ids(5 + 4 * i, 11 + i)) for i in range(3)]
    reqs = [GenRequest(leaf, SamplingParams(max_tokens=max_tokens - 7 * i, ignore_eos=True, kv_keep=keep), key=i)
            for i, leaf in enumerate(leaves)]
    reqs.append(GenRequest(tree.add_node(root, _ids(6, 20)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           key=9))  # an exact branch beside them, in the same phases
    results, _ = run.execute(reqs, [])
    return run, root, [r.node for r in reqs], results


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_swa_decoding_equals_plain_attention_over_the_kept_tokens(model, model64, tokenizer, monkeypatch, backend):
    """Every generated token's log-probability equals a plain masked-attention forward of the branch's
    whole sequence that hides exactly the tokens the run's compactions dropped, before each query; and
    each compaction kept exactly ALISA's choice on brute-force attention weights. The Triton case runs the
    kernels in the interpreter (fp32) on a model with head_dim 64."""
    expected = []
    original = swa.own_attention

    def checked(kv, tree, m, nodes, queries, positions, chunk=32, per_head=False):
        assert per_head  # (each layer and KV head chooses its own kept tokens)
        got = original(kv, tree, m, nodes, queries, positions, chunk, per_head)
        want = _own_weights_brute(run_of["run"], nodes, queries, positions, per_head=True)
        for n, g_, w_, ps in zip(nodes, got, want, positions):
            torch.testing.assert_close(g_, w_, atol=1e-4, rtol=1e-4)
            seg = kv.segments[n]
            # the queries are the last steps before the compaction: the last one is the newest written key's
            assert ps == list(range(ps[0], ps[0] + len(ps))) and ps[-1] == tree.position(n) + seg.tokens - 1
            expected.append((n, _alisa_brute_per_head(w_, seg.computed, seg.tokens, 0.3)))
        return got

    run_of = {}
    monkeypatch.setattr(swa, "own_attention", checked)
    real_start = Engine.start

    def start(self):
        run_of["run"] = real_start(self)
        keep_fn = run_of["run"].kv.keep_many

        def keep_many(kept):
            for node, rows in kept.items():
                assert (node, rows.tolist()) == expected.pop(0)
            keep_fn(kept)

        run_of["run"].kv.keep_many = keep_many
        return run_of["run"]

    monkeypatch.setattr(Engine, "start", start)
    if backend == "triton":
        model = model64
    run, root, nodes, results = _run_swa(model, tokenizer, 0.3, backend=backend,
                                         max_tokens=40 if backend == "reference" else 16)
    assert not expected and run.swa_compactions >= 4 and run.swa_dropped > 0
    assert len(run.swa_log) >= 2  # (a branch of a few tokens keeps them all)
    for leaf, result in zip(nodes, results):
        if result.kv_keep is None:
            assert leaf not in run.swa_log
        tokens, visible = _visible(run, leaf, run.swa_log)
        logits = _masked_reference_logits(run.model, tokens, visible)
        gen = len(result.tokens)
        rows = torch.arange(len(tokens) - gen - 1, len(tokens) - 1)
        want = logits[rows].log_softmax(-1).gather(1, torch.tensor(result.tokens).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(result.logprobs), want, atol=2e-4, rtol=0)
        assert result.tokens == tuple(logits[rows].argmax(-1).tolist())
    # shared ancestors stay dense
    assert run.kv.dropped(root) == 0 and run.kv.segments[root].computed == len(run.tree.tokens(root))


def test_sparse_window_branches_never_outgrow_their_reservation_while_work_streams_in(model, tokenizer, monkeypatch):
    """New work arriving while sparse-window branches decode prefills in mixed steps (each adds a token to
    every live branch): at most ``MIXED_STEPS`` of them run before the branches' next phase (which ends in
    a compaction), so a branch never holds more than its kept budget + ``every + MIXED_STEPS`` — what
    ``reserve_slots`` reserves. Here 12 prompts of 6 tokens under a prefill budget of 8 rows want 12
    mixed steps in a row."""
    from treegen.runtime.decode import Decoder
    from treegen.runtime.tree_run import TreeRun

    every = 4
    engine = Engine(model, tokenizer, kv_keep_every=every, kv_keep_history=3, max_prefill_tokens=8)
    events, worst = [], []
    run_step, phase = TreeRun._run_step, Decoder.phase

    def mixed(self, step):
        events.append("mixed" if self.decoder.sparse_window_live() else "mixed-exact")
        run_step(self, step)
        for b in self.decoder.live:
            params, node = self.decoder.jobs[b].request.params, self.decoder.jobs[b].request.node
            if params.kv_keep is not None:
                seg = self.kv.segments[node]
                worst.append(seg.computed - swa.kept_count(params.kv_keep, seg.tokens))
                assert seg.computed <= seg.capacity

    def phased(self, joining=()):
        events.append("phase")
        return phase(self, joining)

    monkeypatch.setattr(TreeRun, "_run_step", mixed)
    monkeypatch.setattr(Decoder, "phase", phased)
    run = engine.start()
    root = run.tree.add_node(None, _ids(24, 10))
    reqs = [GenRequest(run.tree.add_node(root, _ids(3, 11 + i)), SamplingParams(max_tokens=60, ignore_eos=True,
                                                                                 kv_keep=0.3), key=i)
            for i in range(2)]
    reqs += [GenRequest(run.tree.add_node(root, _ids(6, 30 + i)), SamplingParams(max_tokens=3, ignore_eos=True),
                        key=10 + i) for i in range(12)]
    results, _ = run.execute(reqs, [])
    assert all(len(r.tokens) == 60 for r in results[:2]) and run.swa_compactions > 0
    in_row = longest = 0
    for e in events:
        in_row = in_row + 1 if e == "mixed" else 0
        longest = max(longest, in_row)
    assert events.count("mixed") > swa.MIXED_STEPS and longest == swa.MIXED_STEPS  # (12 in a row without the limit)
    assert max(worst) <= every + swa.MIXED_STEPS


def test_a_branch_that_goes_on_after_compaction_reserves_only_what_it_holds(model, tokenizer):
    """A follow-up gen on a node that sparse window attention compacted: the tokens it dropped take no
    slot, so the follow-up reserves from what the node holds (a few slots more than its range at most)
    where counting every token would ask for the node's whole dense length again."""
    every = 4
    engine = Engine(model, tokenizer, kv_keep_every=every, kv_keep_history=3)
    run = engine.start()
    root = run.tree.add_node(None, _ids(24, 10))
    leaves = [run.tree.add_node(root, _ids(3, 11 + i)) for i in range(2)]
    first, _ = run.execute([GenRequest(leaf, SamplingParams(max_tokens=60, ignore_eos=True, kv_keep=0.3), key=i,
                                       final=False) for i, leaf in enumerate(leaves)], [])
    assert all(r.kv_dropped > 0 for r in first)
    jobs = []
    for i, leaf in enumerate(leaves):
        run.tree.extend(leaf, [7])  # the follow-up reads the answer
        seg, tokens = run.kv.segments[leaf], len(run.tree.tokens(leaf))
        req = GenRequest(leaf, SamplingParams(max_tokens=8, ignore_eos=True, kv_keep=0.3), key=10 + i)
        want = run.scheduler.gen_slots(Job(req))
        assert want == swa.reserve_slots(tokens, 8, 0.3, every, seg.dropped) < tokens - 30
        assert swa.reserve_slots(tokens, 8, 0.3, every) == tokens + 8  # (its tokens all counted: dense)
        job = run.submit(req)
        # (a node that must grow counts what it gains; the range it holds meanwhile is the pass's move room)
        assert run.scheduler.need(job) == {leaf: max(0, want - seg.capacity)}
        assert run.scheduler.moving(job) == (seg.capacity if want > seg.capacity else 0)
        jobs.append(job)
    while run.busy() and run.advance():
        pass
    assert all(j.error is None and len(j.result.tokens) == 8 for j in jobs)


def test_kv_keep_one_is_exact_and_recorded(model, tokenizer):
    _, _, _, exact = _run_swa(model, tokenizer, None, max_tokens=24)
    run, _, _, full = _run_swa(model, tokenizer, 1.0, max_tokens=24)
    assert [r.tokens for r in full] == [r.tokens for r in exact]
    assert run.swa_dropped == 0 and [r.kv_keep for r in full] == [1.0, 1.0, 1.0, None]
    _, _, _, sparse = _run_swa(model, tokenizer, 0.3, max_tokens=24)
    assert [r.kv_keep for r in sparse] == [0.3, 0.3, 0.3, None] and all(r.kv_dropped > 0 for r in sparse[:2])
    assert [r.tokens for r in sparse][3] == exact[3].tokens  # the exact branch beside them is untouched


@treegen.program
def _swa_program(s, keep):
    s += "The quick brown fox jumps over the lazy dog. " * 2
    b = s.fork(2, content=[" One:", " Two:"])
    b += treegen.gen("x", max_tokens=16, kv_keep=keep)
    s.join(b)


SWA_TG = '''"The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
fork item in [" One:", " Two:"] {
    "{item}"
    gen x(max_tokens=16, kv_keep=0.25)
}
join
'''


def _gen_infos(root):
    """The info of every branch's gen ``x`` (a DSL root state, or a .tg result)."""
    states = root.state._run.states if hasattr(root, "root") else root._run.states
    return [st.info["x"] for st in states if "finish_reason" in st.info.get("x", {})]


def test_dsl_tg_and_engine_default_reach_the_engine(model, tokenizer):
    root = _swa_program.run(Engine(model, tokenizer, kv_keep_every=4), 0.25)
    infos = _gen_infos(root)
    assert [i["kv_keep"] for i in infos] == [0.25, 0.25] and all(i["kv_dropped"] > 0 for i in infos)
    # the .tg form of the same program gives the same tokens
    tg = loads(SWA_TG).run(Engine(model, tokenizer, kv_keep_every=4))
    assert tg["x"] == root["x"] and [i["kv_keep"] for i in _gen_infos(tg)] == [0.25, 0.25]
    assert "kv_keep" in str(tg.to_json())  # visible on the program's result
    # the engine's default applies to gens that name none, and gives the same tokens
    default = _swa_program.run(Engine(model, tokenizer, kv_keep_every=4, kv_keep=0.25), None)
    assert default["x"] == root["x"] and [i["kv_keep"] for i in _gen_infos(default)] == [0.25, 0.25]
    exact = _swa_program.run(Engine(model, tokenizer), None)
    assert all("kv_keep" not in i for i in _gen_infos(exact)) and exact["x"] != root["x"]


def test_cli_run_passes_kv_keep_and_refuses_bad_values(capsys, monkeypatch, model, tokenizer):
    from test_tg_cli import EXAMPLES, run_cli

    seen = {}

    def load(cls, model_name=None, **kw):
        seen.update(kw)
        return Engine(model, tokenizer, kv_keep=kw.get("kv_keep"))

    monkeypatch.setattr(Engine, "load", classmethod(load))
    code, _, _ = run_cli(capsys, "run", EXAMPLES / "two_level.tg", "--var", "n=2", "--var", "max_tokens=2",
                         "--kv-keep", "0.3", "--no-progress")
    assert code == 0 and seen["kv_keep"] == 0.3
    with pytest.raises(SystemExit) as e:  # argparse: a usage error
        run_cli(capsys, "run", EXAMPLES / "two_level.tg", "--kv-keep", "1.5", "--no-progress")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kv-keep must be a number in (0, 1]" in err and "got 1.5" in err
