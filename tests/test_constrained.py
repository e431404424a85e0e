"""Constrained gens (regex, choices, JSON schema, grammar) on the embedded SmolLM2 (CPU), against
Hugging Face ``generate`` with xgrammar's logits processor, and their errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import re

import jsonschema
import pytest
import torch

import treegen
from treegen.lang.tg import loads
from treegen.lang.tg.errors import TgError
from treegen.runtime.constraint import Constraint, ConstraintError
from treegen.runtime.requests import GenRequest
from treegen.runtime.sampler import SamplingParams

QUESTION = "Q: A farmer has 12 cows and buys 7 more. How many cows does he have?\n"
REGEX = r"The answer is (0|[1-9][0-9]{0,3})\."
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "unit": {"enum": ["cows", "dollars", "apples"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "unit", "sure"], "additionalProperties": False}
CHOICES = ["19", "17", "twenty", "Ünïcode \"quoted\""]
GRAMMAR = 'root ::= "A" digit digit? | "B" ("+" | "-") digit\ndigit ::= [0-9]'
N = 64


@pytest.fixture(scope="module")
def sampled(smol, tiny_llama):
    """64 samples at temperature 1.0 under each kind of constraint, all in one run: a tiny random Llama
    with SmolLM2's vocabulary and tokenizer (what is allowed does not depend on the weights; 256
    branches of SmolLM2 itself would take minutes on CI's CPU)."""
    engine = treegen.Engine(tiny_llama[1], smol.tokenizer)
    gens = [treegen.gen("out", max_tokens=24, temperature=1.0, regex=REGEX),
            treegen.gen("out", max_tokens=48, temperature=1.0, json_schema=SCHEMA),
            treegen.gen("out", max_tokens=40, temperature=1.0, choices=CHOICES),  # (random weights: byte by byte)
            treegen.gen("out", max_tokens=8, temperature=1.0, grammar=GRAMMAR)]

    @treegen.program
    def prog(s):
        s += QUESTION
        kinds = s.fork(4, content=["A: ", "A (JSON): ", "A (pick one): ", "A (code): "])
        samples = kinds.fork(N)
        samples += [gens[k] for k in range(4) for _ in range(N)]
        kinds.join(samples)
        s.join(kinds)

    root = prog.run(engine, seed=1)
    infos = [st.info["out"] for st in root._run.states if "out" in st.info and "finish_reason" in st.info["out"]]
    return root["out"], infos


def test_every_sample_matches_its_constraint(sampled):
    outs, infos = sampled
    regex_out, json_out, choice_out, grammar_out = outs
    assert len(infos) == 4 * N and all(len(o) == N for o in outs)
    # each constraint here can always be completed within its max_tokens: every sample is complete
    assert all(i["constraint_met"] is True for i in infos), [i for i in infos if not i["constraint_met"]]
    assert all(re.fullmatch(REGEX, t) for t in regex_out), regex_out
    for text in json_out:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert set(choice_out) <= set(CHOICES)
    assert all(re.fullmatch(r"A[0-9][0-9]?|B[+-][0-9]", t) for t in grammar_out), grammar_out
    # sampled at temperature 1: not one answer repeated
    assert len(set(regex_out)) > 1 and len(set(json_out)) > 1 and len(set(grammar_out)) > 1


def _hf_constrained(hf, tokenizer, compiled, eos, prompt, max_new):
    from xgrammar.contrib.hf import LogitsProcessor

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=sorted(eos), pad_token_id=tokenizer.eos_token_id,
                          logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("constraint", [
    Constraint.of(regex=r"[0-9]+ (cows|dollars)"),
    Constraint.of(json_schema={"type": "object", "properties": {"cows": {"type": "integer"}}, "required": ["cows"]}),
    Constraint.of(choices=["nineteen", "19", "17 cows"]),
], ids=["regex", "json_schema", "choices"])
def test_greedy_matches_hf_generate_with_xgrammar(smol, hf_smol, constraint):
    """Greedy under a constraint, in a batch with an unconstrained branch, equals HF generate with
    xgrammar's logits processor token for token (and the unconstrained branch equals plain generate)."""
    tok = smol.tokenizer
    prompt = tok.encode(QUESTION + "A:", add_special_tokens=False)
    run = smol.start()
    root = run.tree.add_node(None, prompt)
    free, bound = run.tree.add_node(root, ()), run.tree.add_node(root, ())
    results, _ = run.execute([GenRequest(free, SamplingParams(max_tokens=12), key=1),
                              GenRequest(bound, SamplingParams(max_tokens=24, constraint=constraint), key=2)], [])
    eos = smol.model.eos_token_ids
    # xgrammar's processor for HF, on the grammar compiled for our run (the same tokenizer tables)
    ref = _hf_constrained(hf_smol, tok, smol.grammars.compile(constraint), eos, prompt, 24)
    assert list(results[1].tokens) == ref
    assert results[1].finish_reason == "eos" and results[1].constraint_met is True
    with torch.no_grad():
        plain = hf_smol.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=sorted(eos),
                                 pad_token_id=tok.eos_token_id)[0, len(prompt):].tolist()
    assert list(results[0].tokens) == plain[: len(results[0].tokens)] and results[0].constraint_met is None


def test_unconstrained_branches_sample_the_same_beside_constrained_ones(smol):
    """Counter-based sampling: a branch's tokens do not depend on a constrained neighbour (nor on the
    per-step host syncs its phase then runs with)."""
    def prog(with_constraint):
        @treegen.program
        def p(s):
            s += QUESTION + "A:"
            b = s.fork(3)
            b += [treegen.gen("x", max_tokens=10, temperature=1.0),
                  treegen.gen("x", max_tokens=10, temperature=1.0, regex="[0-9]+") if with_constraint
                  else treegen.gen("x", max_tokens=3, temperature=1.0),
                  treegen.gen("x", max_tokens=10, temperature=0.8)]
            s.join(b)
        return p

    alone = prog(False).run(smol, seed=3)["x"]
    mixed = prog(True).run(smol, seed=3)["x"]
    assert [alone[0], alone[2]] == [mixed[0], mixed[2]]
    assert re.fullmatch("[0-9]+", mixed[1])


def test_cut_short_is_incomplete_and_does_not_vote(smol):
    @treegen.program
    def prog(s):
        s += QUESTION
        b = s.fork(4)
        b += [treegen.gen("ans", max_tokens=3, temperature=1.0, json_schema=SCHEMA) for _ in range(3)] + \
             [treegen.gen("ans", max_tokens=12, choices=["19 cows", "17 cows"])]
        s.join(b, answer=treegen.vote("ans"))

    root = prog.run(smol)
    states = [st for st in root._run.states if "finish_reason" in st.info.get("ans", {})]
    short = [st.info["ans"] for st in states if st.info["ans"]["max_tokens"] == 3]
    assert all(i["finish_reason"] == "length" and i["constraint_met"] is False for i in short)
    partial = [st["ans"] for st in states if st.info["ans"]["max_tokens"] == 3]
    assert all(p.startswith('{"') for p in partial)  # the partial text is kept
    assert root["answer"] in ("19 cows", "17 cows")
    assert root.info["answer"]["votes"] == {root["answer"]: 1}  # the three partial JSON texts do not vote


def test_incomplete_constrained_texts_are_never_picked_but_collected_and_marked(smol):
    """best / top_k never pick a constrained text that ended unmet (cut short by max_tokens: an incomplete
    JSON prefix with the highest log-probability would win otherwise); best is None when every text is
    incomplete; collect keeps them all; every reduction lists them in ``info[name]["incomplete"]``."""
    @treegen.program
    def prog(s, n_complete):
        s += QUESTION
        b = s.fork(4)
        b += [treegen.gen("ans", max_tokens=40 if i < n_complete else 2, json_schema=SCHEMA) for i in range(4)]
        s.join(b, pick=treegen.best("ans", by="logprob"), two=treegen.top_k("ans", by="logprob", k=2),
               every=treegen.collect("ans"), parsed=treegen.best("ans", by=lambda t: len(json.loads(t))))

    root = prog.run(smol, 1)
    infos = [st.info["ans"] for st in root._run.states if "finish_reason" in st.info.get("ans", {})]
    assert [i["constraint_met"] for i in infos] == [True, False, False, False]
    assert json.loads(root["pick"]) and root["two"] == [root["pick"]]
    assert root.info["pick"]["winners"] == [0] and root.info["pick"]["incomplete"] == [1, 2, 3]
    assert len(root["every"]) == 4 and root.info["every"]["incomplete"] == [1, 2, 3]
    assert root["parsed"] == root["pick"]  # (a `by` that parses: never called on an incomplete text)
    none = prog.run(smol, 0)
    assert none["pick"] is None and none["two"] == [] and none.info["pick"]["incomplete"] == [0, 1, 2, 3]


def test_constrained_with_select_and_run_batch(smol):
    @treegen.program
    def prog(s, q):
        s += f"Q: {q}\nA:"
        s += treegen.select("kind", [" number", " word"])
        s += " "
        s += treegen.gen("ans", max_tokens=6, regex="[0-9]{1,3}" if s["kind"] == " number" else "[a-z]{1,8}")

    roots = prog.run_batch(smol, [{"q": "2 + 2?"}, {"q": "Name a colour."}, {"q": "10 - 3?"}])
    for r in roots:
        pattern = "[0-9]{1,3}" if r["kind"] == " number" else "[a-z]{1,8}"
        assert re.fullmatch(pattern, r["ans"]) and r.info["ans"]["constraint_met"] is True


def test_bad_constraints_are_refused_where_written():
    with pytest.raises(ValueError, match=r"gen\('x'\): invalid regex: .*Unclosed '\['"):
        treegen.gen("x", regex="[0-9")
    with pytest.raises(ValueError, match=r"invalid json_schema: .*objec"):
        treegen.gen("x", json_schema={"type": "objec"})
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        treegen.gen("x", json_schema="{bad")
    with pytest.raises(ValueError, match=r"invalid grammar: .*Rule \"foo\" is not defined"):
        treegen.gen("x", grammar="root ::= foo")
    with pytest.raises(ValueError, match="at most one constraint, got regex and choices"):
        treegen.gen("x", regex="a", choices=["a"])
    with pytest.raises(ValueError, match="choices must be a non-empty list"):
        treegen.gen("x", choices=["a", ""])
    with pytest.raises(ValueError, match="takes no stop strings"):
        treegen.gen("x", regex="a+", stop="\n")
    with pytest.raises(ValueError, match="ignore_eos"):
        treegen.gen("x", regex="a+", ignore_eos=True)
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        Constraint("regexp", "a")


@pytest.mark.parametrize("source, col, message", [
    ('"Q"\ngen a(max_tokens=4, regex="[0-9+")\n', 27, "invalid regex: Regex parsing error at position 6"),
    ('"Q"\ngen a(json_schema="{\\"type\\": 3}")\n', 19, "invalid json_schema"),
    ('"Q"\ngen a(grammar="root ::= x")\n', 15, "invalid grammar"),
    ('"Q"\ngen a(choices=["x"], regex="x")\n', 22, "at most one constraint, got choices and regex"),
    ('"Q"\ngen a(regex=3)\n', 13, "regex must be a non-empty string"),
])
def test_tg_bad_constraint_points_at_it(source, col, message):
    with pytest.raises(TgError) as err:
        loads(source, "prog.tg")
    text = str(err.value)
    assert text.startswith(f"prog.tg:2:{col}: ") and message in text, text
    assert text.splitlines()[-1].index("^") == col - 1 + 4  # the caret under the value (source indented 4)


def test_tg_constrained_vote_needs_no_extract(smol):
    prog = loads('"' + QUESTION.replace("\n", "\\n") + 'A: "\nfork 6 {\n  gen ans(choices=["19", "17", "21"], temperature=1.0)\n}\n'
                 'join { best = vote(ans) }\n', "vote.tg")
    root = prog.run(smol, seed=0).state
    assert set(root["ans"]) <= {"19", "17", "21"} and root["best"] in root["ans"]
    assert sum(root.info["best"]["votes"].values()) == 6


def test_noise_stays_inside_the_unit_interval():
    """The largest hash gave u = 1.0 in float32, so Gumbel noise +inf: that token was drawn whatever its
    logit (about 0.15% of rows per step over a 49k vocabulary), a masked one included."""
    from treegen.kernels.sampling import unit_interval

    u = unit_interval(torch.tensor([0, 0xFFFFFF00, 0xFFFFFFFF], dtype=torch.int64))
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_choices_with_non_ascii_text_are_exact():
    """xgrammar 0.2.8 reads "\\xef" + "c" back as U+0EFC: each non-ASCII character is its own literal."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + [""], vocab_size=96, stop_token_ids=[95])
    compiled = xgr.GrammarCompiler(info).compile_grammar(Constraint.of(choices=CHOICES + ["naïve", "ïa"]).grammar())
    for text, ok in [('Ünïcode "quoted"', True), ('Ün\u0efcode "quoted"', False), ("naïve", True), ("ïa", True),
                     ("twenty", True), ("twent", False)]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.is_completed()) is ok, text


@pytest.mark.parametrize("regex", ["a{130,}", "(ab){129,}", "a{0,300}", "a{5,200}", "b?a{0,20000}c", "x[ab]{150,420}y", "a{2,9}"])
def test_long_repetitions_are_rewritten_to_the_same_language(regex):
    """xgrammar 0.2.8 matches a counted repetition of more than 128 items with a cost per token that grows
    with the items matched: such repetitions are rewritten (Constraint.grammar) into an equal language."""
    import xgrammar as xgr

    from treegen.runtime.constraint import _parse_plain

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + [""], vocab_size=96, stop_token_ids=[95])
    compiler = xgr.GrammarCompiler(info)
    rewritten = Constraint.of(regex=regex).grammar()
    assert (str(rewritten) != str(_parse_plain("regex", regex))) == (regex != "a{2,9}")
    fast, plain = compiler.compile_grammar(rewritten), compiler.compile_grammar(_parse_plain("regex", regex))
    body = regex.replace("b?", "").replace("c", "").replace("x", "").replace("y", "")
    counts = sorted({0, 1, 2, 5, 63, 64, 65, 127, 128, 129, 130, 131, 149, 150, 199, 200, 201, 255, 256, 299, 300,
                     301, 419, 420, 421, 600, 1000})
    texts = []
    for n in counts:
        unit = "ab" if "(ab)" in body else "a"
        texts += [unit * n, "b" + "a" * n + "c", "x" + "ab" * (n // 2) + "a" * (n % 2) + "y", "a" * n + "b"]
    for text in texts:
        want = re.fullmatch(regex, text) is not None
        got = []
        for compiled in (fast, plain):
            m = xgr.GrammarMatcher(compiled)
            got.append(m.accept_string(text) and m.is_completed())
        assert got == [want, want], (regex, text[:20], len(text), got, want)


def test_threaded_accept_and_fill_equal_one_matcher_at_a_time(monkeypatch):
    """TokenMasks splits a step's accepts and fills of many matchers over threads, by xgrammar's handles: the states and masks equal one matcher at a time, a row not to be
    filled keeps what it held, and a forbidden token names its branch."""
    import random

    import xgrammar as xgr

    from treegen.runtime import token_masks
    from treegen.runtime.constraint import Grammars
    from treegen.runtime.piece_tokenizer import PieceTokenizer
    from treegen.runtime.token_masks import TokenMasks

    monkeypatch.setenv("TREEGEN_MASK_THREADS", "3")
    monkeypatch.setattr(token_masks, "FILL_CHUNK", 100)  # (400 rows: three threads)
    tokenizer = PieceTokenizer(3000)
    masks = TokenMasks(Grammars(tokenizer, 3000, [2]))
    assert masks.threads == 3
    constraint = Constraint.of(json_schema=SCHEMA)
    n = 400
    for b in range(n):
        masks.add(b, constraint)
    solo = [xgr.GrammarMatcher(masks.grammars.compile(constraint)) for _ in range(n)]
    handles = masks.handles([masks.matchers[b] for b in range(n)])
    rows = list(range(n))
    bitmask, expected = masks.new_bitmask(n), masks.new_bitmask(n)
    rng = random.Random(0)
    masks.fill_rows(bitmask, handles, rows)
    for step in range(12):
        for j, m in enumerate(solo):
            m.fill_next_token_bitmask(expected, j)
        assert torch.equal(bitmask, expected)
        bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(n, -1)[:, :3000]
        tokens = [rng.choice(bits[j].nonzero().flatten().tolist()) for j in range(n)]
        assert all(m.accept_token(t) for m, t in zip(solo, tokens))
        if step % 2:  # accepts, then fills
            masks.accept_and_fill(rows, handles, tokens, bitmask, rows, [False] * n)  # (accepts only)
            masks.fill_rows(bitmask, handles, rows)
        else:  # one pass, every row but the first filled
            bitmask[0] = 7
            masks.accept_and_fill(rows, handles, tokens, bitmask, rows, [j > 0 for j in range(n)])
            assert bitmask[0].eq(7).all()
            masks.fill_rows(bitmask, handles[:1], rows[:1])
    bad = [tokenizer.encode("\n")[0]] * n  # never allowed inside this one-line JSON
    with pytest.raises(RuntimeError, match="branch 0 drew token"):
        masks.accept_and_fill(rows, handles, bad, bitmask, rows)
    # a stop token is let through only at a dead end (a matcher that allows nothing): mid-JSON it is a bug too
    eos = sorted(masks.grammars.stop_token_ids)[0]
    with pytest.raises(RuntimeError, match=f"branch 0 drew token {eos}, which its constraint forbids"):
        masks.accept_and_fill(rows, handles, [eos] * n, bitmask, rows)


def test_a_phase_of_constrained_answers_ends_with_its_matchers(smol, tiny_llama, monkeypatch):
    """In blocks of 8 steps (a GPU's ``sync_every``), a phase whose branches xgrammar's matchers constrain
    ends at the step after its last matcher's EOS — the host reads every step's tokens — not at the end of
    the block (a short answer's phase ran up to 8 steps more): as many forward passes as in 1-step blocks,
    and the same answers."""
    from treegen.runtime.decode import Decoder

    init = Decoder.__init__
    got, passes = {}, {}
    for every in (1, 8):
        def with_blocks(self, run, every=every):
            init(self, run)
            self.sync_every = every
        monkeypatch.setattr(Decoder, "__init__", with_blocks)
        run = treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata=False).start()
        root = run.tree.add_node(None, smol.tokenizer.encode(QUESTION + "A: "))
        choices = Constraint.of(choices=["19", "17", "twenty"])
        results, _ = run.execute([GenRequest(run.tree.add_node(root), SamplingParams(
            max_tokens=40, temperature=1.0, constraint=choices), key=i) for i in range(6)], [])
        got[every] = [(r.tokens, r.finish_reason, r.text) for r in results]
        passes[every] = run.forward_passes
    assert got[8] == got[1]
    assert all(reason == "eos" and text in ("19", "17", "twenty") for _, reason, text in got[1]), got[1]
    assert passes[8] <= passes[1], passes  # (before: 10 against 8)


@pytest.mark.parametrize("automata", [True, False], ids=["token-automata", "xgrammar-matchers"])
def test_a_constraint_no_text_completes_ends_its_branch_alone(smol, tiny_llama, automata):
    """A constraint at a dead end (no token can continue the text toward a match: ``a[^\\s\\S]`` after ``a``,
    ``[^\\s\\S]`` at once) allows EOS instead: its branch ends there with ``finish_reason="dead_end"``,
    ``constraint_met`` False and the text so far — it does not crash the run (before: "drew token 0, which its
    constraint forbids") — and the branches beside it, in the same phase, end as they would alone."""
    def run_once(keyed):  # [(key, constraint)]: odd keys sample, even ones are greedy
        run = treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata=automata).start()
        root = run.tree.add_node(None, smol.tokenizer.encode(QUESTION + "A: "))
        results, _ = run.execute([GenRequest(run.tree.add_node(root), SamplingParams(
            max_tokens=12, temperature=1.0 if key % 2 else 0.0, constraint=c), key=key) for key, c in keyed], [])
        return [(r.tokens, r.finish_reason, r.constraint_met, r.text) for r in results]

    dead, none, fine = (Constraint.of(regex=r) for r in (r"a[^\s\S]", r"[^\s\S]", REGEX))
    got = run_once([(0, dead), (1, dead), (2, none), (3, fine), (4, fine)])
    for tokens, reason, met, text in got[:3]:
        assert reason == "dead_end" and met is False and tokens[-1] in tiny_llama[1].eos_token_ids
    assert [g[3] for g in got[:3]] == ["a", "a", ""]
    assert got[3:] == run_once([(3, fine), (4, fine)])
    assert all(re.fullmatch(REGEX, text) for _, reason, _, text in got[3:] if reason == "eos")


def test_open_dead_ends_lets_only_rows_that_allow_nothing_stop():
    from treegen.runtime.token_masks import open_dead_ends, stop_bits

    stops = stop_bits([2, 33, 63], 3)
    assert stops.tolist() == [4, -2147483646, 0]  # bit 2; bits 1 and 31 of word 1 (int32: bit 31 is the sign)
    masks = torch.tensor([[0, 0, 0], [0, 1, 0], [-1, -1, -1]], dtype=torch.int32)
    opened = open_dead_ends(masks, stops)
    assert opened.tolist() == [stops.tolist(), [0, 1, 0], [-1, -1, -1]]
    assert masks[0].tolist() == [0, 0, 0]  # (a new tensor: a phase's mask buffer is left as it was)


@pytest.mark.parametrize("automata", [True, False], ids=["token-automata", "xgrammar-matchers"])
def test_constrained_branches_paused_between_slices_give_the_same_answers(smol, tiny_llama, automata, monkeypatch):
    """Gens that reserve 4 tokens at a time (a bounded budget with offload on) pause at each slice's end and
    resume with their matcher or automaton state where they left it: the same texts and token masks as
    without slices, every sample still matching. (The budget has room to spare, so the scheduler would give
    each its next slice at once; that is turned off here, as when work waits.)"""
    from treegen.runtime import scheduler

    monkeypatch.setattr(scheduler.Scheduler, "extend", lambda self, job, drawn: False)

    per = treegen.Engine(tiny_llama[1], smol.tokenizer).kv_shape.bytes_per_token
    got = {}
    for slice_tokens in (4, None):
        run = treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata=automata, kv_budget_bytes=4000 * per,
                             offload="host", slice_tokens=slice_tokens).start()
        root = run.tree.add_node(None, smol.tokenizer.encode(QUESTION + "A: "))
        kinds = [Constraint.of(regex=REGEX), Constraint.of(json_schema=SCHEMA)]
        results, _ = run.execute([GenRequest(run.tree.add_node(root), SamplingParams(
            max_tokens=24, temperature=1.0, constraint=kinds[i % 2]), key=i) for i in range(8)], [])
        got[slice_tokens] = ([(r.tokens, r.finish_reason, r.constraint_met) for r in results], run.decoder.pauses)
    assert got[4][0] == got[None][0] and got[4][1] > 0 == got[None][1]
    assert all(met or reason == "length" for _, reason, met in got[4][0])


@pytest.mark.parametrize("automata", [True, False], ids=["token-automata", "xgrammar-matchers"])
def test_constrained_gens_joining_a_decode_phase_give_the_same_answers(smol, tiny_llama, automata, monkeypatch):
    """Constrained gens forked right after a gen (their only row its last token, without KV) join a decode phase
    at its first step, their matcher or automaton state made there: the same tokens as from a mixed step."""
    got = {}
    for join in (True, False):
        monkeypatch.setenv("TREEGEN_JOIN_PHASES", "1" if join else "0")
        run = treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata=automata).start()
        first = run.tree.add_node(run.tree.add_node(None, smol.tokenizer.encode(QUESTION + "A: ")))
        run.execute([GenRequest(first, SamplingParams(max_tokens=3, temperature=1.0), key=99)], [])
        kinds = [Constraint.of(regex=REGEX), Constraint.of(json_schema=SCHEMA), None]
        results, _ = run.execute([GenRequest(run.tree.add_node(first), SamplingParams(
            max_tokens=24, temperature=1.0 if i % 2 else 0.0, constraint=kinds[i % 3]), key=i) for i in range(9)], [])
        got[join] = [(r.tokens, r.finish_reason, r.constraint_met) for r in results], run.phase_joins
    assert got[True][0] == got[False][0] and got[True][1] == 9 and got[False][1] == 0


def test_forced_prefix_is_what_every_text_starts_with_less_its_last_token(smol):
    """Jump-forward's tokens: the string xgrammar says a constraint forces from the start, tokenized as the
    tokenizer writes it, its last token left to the model (the space before a number joins it)."""
    grammars = smol.grammars
    tok = smol.tokenizer
    forced = grammars.forced_prefix(Constraint.of(regex=REGEX))
    assert tok.decode(forced) == "The answer is"
    assert tok.decode(grammars.forced_prefix(Constraint.of(json_schema=SCHEMA))) == '{"answer":'
    assert tok.decode(grammars.forced_prefix(Constraint.of(choices=["Option A", "Option B"]))) == "Option"
    assert grammars.forced_prefix(Constraint.of(choices=CHOICES)) == ()  # nothing forced
    assert grammars.forced_prefix(Constraint.of(regex=REGEX)) is forced  # (cached)


@pytest.mark.parametrize("automata", [True, False], ids=["token-automata", "xgrammar-matchers"])
def test_jump_forward_writes_the_forced_text_and_decodes_fewer_steps(smol, tiny_llama, automata):
    """With jump-forward a constrained gen's text starts with its forced tokens (log-probability 0), prefilled
    with the prompt: fewer forward passes for the same number of answers, every text still matching; the
    token automata and xgrammar's matchers (two implementations of the same masks) give the same tokens;
    a gen whose max_tokens is shorter than the forced text ends incomplete."""
    constraints = [Constraint.of(regex=REGEX), Constraint.of(json_schema=SCHEMA)]

    def run_once(jump, max_tokens=32, engine_default=False):
        run = treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata=automata,
                             jump_forward=engine_default).start()
        root = run.tree.add_node(None, smol.tokenizer.encode(QUESTION + "A: "))
        results, _ = run.execute([GenRequest(run.tree.add_node(root), SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if i % 2 else 0.0, constraint=constraints[i % 2],
            jump_forward=None if engine_default else jump), key=i) for i in range(8)], [])
        return results, run.forward_passes

    plain, plain_passes = run_once(False)
    jumped, jumped_passes = run_once(True)
    assert jumped_passes < plain_passes
    for i, r in enumerate(jumped):
        forced = smol.grammars.forced_prefix(constraints[i % 2])
        assert r.tokens[:len(forced)] == forced and r.logprobs[:len(forced)] == (0.0,) * len(forced)
        assert r.logprobs[len(forced)] != 0.0
        if r.finish_reason == "eos":
            assert r.constraint_met
            if i % 2 == 0:
                assert re.fullmatch(REGEX, r.text)
            else:
                jsonschema.validate(json.loads(r.text), SCHEMA)
    assert [r.tokens for r in run_once(True, engine_default=True)[0]] == [r.tokens for r in jumped]
    short, _ = run_once(True, max_tokens=2)
    assert all(len(r.tokens) == 2 and r.finish_reason == "length" and r.constraint_met is False for r in short)
    assert short[0].tokens[0] == smol.grammars.forced_prefix(constraints[0])[0]
    got = {automata: [r.tokens for r in jumped]}
    run = treegen.Engine(tiny_llama[1], smol.tokenizer, token_automata=not automata).start()
    root = run.tree.add_node(None, smol.tokenizer.encode(QUESTION + "A: "))
    results, _ = run.execute([GenRequest(run.tree.add_node(root), SamplingParams(
        max_tokens=32, temperature=1.0 if i % 2 else 0.0, constraint=constraints[i % 2], jump_forward=True), key=i)
        for i in range(8)], [])
    assert [r.tokens for r in results] == got[automata]


def test_jump_forward_is_refused_without_a_constraint_or_as_a_non_boolean(tiny_llama, smol):
    with pytest.raises(ValueError, match="jump_forward=True needs a constraint"):
        SamplingParams(jump_forward=True)
    with pytest.raises(ValueError, match="jump_forward must be True, False or None, got 'yes'"):
        SamplingParams(jump_forward="yes", constraint=Constraint.of(regex="a"))
    with pytest.raises(ValueError, match=r"gen\('x'\): jump_forward=True needs a constraint"):
        treegen.gen("x", jump_forward=True)
    with pytest.raises(ValueError, match="jump_forward must be True or False, got 1"):
        treegen.Engine(tiny_llama[1], smol.tokenizer, jump_forward=1)
