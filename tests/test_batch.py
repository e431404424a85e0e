"""Many programs as one workload: automatic prefix sharing, simplification, batch determinism."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import treegen
from treegen.runtime.engine import Engine
from treegen.tree.passes import share_prefixes, simplify
from treegen.tree.sharing_tree import SharingTree

FEW_SHOT = "Q: Tom has 3 apples and buys 2 more. How many apples does he have?\nA: 3 + 2 = 5. The answer is 5.\n\n"
QUESTIONS = ["Ann has 2 pens and gets 3 more. How many pens?", "Ann has 4 pens and gets 5 more. How many pens?",
             "A bag has 9 sweets. Mia eats 4. How many are left?"]


@treegen.program
def solve(s, question, n=2, temperature=0.0):
    s += FEW_SHOT
    s += f"Q: {question}\nA:"
    samples = s.fork(n)
    samples += treegen.gen("answer", max_tokens=6, temperature=temperature)
    s.join(samples)


@treegen.program
def reads_then_forks(s, question):
    """Its shape depends on a generated value: the batch must pause and resume it."""
    s += FEW_SHOT + f"Q: {question}\nA:"
    s += treegen.gen("first", max_tokens=3)
    words = len(s["first"].split()) % 2 + 1
    more = s.fork(words, content=" So")
    more += treegen.gen("more", max_tokens=3)
    s.join(more)


@pytest.fixture(scope="module")
def smol():
    return Engine.load()


@pytest.fixture(scope="module")
def tok(smol):
    return smol.tokenizer


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


# passes on hand-made trees ------------------------------------------------------------------------------
def test_share_prefixes_builds_the_radix_tree():
    t = SharingTree()
    for toks in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 2, 6], [7], [1, 2]):
        t.add_node(None, toks)
    t.add_node(0, [9])  # a fork below root 0 stays below it
    created = share_prefixes(t, [0, 1, 2, 3, 4, 5])
    # node 5 holds exactly the common prefix [1, 2]: it becomes the shared node (no new node for it)
    assert created == [7]
    assert {n: (t.parent(n), t.tokens(n)) for n in t.graph} == {
        0: (7, [4]), 1: (7, [5]), 2: (5, [6]), 3: (2, []), 4: (None, [7]), 5: (None, [1, 2]), 6: (0, [9]),
        7: (5, [3])}
    # every branch's tokens are unchanged
    assert t.path_tokens(6) == [1, 2, 3, 4, 9] and t.path_tokens(1) == [1, 2, 3, 5] and t.path_tokens(3) == [1, 2, 6]


def test_simplify_dissolves_small_shared_nodes_only():
    t = SharingTree()
    root = t.add_node(None, list(range(100)))           # 100 tokens x 4 branches: worth sharing
    small = t.add_node(root, [1, 2])                     # 2 tokens x 2 branches: saving 2
    big = t.add_node(root, list(range(40)))              # 40 tokens x 2 branches: saving 40
    leaves = [t.add_node(small, [7]), t.add_node(small, [8]), t.add_node(big, [7]), t.add_node(big, [8])]
    before = {n: t.path_tokens(n) for n in leaves}
    done = simplify(t, min_saving=30)
    assert done.dissolved == (small,) and done.copied_tokens == 2
    assert {n: t.path_tokens(n) for n in leaves} == before
    assert t.children(root) == [big, leaves[0], leaves[1]]
    assert simplify(t, min_saving=30, keep={big}).dissolved == ()
    assert simplify(t, min_saving=1000, keep={big}).dissolved == (root,)  # children become roots
    assert {n: t.path_tokens(n) for n in leaves} == before


# compile: the tree of a batch, before running ----------------------------------------------------------
def test_batch_prompts_form_a_two_level_tree(tok):
    compiled = solve.compile_batch([{"question": q, "n": 3} for q in QUESTIONS], tokenizer=tok, min_shared_saving=None)
    tree = compiled.tree
    assert compiled.complete
    prefix = ids(tok, FEW_SHOT)
    problems = [ids(tok, f"Q: {q}\nA:") for q in QUESTIONS]
    # the first two problems share "Q: Ann has" ... ; the radix tree finds the longest common runs
    common_all = len(prefix) + len(os.path.commonprefix(problems))
    common_01 = len(prefix) + len(os.path.commonprefix(problems[:2]))
    roots = [n for n in tree.live_nodes() if tree.parent(n) is None]
    assert len(roots) == 1 and len(tree.tokens(roots[0])) == common_all
    assert tree.branches_below(roots[0]) == 9
    problem_nodes = [n for n in tree.graph if tree.graph.nodes[n]["gen_budget"] == 0 and len(tree.children(n)) == 3]
    assert [len(tree.path_tokens(n)) for n in problem_nodes] == [len(prefix) + len(p) for p in problems]
    # problems 0 and 1 hang below their own shared node; problem 2 right below the root
    mid = tree.parent(problem_nodes[0])
    assert mid == tree.parent(problem_nodes[1]) != roots[0] and tree.parent(problem_nodes[2]) == roots[0]
    assert len(tree.path_tokens(mid)) == common_01
    assert len(tree.leaves()) == 9 and all(tree.graph.nodes[n]["gen_budget"] == 6 for n in tree.leaves())


def test_batch_simplify_dissolves_the_thin_node(tok):
    inputs = [{"question": q, "n": 3} for q in QUESTIONS]
    kept = solve.compile_batch(inputs, tokenizer=tok, min_shared_saving=None).tree
    simple = solve.compile_batch(inputs, tokenizer=tok, min_shared_saving=10_000).tree
    # the node shared by problems 0 and 1 saves (6 - 1) * a few tokens: dissolved; the few-shot root is
    # shared by 9 branches (8 * ~40 tokens): dissolved too at this threshold, so every problem is a root
    assert len(kept.live_nodes()) == len(simple.live_nodes()) + 2
    assert sorted(map(tuple, (simple.path_tokens(n) for n in simple.leaves()))) == \
        sorted(map(tuple, (kept.path_tokens(n) for n in kept.leaves())))


# running ----------------------------------------------------------------------------------------------
def test_batch_greedy_equals_each_program_alone_in_one_decode_phase(smol):
    inputs = [{"question": q} for q in QUESTIONS]
    roots = solve.run_batch(smol, inputs, seed=0, min_shared_saving=None)  # (the shared root stays shared)
    run = roots[0]._run
    assert all(r._run is run for r in roots)
    assert run.tree_run.decode_phases == [6]  # every program's 2 samples decoded together
    assert len([n for n in run.tree.graph if run.tree.parent(n) is None and not run.tree.graph.nodes[n]["pruned"]]) == 1
    for inp, root in zip(inputs, roots):
        alone = solve.run(smol, **inp, seed=0)
        assert root["answer"] == alone["answer"]
        assert [b.tokens() for b in root.vars["answer"].states] == [b.tokens() for b in alone.vars["answer"].states]


def test_batch_sampling_does_not_depend_on_batch_position(smol):
    q = QUESTIONS[1]
    alone = solve.run(smol, q, n=3, temperature=1.0, seed=7)["answer"]
    assert len(set(alone)) > 1  # the samples differ from each other
    batch = solve.run_batch(smol, [(QUESTIONS[0], 2, 1.0), (QUESTIONS[2], 4, 1.0), (q, 3, 1.0)], seed=7)
    assert batch[2]["answer"] == alone
    reordered = solve.run_batch(smol, [(q, 3, 1.0), (QUESTIONS[0], 2, 1.0)], seeds=[7, 3])
    assert reordered[0]["answer"] == alone
    assert reordered[1]["answer"] == solve.run(smol, QUESTIONS[0], n=2, temperature=1.0, seed=3)["answer"]


def test_batch_programs_that_read_values_pause_and_resume(smol):
    inputs = [{"question": q} for q in QUESTIONS]
    roots = reads_then_forks.run_batch(smol, inputs)
    assert len(roots[0]._run.tree_run.decode_phases) == 2  # first gens together, then the "more" gens
    for inp, root in zip(inputs, roots):
        alone = reads_then_forks.run(smol, **inp)
        assert (root["first"], root["more"]) == (alone["first"], alone["more"])


def test_batch_identical_inputs_share_everything(smol):
    roots = solve.run_batch(smol, [{"question": QUESTIONS[0]}] * 2 + [{"question": QUESTIONS[1]}])
    assert roots[0]["answer"] == roots[1]["answer"] == solve.run(smol, QUESTIONS[0])["answer"]
    assert roots[2]["answer"] == solve.run(smol, QUESTIONS[1])["answer"]


def test_batch_errors(smol):
    with pytest.raises(ValueError, match="2 seeds for 1 inputs"):
        solve.run_batch(smol, [{"question": "x"}], seeds=[1, 2])
    with pytest.raises(TypeError, match="dict of keyword arguments"):
        solve.run_batch(smol, ["x"])

    @treegen.program
    def broken(s, k):
        s += "Hi" + treegen.gen("a", max_tokens=2)
        s["a"]
        if k == 1:
            raise RuntimeError("program 1 failed")

    with pytest.raises(RuntimeError, match="program 1 failed"):
        broken.run_batch(smol, [{"k": 0}, {"k": 1}, {"k": 2}])


def test_ctrl_c_inside_a_program_stops_the_batch_not_the_program(smol):
    """Program bodies run on the driver's thread (coroutines), so Ctrl-C may arrive while one runs: it
    stops the batch (BatchInterrupted with the programs already done), it is not that program's error;
    the paused programs are ended, and the engine takes the next batch."""
    from treegen.lang.batch import BatchInterrupted

    @treegen.program
    def waits(s, k):
        s += FEW_SHOT + f"Q: {QUESTIONS[k % 3]}\nA:" + treegen.gen("a", max_tokens=2)
        s["a"]  # pause once
        if k == 2:
            raise KeyboardInterrupt

    with pytest.raises(BatchInterrupted) as caught:
        waits.run_batch(smol, [{"k": 0}, {"k": 1}, {"k": 2}, {"k": 3}])
    done = [r is not None for r in caught.value.results]
    assert done[:2] == [True, True] and done[2] is False  # resumed in program order: 0 and 1 had finished
    assert [r["a"] for r in waits.run_batch(smol, [{"k": 0}])] == [caught.value.results[0]["a"]]


def test_cooperative_hands_over_in_order_and_refuses_a_wait_outside_a_program():
    from treegen.lang.batch import Cooperative

    log = []
    sched = Cooperative([lambda i=i: (log.append((i, 0)), sched.wait(), log.append((i, 1))) for i in range(3)])
    assert not sched.in_program()
    with pytest.raises(RuntimeError, match="outside a running program"):
        sched.wait()
    for w in sched.workers:
        sched._switch(w)
        assert w.waiting and not w.done
    for w in reversed(sched.workers):
        sched._switch(w)
        assert w.done and w.error is None
    assert log == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]


# progress: programs done ------------------------------------------------------------------------------------
def test_programs_done_advances_as_each_program_finishes(smol):
    """A program is done once its function returned and everything it queued has run: here program 1
    (no reads) after the first flush, program 0 (one read) after the second, program 2 (two reads) at
    the end. Each report is checked against the programs' values at that moment."""
    roots, reports = {}, []

    @treegen.program
    def rounds(s, i, reads):
        roots[i] = s
        s += FEW_SHOT + f"Q: {QUESTIONS[i]}\nA:"
        for r in range(reads):
            s += treegen.gen(f"a{r}", max_tokens=2)
            s[f"a{r}"]  # wait for it
        s += treegen.gen("z", max_tokens=2) + "\n"  # queued when the function returns, text after it

    def on_programs(done, total):
        finished = tuple(isinstance(roots[i].vars.get("z"), str) and not roots[i].pending if i in roots else False
                         for i in range(3))
        reports.append((done, total, finished))

    rounds.run_batch(smol, [(0, 1), (1, 0), (2, 2)], on_programs=on_programs)
    assert reports == [(0, 3, (False, False, False)), (1, 3, (False, True, False)), (2, 3, (True, True, False)),
                       (3, 3, (True, True, True))]
    with pytest.raises(TypeError, match="on_programs must be a function"):
        rounds.run_batch(smol, [(0, 0)], on_programs=3)


def test_cli_progress_line_counts_programs_done(smol):
    from treegen.lang.tg import loads
    from treegen.render import TreeWatch

    prog = loads('param q = "x"\n"' + FEW_SHOT.replace("\n", "\\n") + 'Q: {q}\\nA:"\n'
                 'fork 2 {\ngen answer(max_tokens=3)\n}\njoin { answers = collect(answer) }')
    watch, seen = TreeWatch(), []

    def programs(done, total):
        watch.programs(done, total)
        seen.append(watch.describe(watch.sample() or (0, 0, 0), 12.0))

    prog.run_batch(smol, [{"q": q} for q in QUESTIONS], watch=watch, on_programs=programs)
    # each program is done as soon as its own branches are (they finish in the same step here)
    assert [line.split(" · ")[0] for line in seen] == [f"{k}/3 programs done" for k in range(4)]
    tokens, branches, generating = watch.sample()
    assert branches == 6 and generating == 0
    assert watch.describe((tokens, branches, 0), 12.0) == \
        f"3/3 programs done · running · 6 branches · {tokens} tokens · 12.0 tok/s"
    assert TreeWatch().describe((5, 1, 1), 0.0) == "generating 1/1 branch · 5 tokens · 0.0 tok/s"  # not a batch


# the .tg front end and the command line ---------------------------------------------------------------
def test_tg_run_batch_equals_runs_alone(smol):
    from treegen.lang.tg import loads

    prog = loads('param q = "x"\nparam n = 2\n"' + FEW_SHOT.replace("\n", "\\n") + 'Q: {q}\\nA:"\n'
                 'fork n {\ngen answer(max_tokens=4, temperature=0.8)\n}\njoin { answers = collect(answer) }')
    inputs = [{"q": q} for q in QUESTIONS]
    results = prog.run_batch(smol, inputs, seed=3)
    assert [r["answers"] for r in results] == [prog.run(smol, seed=3, **i)["answers"] for i in inputs]
    assert results[1].to_json()["parameters"] == {"q": QUESTIONS[1], "n": 2}


def _json_lines(text):
    """Every line a complete JSON object (what ``--json`` of a batch must always leave)."""
    import json

    assert text == "" or text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]
    assert all(isinstance(r, dict) for r in records)
    return records


def test_cli_run_batch(smol, tmp_path, capsys, monkeypatch):
    import json
    from pathlib import Path

    from treegen.cli import main

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    monkeypatch.setenv("COLUMNS", "200")
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("\n" + "\n".join(json.dumps({"problems": [q]}) for q in QUESTIONS[:2]) + "\n\n")
    example = Path(__file__).resolve().parents[1] / "examples" / "two_level.tg"
    out_json = tmp_path / "out.jsonl"
    code = main(["run", str(example), "--batch", str(inputs), "--var", "n=2", "--var", "max_tokens=3",
                 "--json", str(out_json), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = _json_lines(out_json.read_text())  # JSON Lines, in finish order
    data = sorted(records, key=lambda d: d["index"])
    assert [(d["index"], d["line"]) for d in data] == [(0, 2), (1, 3)]  # line numbers count the blank line
    assert [d["parameters"]["problems"] for d in data] == [[q] for q in QUESTIONS[:2]]
    assert all(d["parameters"]["n"] == 2 and "error" not in d for d in data)
    assert "input 2 of 2" in out and "2 programs ran" in err
    alone = main(["run", str(example), "--var", f"problems={json.dumps([QUESTIONS[1]])}", "--var", "n=2",
                  "--var", "max_tokens=3", "--json", "-", "--no-progress"])
    single = json.loads(capsys.readouterr()[0])  # without --batch: one JSON document, as before
    assert alone == 0 and single["variables"] == data[1]["variables"]
    # --json - : the lines go to stdout (and nothing else does)
    code = main(["run", str(example), "--batch", str(inputs), "--var", "n=2", "--var", "max_tokens=3",
                 "--json", "-", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(_json_lines(out), key=lambda d: d["index"]) == data
    inputs.write_text('{"problems": ["a"]}\n{"nope": 1}\n')
    code = main(["run", str(example), "--batch", str(inputs), "--no-progress"])
    err = capsys.readouterr()[1]
    assert code == 2 and "line 2: unknown parameter 'nope'" in err and err.startswith(f"{inputs}:2:1: ")
    inputs.write_text('{"problems": ["a"]}\n[1\n')
    code = main(["run", str(example), "--batch", str(inputs), "--no-progress"])
    assert code == 2 and "inputs.jsonl:2:" in capsys.readouterr()[1]


def test_cli_batch_lines_give_a_parameter_without_default(smol, tmp_path, capsys, monkeypatch):
    """A parameter with no default comes from each --batch line (before: refused before the lines were
    read, "give it a value (--var ...)"); a line without it names its line."""
    import json

    from treegen.cli import main

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    prog = tmp_path / "q.tg"
    prog.write_text('param question: str\n"Q: {question}\\nA:"\ngen a(max_tokens=2)\n')
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS[:2]) + "\n")
    code = main(["run", str(prog), "--batch", str(inputs), "--json", "-", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(d["parameters"]["question"] for d in _json_lines(out)) == sorted(QUESTIONS[:2])
    inputs.write_text(json.dumps({"question": "x"}) + "\n{}\n")
    code = main(["run", str(prog), "--batch", str(inputs), "--no-progress"])
    assert code == 2 and "line 2: parameter 'question' has no default" in capsys.readouterr()[1]


# a .tg program whose parameter k can make its join fail at run time (top_k needs k >= 1), after its
# branches were queued: the program fails alone
FAILS_WITH_K0 = ('param q = "x"\nparam k = 1\n"' + FEW_SHOT.replace("\n", "\\n") + 'Q: {q}\\nA:"\n'
                 'fork 2 {\n    gen answer(max_tokens=3)\n}\njoin { top = top_k(answer, by=answer, k=k) }\n')


def _cli_batch_files(tmp_path, lines):
    import json

    prog = tmp_path / "prog.tg"
    prog.write_text(FAILS_WITH_K0)
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join((json.dumps(x) if x is not None else "") + "\n" for x in lines))
    return prog, inputs


def test_cli_run_batch_a_failing_input(smol, tmp_path, capsys, monkeypatch):
    from treegen.cli import main

    from treegen.lang.batch import ProgramError
    from treegen.lang.tg.program import TgProgram, TgResult

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    monkeypatch.setenv("COLUMNS", "200")
    run_batch, raised = TgProgram.run_batch, []

    def spy(self, *args, **kwargs):
        try:
            return run_batch(self, *args, **kwargs)
        except ProgramError as e:
            raised.append(e)
            raise

    monkeypatch.setattr(TgProgram, "run_batch", spy)
    prog, inputs = _cli_batch_files(tmp_path, [{"q": QUESTIONS[0]}, None, {"q": QUESTIONS[1], "k": 0},
                                               {"q": QUESTIONS[2]}])
    out_json = tmp_path / "out.jsonl"
    code = main(["run", str(prog), "--batch", str(inputs), "--json", str(out_json), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "Traceback" not in out + err
    records = _json_lines(out_json.read_text())
    by_index = {r["index"]: r for r in records}
    assert len(records) == 3 and sorted(by_index) == [0, 1, 2]
    assert [by_index[i]["line"] for i in range(3)] == [1, 3, 4]
    bad = by_index[1]
    assert bad["error"].startswith("TgError: ") and "k must be an integer >= 1, got 0" in bad["error"]
    assert "variables" not in bad and bad["parameters"] == {"q": QUESTIONS[1], "k": 0}
    for i in (0, 2):  # the others finished and were written
        assert "error" not in by_index[i] and len(by_index[i]["variables"]["top"]) == 1
        assert by_index[i]["parameters"]["q"] == QUESTIONS[2 * (i > 0)]
    assert f"treegen: input {inputs}:3 (index 1) failed: TgError: " in err
    assert f"1 of 3 programs failed: {inputs}:3 (index 1)" in err and f"results are in {out_json}" in err
    assert "input 3 of 3" in out and "k must be an integer" in out
    # the ProgramError names the input by its line (describe), and carries every result
    (e,) = raised
    assert str(e).startswith(f"program 1 (input {inputs}:3) failed: TgError: ") and list(e.errors) == [1]
    assert all(isinstance(r, TgResult) for r in e.results) and [r.error is not None for r in e.results] == \
        [False, True, False]


def test_cli_run_batch_interrupted(smol, tmp_path, capsys, monkeypatch):
    """Ctrl-C (here raised in the batch's driver when the first program is done) exits 130 with one
    line, and OUT holds the finished program."""
    from treegen.cli import main
    from treegen.render import TreeWatch

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    monkeypatch.setenv("COLUMNS", "200")
    programs = TreeWatch.programs

    def ctrl_c(self, done, total):
        programs(self, done, total)
        if done == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(TreeWatch, "programs", ctrl_c)
    prog, inputs = _cli_batch_files(tmp_path, [{"q": q} for q in QUESTIONS])
    out_json = tmp_path / "out.jsonl"
    code = main(["run", str(prog), "--batch", str(inputs), "--json", str(out_json), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 130
    assert err == f"treegen: interrupted: 1 of 3 programs had finished; their results are in {out_json}\n"
    (record,) = _json_lines(out_json.read_text())
    assert "variables" in record and record["line"] == record["index"] + 1


def test_cli_run_batch_progress(smol, tmp_path, capsys, monkeypatch):
    """The progress display is fed programs done (not tokens) and nothing is printed per token."""
    from treegen.cli import main
    from treegen.render import TreeWatch

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    monkeypatch.setenv("COLUMNS", "200")
    programs, seen = TreeWatch.programs, []

    def record(self, done, total):
        programs(self, done, total)
        seen.append((self, done, total))

    monkeypatch.setattr(TreeWatch, "programs", record)
    prog, inputs = _cli_batch_files(tmp_path, [{"q": q} for q in QUESTIONS])
    code = main(["run", str(prog), "--batch", str(inputs)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [(done, total) for _, done, total in seen] == [(k, 3) for k in range(4)]
    watch = seen[-1][0]
    assert watch.tree is not None
    assert watch.describe(watch.sample(), 1.0).startswith("3/3 programs done · running · 6 branches · ")
    assert err.strip().count("\n") == 0 and "3 programs ran" in err  # only the summary: no per-token output


def test_cli_run_batch_max_program_tokens(smol, tmp_path, capsys, monkeypatch):
    """``--max-program-tokens N``: every program that generates more than N tokens in all fails alone with
    the limit named; a bad N is a usage error."""
    from treegen.cli import main

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    monkeypatch.setenv("COLUMNS", "200")
    prog, inputs = _cli_batch_files(tmp_path, [{"q": QUESTIONS[0]}, {"q": QUESTIONS[1]}])
    out_json = tmp_path / "out.jsonl"
    code = main(["run", str(prog), "--batch", str(inputs), "--json", str(out_json), "--no-progress",
                 "--max-program-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 1, err
    records = _json_lines(out_json.read_text())
    assert len(records) == 2 and all("past its limit max_program_tokens=2" in r["error"] for r in records), records
    with pytest.raises(SystemExit):
        main(["run", str(prog), "--max-program-tokens", "0"])
    assert "--max-program-tokens: must be a positive integer, got '0'" in capsys.readouterr().err


def test_cli_batch_from_standard_input_runs_each_line_as_it_comes(smol, tmp_path, capsys, monkeypatch):
    """``--batch -``: lines read from a pipe as they come; each result is written when its program is done
    (the same variables as from a file); a bad line fails its program alone, named by its line."""
    import io
    import json

    from treegen.cli import main

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: smol))
    prog = tmp_path / "q.tg"
    prog.write_text('param question: str\n"Q: {question}\\nA:"\ngen a(max_tokens=2)\n')
    lines = [json.dumps({"question": q}) for q in QUESTIONS[:2]]
    from_file = tmp_path / "in.jsonl"
    from_file.write_text("\n".join(lines) + "\n")
    assert main(["run", str(prog), "--batch", str(from_file), "--json", "-", "--no-progress"]) == 0
    want = sorted(_json_lines(capsys.readouterr()[0]), key=lambda d: d["index"])
    monkeypatch.setattr("sys.stdin", io.StringIO(lines[0] + "\n\n[1\n" + '{"nope": 1}\n' + lines[1] + "\n"))
    out_json = tmp_path / "out.jsonl"
    code = main(["run", str(prog), "--batch", "-", "--json", str(out_json), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 1
    got = {d["index"]: d for d in _json_lines(out_json.read_text())}
    assert [got[i]["line"] for i in range(4)] == [1, 3, 4, 5]
    assert got[0]["variables"] == want[0]["variables"] and got[3]["variables"] == want[1]["variables"]
    assert "line 3: not JSON" in got[1]["error"] and "unknown parameter 'nope'" in got[2]["error"]
    assert "input <stdin>:3 (index 1) failed" in err and "2 of 4 programs failed" in err
    code = main(["run", str(prog), "--batch", "-", "--dp", "2", "--no-progress"])
    assert code == 2 and "--batch - (inputs read as they come) runs on one process" in capsys.readouterr()[1]


def test_cli_batch_from_standard_input_names_the_line_and_key_that_do_not_bind():
    """``--batch -``: a line with an unknown key (or a value of the wrong type) fails as that line of standard
    input, naming the key and the program's parameters — not pointed at the .tg file's first parameter."""
    import io

    from treegen.cli import _StdinBatch
    from treegen.lang.tg import TgError, loads

    prog = loads('param question: str\nparam n = 2\n"Q: {question}"\n', "q.tg")
    got = list(_StdinBatch({"n": 3}, io.StringIO('{"question": "a"}\n\n{"nope": 1}\n{"question": 3}\n'), prog))
    assert got[0] == {"n": 3, "question": "a"}
    assert isinstance(got[1], TgError) and got[1].pos is None and str(got[1]) == \
        "--batch - line 3: unknown parameter 'nope'; this program takes question, n"
    assert isinstance(got[2], TgError) and got[2].pos is None and str(got[2]) == \
        "--batch - line 4: wrong type: parameter 'question' is a string, got 3"


def test_follow_ups_example_asks_unclear_votes_again_in_the_same_run(smol):
    """examples/follow_ups.py: problems from a queue drawn as the run goes; every vote below an agreement of
    1.01 (all of them) is asked again with twice the samples, joining the same run; the few-shot prefix is
    found in the tree by the later programs; a follow-up samples what it samples alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from follow_ups import FEW_SHOT, PROBLEMS, solve, solve_all

    inputs, roots, attached = solve_all(smol, PROBLEMS, n=2, agree=1.01, max_tokens=5, seed=4)
    assert len(roots) == 2 * len(PROBLEMS) and [x["n"] for x in inputs] == [2] * 3 + [4] * 3
    assert sorted(x["question"] for x in inputs[3:]) == sorted(PROBLEMS)
    assert attached >= (len(roots) - 1) * len(smol.tokenizer(FEW_SHOT, add_special_tokens=False).input_ids) // 2
    follow_up = inputs[-1]
    assert roots[-1].ret_value == solve.run(smol, seed=4 + len(roots) - 1, **follow_up).ret_value
