"""The .tg language lowers to the same IR as the Python DSL: the same program written in both front
ends gives isomorphic sharing trees, with the same join reductions recorded on their fork nodes
(compiled with the tokenizer only, no model)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import networkx as nx
import pytest

import treegen
from treegen.lang.tg import TgError, loads

FEW = "Q: Tom has 3 apples and buys 2 more. How many?\nA: 3 + 2 = 5. The answer is 5.\n\n"


def same_node(a, b):
    return (a["tokens"] == b["tokens"] and a["kind"] == b["kind"] and a["gen_budget"] == b["gen_budget"]
            and a.get("reductions") == b.get("reductions"))


def assert_same_tree(py_compiled, tg_compiled, min_nodes):
    g1, g2 = py_compiled.tree.graph, tg_compiled.tree.graph
    assert g1.number_of_nodes() >= min_nodes
    assert py_compiled.complete == tg_compiled.complete
    assert nx.is_isomorphic(g1, g2, node_match=same_node)


# 1. self-consistency ---------------------------------------------------------------------------------
@treegen.program
def self_consistency(s, question, n=4):
    s += FEW
    s += f"Q: {question}\nA:"
    b = s.fork(n)
    b += treegen.gen("solution", max_tokens=16, temperature=0.7, stop="\n\n")
    s.join(b, answer=treegen.vote("solution", extract=r"The answer is (\d+)"))


SELF_CONSISTENCY = r'''
param question = "Ann has 2 pens and gets 3 more. How many?"
param n = 4
"Q: Tom has 3 apples and buys 2 more. How many?\nA: 3 + 2 = 5. The answer is 5.\n\n"
"Q: {question}\nA:"
fork n { gen solution(max_tokens=16, temperature=0.7, stop="\n\n") }
join { answer = vote(solution, extract="The answer is (\d+)") }
'''


def test_self_consistency_trees_are_isomorphic(tokenizer):
    q = "Ann has 2 pens and gets 3 more. How many?"
    py = self_consistency.compile(q, n=5, tokenizer=tokenizer)
    tg = loads(SELF_CONSISTENCY).compile(tokenizer=tokenizer, n=5)
    assert tg.complete  # the vote is lazy: compiling needs no generated value
    assert_same_tree(py, tg, min_nodes=6)
    (fork,) = [d for _, d in tg.tree.graph.nodes(data=True) if "reductions" in d]
    assert fork["reductions"] == [{"name": "answer", "kind": "vote", "source": "solution", "by": None}]


# 2. two levels, per-branch content, include ------------------------------------------------------------
PROBLEMS = ["Ann has 2 pens and gets 3 more.", "A box has 4 rows of 6 eggs.", "Sam reads 12 pages a day for 3 days."]


@treegen.program
def two_level(s, problems, n):
    s += FEW
    b = s.fork(len(problems), content=[f"Q: {p}\nA:" for p in problems])
    inner = b.fork(n)
    inner += treegen.gen("solution", max_tokens=8)
    b.join(inner, answer=treegen.vote("solution"))
    s.join(b, answers=treegen.collect("answer"))


def test_two_level_trees_are_isomorphic(tokenizer, tmp_path):
    (tmp_path / "few.tg").write_text('"""\nQ: Tom has 3 apples and buys 2 more. How many?\n'
                                     'A: 3 + 2 = 5. The answer is 5.\n\n"""')
    main = tmp_path / "two_level.tg"
    main.write_text('''
param problems = ["x"]
param n = 3
include "few.tg"
fork problem in problems {
    "Q: {problem}\\nA:"
    fork n { gen solution(max_tokens=8) }
    join { answer = vote(solution) }
}
join { answers = collect(answer) }
''')
    tg = treegen.lang.tg.load(main).compile(tokenizer=tokenizer, problems=PROBLEMS, n=2)
    py = two_level.compile(PROBLEMS, 2, tokenizer=tokenizer)
    assert_same_tree(py, tg, min_nodes=1 + 3 + 6)


# 3. chat roles, a fork by index, text after a join -------------------------------------------------------
@treegen.program
def chat(s):
    s += treegen.system("Be brief.") + treegen.user("Name a colour.")
    b = s.fork(3, content=lambda i: treegen.assistant(f"Attempt {i}: " + treegen.gen("colour", max_tokens=5)))
    s.join(b)
    s += treegen.user("Thanks.")


CHAT = '''
system "Be brief."
user "Name a colour."
fork i in range(3) {
    assistant { "Attempt {i}: " gen colour(max_tokens=5) }
}
join
user "Thanks."
'''


def test_chat_trees_are_isomorphic(tokenizer):
    assert_same_tree(chat.compile(tokenizer=tokenizer), loads(CHAT).compile(tokenizer=tokenizer), min_nodes=5)


# 4. select -------------------------------------------------------------------------------------------------
@treegen.program
def choose(s):
    s += FEW + "Q: Is 5 odd?\nA:"
    b = s.fork(2, content=[" Yes or no?", " Answer:"])
    b += treegen.select("verdict", [" yes", " no", " maybe not"])
    s.join(b)


CHOOSE = r'''
"Q: Tom has 3 apples and buys 2 more. How many?\nA: 3 + 2 = 5. The answer is 5.\n\nQ: Is 5 odd?\nA:"
fork prompt in [" Yes or no?", " Answer:"] {
    "{prompt}"
    select verdict from [" yes", " no", " maybe not"]
}
join
'''


def test_select_trees_are_isomorphic(tokenizer):
    py, tg = choose.compile(tokenizer=tokenizer), loads(CHOOSE).compile(tokenizer=tokenizer)
    assert sum(d["kind"] == "choice" for _, d in tg.tree.graph.nodes(data=True)) == 6
    assert_same_tree(py, tg, min_nodes=9)


# 5. every reduction, k from a parameter --------------------------------------------------------------------
@treegen.program
def rate(s, k):
    s += FEW + "Q: 4 + 3?\nA:"
    b = s.fork(3)
    b += treegen.gen("solution", max_tokens=8) + "\nRating:" + treegen.gen("rating", max_tokens=2)
    s.join(b, every=treegen.collect("solution"), answer=treegen.vote("solution", extract=r"answer is (\d+)"),
           top=treegen.best("solution", by="rating"), two=treegen.top_k("solution", by="rating", k=k))


RATE = r'''
param k = 2
"Q: Tom has 3 apples and buys 2 more. How many?\nA: 3 + 2 = 5. The answer is 5.\n\nQ: 4 + 3?\nA:"
fork 3 {
    gen solution(max_tokens=8)
    "\nRating:"
    gen rating(max_tokens=2)
}
join {
    every = collect(solution)
    answer = vote(solution, extract="answer is (\d+)")
    top = best(solution, by=rating)
    two = top_k(solution, by=rating, k=k)
}
'''


def test_every_reduction_is_the_same_ir_node_in_both_front_ends(tokenizer, monkeypatch):
    from treegen.lang.state import State

    joins = []
    real_join = State.join
    monkeypatch.setattr(State, "join", lambda self, b, **r: joins.append(r) or real_join(self, b, **r))
    py = rate.compile(2, tokenizer=tokenizer)
    tg = loads(RATE, "rate.tg").compile(tokenizer=tokenizer, k=2)
    assert_same_tree(py, tg, min_nodes=4)
    (fork,) = [d for _, d in tg.tree.graph.nodes(data=True) if "reductions" in d]
    assert [(r["name"], r["kind"], r["by"]) for r in fork["reductions"]] == [
        ("every", "collect", None), ("answer", "vote", None), ("top", "best", "rating"), ("two", "top_k", "rating")]
    py_nodes, tg_nodes = joins
    assert py_nodes == tg_nodes  # equal Reduce nodes (k read from the parameter at the join)
    assert all(n.where is None for n in py_nodes.values())
    assert [str(n.where) for n in tg_nodes.values()] == [f"rate.tg:{line}:5" for line in (10, 11, 12, 13)]
    loads(RATE).compile(tokenizer=tokenizer, k=3)
    assert joins[-1]["two"].k == 3
    with pytest.raises(TgError, match=r"top_k\('solution'\): k must be an integer >= 1, got 0") as e:
        loads(RATE, "rate.tg").compile(tokenizer=tokenizer, k=0)
    assert (e.value.line, e.value.col) == (13, 40)


def test_a_different_program_is_not_isomorphic(tokenizer):
    """The comparison can fail: one changed budget or one changed word breaks it."""
    py = self_consistency.compile("Ann has 2 pens and gets 3 more. How many?", n=4, tokenizer=tokenizer)
    for change in [("max_tokens=16", "max_tokens=17"), ("Ann has 2", "Ann has 3"), ("fork n", "fork 3"),
                   ('vote(solution, extract="The answer is (\\d+)")', "collect(solution)"),
                   ("answer = vote", "winner = vote")]:
        assert change[0] in SELF_CONSISTENCY
        tg = loads(SELF_CONSISTENCY.replace(*change)).compile(tokenizer=tokenizer)
        assert not nx.is_isomorphic(py.tree.graph, tg.tree.graph, node_match=same_node), change


# parameters and values known only at run time ----------------------------------------------------------------
def test_parameters_are_checked_when_bound(tokenizer):
    prog = loads(SELF_CONSISTENCY, "sc.tg")
    with pytest.raises(TgError, match=r"unknown parameter 'm'; this program takes question, n") as e:
        prog.compile(tokenizer=tokenizer, m=3)
    assert str(e.value).startswith("sc.tg:2:1: ")
    with pytest.raises(TgError, match=r"wrong type: parameter 'n' is an integer, got '3'"):
        prog.bind({"n": "3"})
    with pytest.raises(TgError, match=r"wrong type: parameter 'n' is an integer, got True"):
        prog.bind({"n": True})
    assert prog.parse_vars(["n=7", "question=a=b"]) == {"n": 7, "question": "a=b"}
    with pytest.raises(TgError, match=r"parameter 'n' is an integer, got 'seven'"):
        prog.parse_vars(["n=seven"])
    with pytest.raises(TgError, match=r"write NAME=VALUE"):
        prog.parse_vars(["n"])
    with pytest.raises(TgError, match=r"unknown parameter 'q'"):
        prog.parse_vars(["q=1"])

    lists = loads('param xs: list\nparam t = 0.5\nfork x in xs { "{x} {t}" }')
    assert lists.parse_vars(['xs=["a", 2]', "t=1"]) == {"xs": ["a", 2], "t": 1.0}
    with pytest.raises(TgError, match=r"'xs' is a list of strings or numbers as JSON"):
        lists.parse_vars(["xs=a,b"])
    with pytest.raises(TgError, match=r"'xs' is a list of strings or numbers as JSON.*, got '3'"):  # (JSON, no list)
        lists.parse_vars(["xs=3"])
    with pytest.raises(TgError) as e:  # what was written, and what is expected, in this parameter's own words
        lists.parse_vars(["xs=3"])
    assert e.value.message == ("wrong type: parameter 'xs' is a list of strings or numbers as JSON, "
                               "e.g. --var xs='[\"a\", \"b\"]', got '3'")
    with pytest.raises(TgError, match=r"parameter 'xs' has no default: give it a value \(--var xs=\.\.\.\)"):
        lists.bind({})


def test_run_time_values_are_range_checked_with_positions(tokenizer):
    prog = loads(SELF_CONSISTENCY, "sc.tg")
    with pytest.raises(TgError, match=r"the number of branches must be an integer from 1 to 4096, got 0") as e:
        prog.compile(tokenizer=tokenizer, n=0)
    assert (e.value.line, e.value.col) == (6, 6)
    gen_param = loads('param m = 4\n"x"\ngen a(max_tokens=m)', "g.tg")
    with pytest.raises(TgError, match=r"gen\('a'\): max_tokens must be an integer >= 1, got -1") as e:
        gen_param.compile(tokenizer=tokenizer, m=-1)
    assert (e.value.line, e.value.col) == (3, 18)
    with pytest.raises(TgError, match=r"fork x in \.\.\. needs a list of 1 to 4096 items, got 0 items"):
        loads('param xs = ["a"]\nfork x in xs {}').compile(tokenizer=tokenizer, xs=[])


def test_compile_stops_where_a_generated_value_is_needed(tokenizer):
    prog = loads(SELF_CONSISTENCY + '"The answer is {answer}."\n', "sc.tg")
    compiled = prog.compile(tokenizer=tokenizer)
    assert not compiled.complete and compiled.stopped_at.startswith("sc.tg:8:")
    assert compiled.tree.graph.number_of_nodes() == 5  # the prompt and the 4 samples are known
