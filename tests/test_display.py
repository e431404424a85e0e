"""Notebook and terminal views (treegen.display), on a character tokenizer and a scripted engine: no model."""

import random
import time
import types

import pytest

import treegen
from treegen.display import Limits, TreeProgress, progress, show, votes
from treegen.display._view import subtree_totals, summarise
from treegen.display.html import compiled_html, program_html, result_html, tree_html
from treegen.display.results import own_text
from treegen.display.text import compiled_text, result_text
from treegen.lang import reduce
from treegen.runtime.requests import GenRequest, GenResult, Job
from treegen.tree.sharing_tree import KVShape, SharingTree


class CharTokenizer:
    """One token per character (id = code point); 0 is end-of-sequence."""

    bos_token_id = None
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return types.SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i)


class ScriptedRun:
    """Stands in for TreeRun: each gen writes " The answer is K." (cut to max_tokens), K from its key."""

    def __init__(self, engine):
        self.engine, self.tree, self.forward_passes = engine, SharingTree(), 0
        self.kv = types.SimpleNamespace(segments={}, offloaded={}, free=lambda node: None, release=lambda: None)
        self.queue = []
        self.host_seconds = {"programs": 0.0}

    def free(self, node):
        self.tree.prune(node)

    def submit(self, request, on_done=None, on_tokens=None):
        job = Job(request, on_done=on_done, on_tokens=on_tokens)
        self.queue.append(job)
        return job

    def busy(self):
        return bool(self.queue)

    def cancel(self, job):
        self.queue.remove(job)

    def advance(self, until=None):
        """Completes every queued job in one pass."""
        self.forward_passes += 1
        jobs, self.queue = self.queue, []
        for job in jobs:
            req = job.request
            if isinstance(req, GenRequest):
                text = f" The answer is {req.key % 3 + 4}."[: req.params.max_tokens]
                ids = [ord(c) for c in text]
                self.tree.extend(req.node, ids)
                job.result = GenResult(tuple(ids), text, "stop" if len(text) < req.params.max_tokens else "length")
            else:  # select: the shortest choice scores best
                job.result = [-len(self.tree.tokens(c)) / 10 for c in req.choices]
            job.done = True
            job.on_done(job)
        return jobs


class ScriptedEngine:
    attention = "tree"

    def __init__(self):
        self.tokenizer = CharTokenizer()
        self.kv_shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype_bytes=4)
        self.model = types.SimpleNamespace(eos_token_ids={0})
        self.runs = []

    def start(self):
        self.runs.append(ScriptedRun(self))
        return self.runs[-1]


@pytest.fixture
def engine():
    return ScriptedEngine()


@treegen.program
def two_level(s, problems, n=3):
    """Problems x samples."""
    s += "FEW SHOT <b>PREFIX</b>\n\n"
    per = s.fork(len(problems), content=[f"Q: {q}\nA:" for q in problems])
    samples = per.fork(n)
    samples += treegen.gen("reasoning", max_tokens=20, stop="\n", temperature=0.7)
    per.join(samples)
    s.join(per)


@treegen.program
def pick(s):
    s += "Is the sky blue? Answer:"
    s += treegen.select("answer", [" yes", " no", " maybe not"])
    s += " Because" + treegen.gen("why", max_tokens=12)


# the sharing tree ----------------------------------------------------------------------------------
def test_compiled_view_shows_the_tree_with_its_totals(engine):
    compiled = two_level.compile(["one?", "two?"], n=3, tokenizer=engine.tokenizer)
    html = compiled_html(compiled, engine.tokenizer, engine.kv_shape)
    st = compiled.tree.stats(engine.kv_shape)
    assert st.nodes == 9 and st.branches == 6
    assert "<svg" in html and "9 nodes" in html and "6 branches" in html
    assert f"{st.saving:.0%} saved" in html
    assert "Q: one?⏎A:" in html and "Q: two?⏎A:" in html  # excerpts
    assert "+ 20 to gen" in html  # the budget, before running
    assert "&lt;b&gt;PREFIX&lt;/b&gt;" in html and "<b>PREFIX</b>" not in html  # text is escaped
    text = compiled_text(compiled, engine.tokenizer, engine.kv_shape)
    assert "9 nodes, 6 branches" in text and text.count("+20 gen") == 6


def test_compiled_view_without_a_model_counts_tokens(engine):
    compiled = two_level.compile(["one?"], n=2, tokenizer=engine.tokenizer)
    html = compiled_html(compiled)  # neither tokenizer nor KV shape: ids and tokens
    assert "in tokens" in html and "KiB" not in html


@pytest.mark.parametrize("fan_out", [(1,), (3,), (9,), (40,), (2, 2, 2, 2, 2), (50, 100), (7, 1, 30)])
@pytest.mark.parametrize("limits", [Limits(), Limits(max_nodes=10, max_width=4, max_children=3)])
def test_summarised_tree_is_bounded_and_accounts_for_every_branch(fan_out, limits):
    tree = SharingTree()
    level = [tree.add_node(None, [1, 2, 3])]
    for k in fan_out:
        level = [tree.add_node(p, [4] * (1 + i % 3)) for p in level for i in range(k)]
    totals = subtree_totals(tree)
    view = summarise(tree, limits, totals)
    nodes = [view.nodes[k]["view"] for k in view]
    depth = {k: 0 for k in view if view.in_degree(k) == 0}
    for a, b in sorted(view.edges, key=lambda e: int(e[1][1:]) if e[1].startswith("n") else 10**9):
        depth[b] = depth.get(a, 0) + 1
    widths = {}
    for k in view:
        widths[depth.get(k, 0)] = widths.get(depth.get(k, 0), 0) + 1
    assert max(widths.values()) <= limits.max_width
    assert len(nodes) <= limits.max_nodes + limits.max_width
    # every branch is drawn, inside a summary, or hidden below a drawn node: counted exactly once
    drawn_leaves = sum(1 for v in nodes if v.node is not None and v.branches == 1 and not v.hidden
                       and not list(view.successors(v.key)) and not tree.children(v.node))
    summarised = sum(v.branches for v in nodes if v.node is None)
    hidden = sum(v.hidden_branches for v in nodes if v.node is not None)
    assert drawn_leaves + summarised + hidden == len(tree.leaves())


def test_large_trees_render_small_and_fast(engine):
    problems = [f"problem {i}?" for i in range(100)]
    start = time.perf_counter()
    compiled = two_level.compile(problems, n=50, tokenizer=engine.tokenizer)
    result = two_level.run(engine, problems, n=50)
    assert len(result.tree.leaves()) == 5000
    views = {
        "compiled": compiled_html(compiled, engine.tokenizer, engine.kv_shape),
        "result": result_html(result),
        "votes": votes(result, "reasoning", extract=r"answer is (\d+)")._repr_html_(),
        "tree": tree_html(result.tree, engine.tokenizer, engine.kv_shape),
    }
    assert time.perf_counter() - start < 30
    for name, html in views.items():
        assert len(html) < 100_000, (name, len(html))
    assert "5,101 nodes" in views["compiled"] and "5,000 branches" in views["compiled"]
    assert "more node" in views["compiled"]  # the drawing summarises
    assert "4,950 more values" not in views["result"] and "more lists not shown" in views["result"]
    assert len(compiled_text(compiled, engine.tokenizer, engine.kv_shape)) < 10_000
    assert len(result_text(result)) < 10_000


# results -------------------------------------------------------------------------------------------
def test_result_view_shows_branches_values_and_agreement(engine):
    result = two_level.run(engine, ["one?", "two?"], n=3)
    html = result_html(result)
    assert "list of 2 × 3" in html
    for st in result._run.states[3:]:  # every sample's label and value
        assert f"#{st.path[0]}.{st.path[1]}" in html and st.vars["reasoning"] in html
    assert "Q: one?⏎A:" in html  # each list's group is headed by its problem
    assert "branch states (9)" in html and "Executed sharing tree" in html
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    text = result_text(result)
    assert "reasoning: list of 2 x 3" in text and "#1.2" in text


def test_select_winner_scores_and_text_marks(engine):
    result = pick.run(engine)
    assert result["answer"] == " no"  # the scripted scores favour the shortest choice
    html = result_html(result)
    assert "✓ " in html and "mean log-prob" in html and "pruned" in html
    spans = own_text(result).spans
    assert (" no", "choice") in spans
    assert any(kind == "gen" for _, kind in spans)
    assert "scores: ' yes': -0.400" in result_text(result)


def test_views_never_run_the_model(engine):
    seen = {}

    @treegen.program
    def prog(s):
        s += "Hello"
        b = s.fork(2)
        b += treegen.gen("x", max_tokens=5)
        s.join(b, v=treegen.vote("x"))
        seen["html"], seen["text"] = result_html(s), result_text(s)  # x is still queued, v not computed
        seen["passes"] = s._run.tree_run.forward_passes

    s = prog.run(engine)
    assert seen["passes"] == 0
    assert "pending" in seen["html"] and "running" in seen["html"]
    assert "  x: list of 2\n" in seen["text"] and "  v = <pending>" in seen["text"]
    assert f"  v = {s['v']!r}  vote: {s['v']!r}×2" in result_text(s)  # settled when the program finished


def test_join_reductions_show_how_they_were_decided(engine):
    @treegen.program
    def voted(s):
        s += "Q: 2 + 2?\nA:"
        b = s.fork(6)
        b += treegen.gen("reasoning", max_tokens=20, temperature=0.7)
        s.join(b, answer=treegen.vote("reasoning", extract=r"answer is (\d+)"),
               top=treegen.best("reasoning", by="reasoning"), two=treegen.top_k("reasoning", by="reasoning", k=2))

    s = voted.run(engine, seed=1)
    texts = s["reasoning"]
    tally = reduce.tally(texts, r"answer is (\d+)")
    assert len(tally) > 1  # the scripted answers differ, so the views have something to show
    top, two = reduce.ranking(texts)[0], reduce.ranking(texts)[:2]
    text = result_text(s)
    assert f"  answer = {s['answer']!r}  vote: " + ", ".join(f"{a!r}×{c}" for a, c in tally.items()) in text
    assert f"  top = {s['top']!r}  best: branch #{top}" in text
    assert "  two = " in text and "top_k: branches " + ", ".join(f"#{i}" for i in two) in text
    html = result_html(s)
    assert f"vote: <b>{s['answer']}</b> with {tally[s['answer']]} of 6" in html
    assert html.count("<td>kept</td>") == 1 + 2  # best keeps one branch, top_k two
    assert html.count(f"<td>★ #{top}</td>") == 1 + (top in two) and f"<td>★ #{two[-1]}</td>" in html


@pytest.mark.parametrize("seed", range(5))
def test_votes_view_agrees_with_reduce_vote(seed):
    rng = random.Random(seed)
    values = [rng.choice(["The answer is 4.", "The answer is 5.", "no idea", "The answer is 12."]) for _ in range(9)]
    winner = reduce.vote(values, r"answer is (\d+)")
    view = votes(values, extract=r"answer is (\d+)")
    html = view._repr_html_()
    if winner is None:
        assert "★" not in html
    else:
        assert f'★ <span class="t" style="font-weight:700">{winner}</span>' in html
        assert repr(view).splitlines()[1].split()[1] == repr(winner)


def test_show_dispatches_and_rejects_others(engine):
    assert "parameter" in show(two_level)._repr_html_() and "two_level(problems, n=3)" in repr(show(two_level))
    assert "Problems x samples." in program_html(two_level)
    compiled = two_level.compile(["a"], tokenizer=engine.tokenizer)
    assert "KiB" in show(compiled, engine)._repr_html_()
    assert "<svg" in show(compiled.tree, engine)._repr_html_()
    with pytest.raises(TypeError, match="expected a Program"):
        show(42)
    with pytest.raises(ValueError, match="max_width"):
        Limits(max_width=1)


def test_class_hooks_render_through_the_registered_views(engine):
    """``import treegen`` registers display's views in treegen.lang.views; without them the hooks fall back."""
    from treegen.display import program_text, register_views
    from treegen.lang import views

    compiled = two_level.compile(["a"], n=2, tokenizer=engine.tokenizer)
    result = two_level.run(engine, ["a"], n=2)
    assert repr(two_level) == program_text(two_level) and two_level._repr_html_() == program_html(two_level)
    assert repr(compiled) == compiled_text(compiled) and compiled._repr_html_() == compiled_html(compiled)
    assert result._repr_html_() == result_html(result)
    pretty = pytest.importorskip("IPython.lib.pretty").pretty
    assert pretty(result) == result_text(result)
    try:
        for kind in views.KINDS:
            views.unregister_view(kind)
        assert repr(two_level) == "<treegen program two_level(problems, n=3)>"
        assert repr(compiled) == "<CompiledProgram (complete): 4 nodes, 2 branches>"
        assert pretty(result) == repr(result) and repr(result).startswith("State(path=()")
        assert two_level._repr_html_() is compiled._repr_html_() is result._repr_html_() is None
    finally:
        register_views()
    assert repr(two_level) == program_text(two_level)


# progress ------------------------------------------------------------------------------------------
class FakeBar:
    made = []

    def __init__(self, total, desc, unit, leave):
        self.total, self.desc, self.n, self.closed, self.postfix = total, desc, 0, False, {}
        FakeBar.made.append(self)

    def set_postfix(self, refresh=True, **kw):
        self.postfix = kw

    def refresh(self):
        assert 0 <= self.n <= self.total

    def close(self):
        self.closed = True


def test_progress_draws_one_full_bar_per_phase():
    FakeBar.made = []
    bars = TreeProgress(bar_factory=FakeBar)
    # phase 1: 3 branches of max 4 tokens; one stops after 2
    for live, done, budget in [(3, 0, 12), (3, 3, 12), (2, 6, 10), (2, 8, 10), (0, 10, 10)]:
        bars.on_step(live, done, budget)
    # phase 2: a continuation of 1 branch
    for live, done, budget in [(1, 1, 5), (1, 2, 5), (0, 3, 3)]:
        bars(live, done, budget)
    bars.on_step(0, 2, 2)  # phase 3: every branch ended at its first token: no bar
    bars.close()
    first, second = FakeBar.made
    assert first.total == 12 and first.n == 12 and first.closed and first.postfix == {"live": 0, "generated": 10}
    assert second.total == 5 and second.n == 5 and "phase 2" in second.desc


def test_progress_draws_programs_done_of_a_batch(engine):
    FakeBar.made = []
    with progress(engine, bar_factory=FakeBar) as bars:
        roots = two_level.run_batch(engine, [(["a?"], 2), (["b?", "c?"], 1)], on_programs=bars.programs,
                                    min_shared_saving=None)
        programs = FakeBar.made[0]
        assert (programs.desc, programs.total, programs.n, programs.closed) == ("programs done", 2, 2, False)
    assert programs.closed and [len(r) for r in roots[1]["reasoning"]] == [1, 1]


def test_progress_context_sets_and_restores_the_engine_hook(engine):
    engine.on_step = "before"
    with progress(engine, bar_factory=FakeBar) as bars:
        assert engine.on_step == bars.on_step
    assert engine.on_step == "before"


# IPython --------------------------------------------------------------------------------------------
@pytest.fixture
def ipython():
    pytest.importorskip("IPython", reason="the notebook extra is not installed: pip install -e '.[notebook]'")
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()  # one shell for the session, started on first use
    ip.run_line_magic("load_ext", "treegen.display")
    return ip


def test_formatters_fill_in_only_where_classes_have_no_html_hook(ipython):
    from treegen.lang.dsl import CompiledProgram, Program
    from treegen.lang.state import State

    printers = ipython.display_formatter.formatters["text/html"].type_printers
    for cls in (Program, CompiledProgram, State):
        assert (cls in printers) != (getattr(cls, "_repr_html_", None) is not None)


TG_SOURCE = '''
param n = 3
"Q: Ann has 2 pens and gets 3 more. How many?\\nA:"
fork n { gen solution(max_tokens=20, temperature=0.7, stop="\\n") }
join { answer = vote(solution, extract="The answer is (-?[0-9]+)") }
'''


def test_tg_cell_magic_shows_runs_and_reports_mistakes(ipython, engine):
    tg = pytest.importorskip("treegen.lang.tg", reason="the .tg front end (treegen.lang.tg) is absent")
    if not hasattr(tg, "loads"):
        pytest.skip("treegen.lang.tg has no loads(text, path)")
    from IPython.core.error import UsageError

    ipython.user_ns["engine"] = engine
    shown = ipython.run_cell_magic("treegen", "prog", TG_SOURCE)
    assert ".tg program" in shown._repr_html_() and "fork n" in shown._repr_html_()
    tree = ipython.run_cell_magic("treegen", "prog --tree n=2", TG_SOURCE)
    assert "3 nodes" in tree._repr_html_()
    ran = ipython.run_cell_magic("treegen", "--run --seed 1 prog n=4", TG_SOURCE)
    result = ipython.user_ns["result"]
    assert ipython.user_ns["prog"] is result.program and len(result["solution"]) == 4
    html = ran._repr_html_()
    assert "vote:" in html and "answer" in html and "parameters (1)" in html
    with pytest.raises(UsageError, match=r"<cell bad>:3:17: undefined variable 'z'"):
        ipython.run_cell_magic("treegen", "bad", "param n = 2\nfork n { gen x(max_tokens=3) }\njoin { y = vote(z) }")
    with pytest.raises(UsageError, match="no engine variable 'nope'"):
        ipython.run_cell_magic("treegen", "prog --run --engine nope", TG_SOURCE)
