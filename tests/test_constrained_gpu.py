"""Constrained gens on the GPU with CUDA graphs, at 256 branches and more (CUDA only; skipped elsewhere).

A random Llama of the TinyLlama shape (2 layers) with :class:`~treegen.runtime.piece_tokenizer.PieceTokenizer`'s
synthetic vocabulary of its size (a grammar needs token texts; nothing is downloaded). Run on the
device machine with TRITON_INTERPRET=0.
"""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from treegen.runtime.constraint import Constraint
from treegen.runtime.engine import Engine, GenRequest
from treegen.runtime.model import LlamaFamilyModel
from treegen.runtime.piece_tokenizer import PieceTokenizer
from treegen.runtime.sampler import SamplingParams

pytestmark = pytest.mark.gpu

REGEX = r"The answer is (0|[1-9][0-9]{0,3})\."
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "unit": {"enum": ["cows", "dollars", "apples"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "unit", "sure"], "additionalProperties": False}
CHOICES = ["19", "17", "twenty", 'a "quoted" one']
GRAMMAR = 'root ::= "A" digit digit? | "B" ("+" | "-") digit\ndigit ::= [0-9]'
KINDS = [Constraint.of(regex=REGEX), Constraint.of(json_schema=SCHEMA), Constraint.of(choices=CHOICES),
         Constraint.of(grammar=GRAMMAR)]


def model_of(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=4096)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return hf, LlamaFamilyModel.from_hf(hf)


@pytest.fixture(scope="module")
def bf16():
    return model_of(torch.bfloat16)[1]


def branches(run, tok, n: int, text: str = "Q: How many cows?\nA: "):
    root = run.tree.add_node(None, tok.encode(text))
    return [run.tree.add_node(root, tok.encode(f"#{i} ")) for i in range(n)]


@pytest.mark.parametrize("jump_forward", [False, True], ids=["decoded", "jump-forward"])
def test_every_sample_matches_with_cuda_graphs(bf16, jump_forward):
    """256 constrained branches in captured phases; with jump-forward each text starts with the tokens its
    constraint forces (prefilled with the prompt) and the run takes fewer forward passes."""
    tok = PieceTokenizer(bf16.vocab_size)
    engine = Engine(bf16, tok, jump_forward=jump_forward)
    run = engine.start()
    leaves = branches(run, tok, 4 * 64)
    requests = [GenRequest(leaf, SamplingParams(max_tokens=64, temperature=1.0, constraint=KINDS[i // 64]), key=i)
                for i, leaf in enumerate(leaves)]
    results, _ = run.execute(requests, [])
    assert run.decoder.constrained_steps > 10 and run.decoder.captured_phases >= 1  # graphs, not the eager step
    assert all(r.finish_reason == "eos" and r.constraint_met is True for r in results)
    texts = [r.text for r in results]
    assert all(re.fullmatch(REGEX, t) for t in texts[:64]), texts[:64]
    for t in texts[64:128]:  # (the schema checked by hand: the device image need not have jsonschema)
        value = json.loads(t)
        assert list(value) == ["answer", "unit", "sure"], t
        assert type(value["answer"]) is int and 0 <= value["answer"] <= 999, t
        assert value["unit"] in ("cows", "dollars", "apples") and type(value["sure"]) is bool, t
    assert set(texts[128:192]) <= set(CHOICES)
    assert all(re.fullmatch(r"A[0-9][0-9]?|B[+-][0-9]", t) for t in texts[192:])
    if jump_forward:
        for i, r in enumerate(results):
            forced = engine.grammars.forced_prefix(KINDS[i // 64])
            assert r.tokens[:len(forced)] == forced and r.logprobs[:len(forced)] == (0.0,) * len(forced)
        assert any(engine.grammars.forced_prefix(k) for k in KINDS)


@pytest.mark.parametrize("automata", [True, False], ids=["token-automata", "xgrammar-matchers"])
def test_dead_end_constraints_end_alone_in_captured_phases(bf16, automata):
    """256 branches with graphs, a quarter under a constraint no text completes (``a[^\\s\\S]``): those end at
    the dead end (EOS, ``dead_end``, unmet, text ``a``); the regex branches beside them match as usual."""
    tok = PieceTokenizer(bf16.vocab_size)
    run = Engine(bf16, tok, token_automata=automata).start()
    dead = Constraint.of(regex=r"a[^\s\S]")
    requests = [GenRequest(leaf, SamplingParams(max_tokens=32, temperature=1.0, constraint=dead if i % 4 == 0
                                                else KINDS[0]), key=i)
                for i, leaf in enumerate(branches(run, tok, 256))]
    results, _ = run.execute(requests, [])
    assert run.decoder.captured_phases >= 1
    for i, r in enumerate(results):
        if i % 4 == 0:
            assert (r.finish_reason, r.constraint_met, r.text) == ("dead_end", False, "a"), (i, r)
        else:
            assert r.finish_reason == "eos" and r.constraint_met and re.fullmatch(REGEX, r.text), (i, r)


def test_unconstrained_rows_unchanged_beside_constrained_ones(bf16):
    """At 512 branches with graphs: half constrained; the other half samples exactly what it samples alone."""
    tok = PieceTokenizer(bf16.vocab_size)
    engine = Engine(bf16, tok)
    got = {}
    for mixed in (False, True):
        run = engine.start()
        leaves = branches(run, tok, 512)
        reqs = [GenRequest(leaf, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True), key=i)
                if i % 2 == 0 or not mixed else
                GenRequest(leaf, SamplingParams(max_tokens=24, temperature=1.0, constraint=KINDS[0]), key=i)
                for i, leaf in enumerate(leaves)]
        results, _ = run.execute(reqs, [])
        got[mixed] = results
    assert [r.tokens for r in got[True][::2]] == [r.tokens for r in got[False][::2]]
    assert all(re.fullmatch(REGEX, r.text) for r in got[True][1::2])


def test_greedy_matches_hf_generate_with_xgrammar():
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    hf, model = model_of(torch.float32)
    tok = PieceTokenizer(model.vocab_size)
    engine = Engine(model, tok)
    run = engine.start()
    leaves = branches(run, tok, 256)
    reqs = [GenRequest(leaf, SamplingParams(max_tokens=40, constraint=KINDS[i % 2]), key=i)
            for i, leaf in enumerate(leaves)]
    results, _ = run.execute(reqs, [])
    assert run.decoder.captured_phases >= 1
    for i in (0, 1, 2, 3, 254, 255):
        path = run.tree.path_tokens(leaves[i])  # the prompt, then the gen's tokens but a final EOS (context)
        prompt = path[: len(path) - len(results[i].context)]
        compiled = engine.grammars.compile(KINDS[i % 2])  # the same tokenizer tables and grammar
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40, do_sample=False,
                              eos_token_id=[tok.eos_token_id], pad_token_id=tok.eos_token_id,
                              logits_processor=[LogitsProcessor(compiled)])
        assert list(results[i].tokens) == out[0, len(prompt):].tolist(), i
        assert isinstance(compiled, xgr.CompiledGrammar)


def test_kept_phase_graphs_give_the_same_constrained_samples(bf16):
    """Constrained phases replaying kept graphs (forward and pick, padded rows with all-ones masks) draw
    the samples of phases captured anew."""
    tok = PieceTokenizer(bf16.vocab_size)
    texts, replayed = {}, {}
    for keep in (True, False):
        run = Engine(bf16, tok).start()
        if not keep:
            run.decoder.kept = None
        texts[keep] = []
        leaves = branches(run, tok, 40)
        for round_ in range(3):
            requests = [GenRequest(leaf, SamplingParams(max_tokens=24, temperature=1.0, constraint=KINDS[i % 4]),
                                   key=100 * round_ + i) for i, leaf in enumerate(leaves)]
            results, _ = run.execute(requests, [])
            texts[keep].append([r.text for r in results])
            leaves = [run.tree.add_node(leaf, tok.encode(" ")) for leaf in leaves]
        replayed[keep] = run.decoder.kept_phases
    assert texts[True] == texts[False]
    assert replayed[True] >= 1 and replayed[False] == 0, replayed


def test_token_automata_draw_what_xgrammar_draws_and_phases_end_at_their_answers(bf16):
    """At 256 branches with graphs: the regex, the choices and the JSON schema served by token automata on
    the device (no host step) give every branch the tokens xgrammar's matchers give it, and the phases, which read
    the device's count of rows still generating, run about as many steps as the longest answer (not up
    to two 8-step blocks more)."""
    from treegen.runtime.decode import WATCH_LAG

    tok = PieceTokenizer(bf16.vocab_size)
    got = {}
    for automata in (True, False):
        engine = Engine(bf16, tok, token_automata=automata)
        served = [engine.automaton(k) is not None for k in KINDS]
        assert served == [automata, automata, automata, False], served  # (EBNF grammars stay on xgrammar)
        run = engine.start()
        leaves = branches(run, tok, 256)
        choices = Constraint.of(choices=["19", "17", "twenty"])  # (ASCII: an automaton serves it)
        reqs = [GenRequest(leaf, SamplingParams(max_tokens=64, temperature=1.0, constraint=(KINDS[0], choices, KINDS[1])[i % 3]),
                           key=i) for i, leaf in enumerate(leaves)]
        results, _ = run.execute(reqs, [])
        got[automata] = [(r.tokens, r.finish_reason, r.constraint_met) for r in results]
        if automata:
            assert run.decoder.constrained_steps == 0 and run.decoder.captured_phases >= 1
            assert run.decoder.early_ends >= 1
            longest = max(len(r.tokens) for r in results)
            assert run.forward_passes <= longest + 1 + WATCH_LAG + len(run.decode_phases), (run.forward_passes, longest)
            assert all(re.fullmatch(REGEX, r.text) for r in results[::3])
            assert {r.text for r in results[1::3]} <= {"19", "17", "twenty"}
            for r in results[2::3]:
                assert r.finish_reason == "length" or set(json.loads(r.text)) == {"answer", "unit", "sure"}, r.text
    assert got[True] == got[False]
