"""Token automata (regular constraints served on the device): the same masks as xgrammar's matchers,
device steps equal to the host's walk, which constraints stay with xgrammar, and runs that give the
same tokens with automata on and off."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import random
import re

import numpy as np
import pytest
import torch

import treegen
from treegen.runtime.constraint import Constraint, Grammars
from treegen.runtime.piece_tokenizer import PieceTokenizer
from treegen.runtime.requests import GenRequest
from treegen.runtime.sampler import SamplingParams
from treegen.runtime.token_automata import FREE, Automata, ascii_regex

SERVED = [Constraint.of(regex=r"The answer is (0|[1-9][0-9]{0,3})\."), Constraint.of(regex=r"-?[0-9]+"),
          Constraint.of(regex=r"[A-D]\) [a-z ]{1,20}\n(-?\d{1,3}[.,]){0,4}"), Constraint.of(regex=r"(a0)*b?"),
          Constraint.of(regex=r"\w+(, \w+)*[!?]"), Constraint.of(regex=r"[\]\-a&~[]+x"),
          Constraint.of(choices=["yes", "no", "maybe so", "D) none of the above", 'a "quoted" \\ one']),
          # JSON schemas whose xgrammar grammar is plainly regular (treegen/runtime/regular_grammar.py)
          Constraint.of(json_schema={"type": "integer"}),
          Constraint.of(json_schema={"type": "object", "properties": {
              "answer": {"type": "integer", "minimum": 0, "maximum": 9999},
              "unit": {"enum": ["cows", "dollars", "apples"]}, "sure": {"type": "boolean"},
              "score": {"type": "number"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
              "extra": {"type": "integer"}},
              "required": ["answer", "unit", "sure", "score", "tags"], "additionalProperties": False}),
          Constraint.of(json_schema={"enum": ["a?b", "c*d", "(e)"]})]
KEPT = [Constraint.of(regex=r"[a-z0-9 ,.]{300,}"), Constraint.of(regex=r"x.y"), Constraint.of(regex=r"[^a]+"),
        Constraint.of(regex=r"\s*[0-9]+"), Constraint.of(regex=r"\S+"), Constraint.of(regex=r"é+"),
        Constraint.of(choices=["naïve", "café"]),
        Constraint.of(json_schema={"type": "object", "properties": {"why": {"type": "string"}}}),  # free strings
        Constraint.of(grammar='root ::= "a" [0-9]')]  # EBNF grammars: always xgrammar's (see token_automata)


def _walk_and_compare(grammars, automata, constraint, vocab, stops, walks, steps, seed=0):
    """Random walks through the automaton's allowed tokens: at every step its mask equals the xgrammar
    matcher's (which takes the same tokens)."""
    automaton = automata.get(constraint)
    assert automaton is not None, constraint
    rng = random.Random(seed)
    words = grammars.mask_width
    for _ in range(walks):
        matcher, state = grammars.matcher(constraint), automaton.initial
        for _ in range(steps):
            theirs = torch.full((1, words), -1, dtype=torch.int32)
            matcher.fill_next_token_bitmask(theirs)
            mine = automata.tables.masks[state]
            assert torch.equal(theirs[0], mine), (constraint, state)
            allowed = [t for t in range(vocab) if automata.allows(state, t)]
            token = rng.choice(allowed)
            if token in stops:
                assert state in automata.final
                break
            assert matcher.accept_token(token)
            state = automata.walk(state, [token])


@pytest.mark.parametrize("constraint", SERVED, ids=str)
def test_masks_equal_xgrammars_on_the_smollm2_vocabulary(smol, constraint):
    tok = smol.tokenizer
    grammars = Grammars(tok, smol.model.vocab_size, smol.model.eos_token_ids)
    automata = Automata(grammars, "cpu")
    _walk_and_compare(grammars, automata, constraint, smol.model.vocab_size, smol.model.eos_token_ids, walks=6, steps=30)


def test_masks_equal_xgrammars_on_a_piece_vocabulary():
    grammars = Grammars(PieceTokenizer(4096), 4096, {2})
    automata = Automata(grammars, "cpu")
    for constraint in SERVED:  # (several automata in one engine's tables: global state ids)
        _walk_and_compare(grammars, automata, constraint, 4096, {2}, walks=6, steps=30, seed=1)
    assert automata.tables.generation == len(SERVED)


@pytest.mark.parametrize("constraint", KEPT, ids=str)
def test_what_xgrammar_keeps(smol, constraint):
    """Non-ASCII text or what may match it, long counted repetitions, JSON schemas and grammars."""
    assert smol.automaton(constraint) is None


def test_the_regex_rewriting():
    assert ascii_regex(r"\d+\w") == "[0-9]+[a-zA-Z0-9_]"
    assert ascii_regex(r"[\d.]") == "[0-9.]"
    assert ascii_regex(r"a\.b\n") == r"a\.b\n"
    assert ascii_regex(r"[]a]") == "[]a]"
    for bad in (r"a.b", r"[^x]", r"[\^a]", r"\s", r"\D", r"^a$", r"(a)\1", r"\x41", r"x{129}", r"x{2,200}", "é",
                r"(\d{1,64}\.){0,48}"):  # (xgrammar reads "[\^" as "[^"; nested repetitions multiply)
        assert ascii_regex(bad) is None, bad


def test_device_steps_equal_the_host_walk():
    grammars = Grammars(PieceTokenizer(4096), 4096, {2})
    automata = Automata(grammars, "cpu")
    first, second = (automata.get(c) for c in SERVED[:2])
    tables = automata.tables
    rng = random.Random(3)
    states = [FREE, first.initial, second.initial, second.initial + 1]
    for _ in range(20):
        tokens = [rng.randrange(4096) if s == FREE else rng.choice(
            [t for t in range(4096) if automata.allows(s, t)]) for s in states]
        moved = tables.advance(torch.tensor(states), torch.tensor(tokens)).tolist()
        assert moved == [automata.walk(s, [t]) for s, t in zip(states, tokens)]
        assert moved[0] == FREE
        states = [s if s != FREE or k == 0 else first.initial for k, s in enumerate(moved)]
    assert torch.equal(tables.bitmask(torch.tensor([FREE])), torch.full((1, grammars.mask_width), -1, dtype=torch.int32))


def _run(engine, constraint, *, temperature, max_tokens, seeds=6):
    prompt = engine.tokenizer.encode("Q: A farmer has 12 cows and buys 7 more. How many cows?\nA:",
                                     add_special_tokens=False)
    run = engine.start()
    root = run.tree.add_node(None, prompt)
    leaves = [run.tree.add_node(root, ()) for _ in range(seeds + 1)]
    requests = [GenRequest(leaf, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                constraint=None if k == seeds else constraint), key=k)
                for k, leaf in enumerate(leaves)]
    results, _ = run.execute(requests, [])
    return results


ANSWER_JSON = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                "sure": {"type": "boolean"}},
               "required": ["answer", "sure"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("constraint,enough", [(Constraint.of(regex=r"The answer is (0|[1-9][0-9]{0,3})\."), 40),
                                               (Constraint.of(json_schema=ANSWER_JSON), 64)], ids=["regex", "json"])
def test_runs_give_the_same_tokens_with_automata_on_and_off(smol, tiny_llama, temperature, constraint, enough):
    """The same masks, counter-based sampling: every branch's tokens, its finish and whether its
    constraint is met are the same whichever serves the constraint (beside an unconstrained branch)."""
    model = tiny_llama[1]
    on = treegen.Engine(model, smol.tokenizer)
    off = treegen.Engine(model, smol.tokenizer, token_automata=False)
    assert on.automaton(constraint) is not None and off.automaton(constraint) is None
    for max_tokens in (enough, 5):  # (5: cut short, constraint not met)
        a = _run(on, constraint, temperature=temperature, max_tokens=max_tokens)
        b = _run(off, constraint, temperature=temperature, max_tokens=max_tokens)
        assert [(r.tokens, r.finish_reason, r.constraint_met) for r in a] == \
            [(r.tokens, r.finish_reason, r.constraint_met) for r in b]
        for r in a[:-1]:
            if max_tokens == 5:
                assert r.finish_reason == "length" and r.constraint_met is False
            elif constraint.kind == "regex":
                assert r.constraint_met and re.fullmatch(constraint.spec, r.text), r
            else:
                value = json.loads(r.text)
                assert r.constraint_met and set(value) == {"answer", "sure"} and 0 <= value["answer"] <= 9999, r
        assert a[-1].constraint_met is None


def test_token_automata_must_be_a_bool(smol, tiny_llama):
    with pytest.raises(ValueError, match="token_automata must be True or False"):
        treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata="yes")


def test_large_or_empty_automata():
    """An automaton whose walk would be too large stays with xgrammar (bounded before it is built); one
    without a move (the empty text) still steps (to free)."""
    grammars = Grammars(PieceTokenizer(4096), 4096, {2})
    automata = Automata(grammars, "cpu")
    assert automata.get(Constraint.of(regex=r"(\d{1,60}\.){0,60}")) is None
    empty = automata.get(Constraint.of(regex=r"()"))
    assert empty is not None and empty.initial in automata.final
    moved = automata.tables.advance(torch.tensor([empty.initial, FREE]), torch.tensor([2, 5]))
    assert moved.tolist() == [FREE, FREE]


def test_choices_with_control_characters_are_exact():
    """xgrammar reads a control character's escape greedily ("\\x01" + "b" as "\\x1b"): each is its own
    literal, so both servers hold the branch to the same choices."""
    import xgrammar as xgr

    constraint = Constraint.of(choices=["a\x01b", "\x1f", "b"])
    info = xgr.TokenizerInfo([chr(c) for c in range(0, 127)] + [""], vocab_size=128, stop_token_ids=[127])
    compiled = xgr.GrammarCompiler(info).compile_grammar(constraint.grammar())
    for text, ok in [("a\x01b", True), ("a\x1b", False), ("\x1f", True), ("", False), ("b", True)]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.is_completed()) is ok, repr(text)


def _allowed(automata, state: int, vocab: int) -> list[int]:
    bits = automata.tables.masks[state].numpy().view("uint8")
    return np.unpackbits(bits, bitorder="little")[:vocab].nonzero()[0].tolist()


def test_most_bounds_every_answer():
    """A state's ``most``: the most tokens a branch there can still draw, its stop token included (with
    single-character tokens, the longest text's length + 1); ``inf`` where the text can grow without end
    (and for a free row). Along random walks it falls by one a token at least and bounds what is drawn
    (a decode phase's width: :class:`~treegen.runtime.decode.Decoder`)."""
    vocab, stop = 4096, 2
    automata = Automata(Grammars(PieceTokenizer(vocab), vocab, {stop}), "cpu")
    assert automata.most(automata.get(Constraint.of(choices=["yes", "no"])).initial) == 4
    assert automata.most(automata.get(Constraint.of(regex=r"(a0)*b?")).initial) == float("inf")
    assert automata.most(automata.get(Constraint.of(regex=r"x[0-9]+y")).initial) == float("inf")
    assert automata.most(FREE) == float("inf")
    answer = automata.get(SERVED[0])
    assert automata.most(answer.initial) == len("The answer is 1234.") + 1
    rng = random.Random(0)
    for _ in range(40):
        state, drawn = answer.initial, 0
        while True:
            token = rng.choice(_allowed(automata, state, vocab))
            drawn += 1
            if token == stop:
                break
            after = automata.walk(state, (token,))
            assert automata.most(after) <= automata.most(state) - 1
            state = after
        assert drawn <= automata.most(answer.initial)
