"""The .tg language front end: syntax, strings, includes, and every user mistake as file:line:col + caret."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treegen.lang.tg import TgError, ast, loads, parse
from treegen.lang.tg.parser import parse_source

EVERYTHING = '''\
# every construct once
param question = "2 + 2?"
param n: int = 3
param names: list = ["a", "b"]
include "lib.tg"
"""
    Q: {question}
      indented {{literal}}
    """
system "Be brief."
user "Hi {question}"
assistant { "A: " gen answer(max_tokens=8, temperature=0.5, top_p=0.9, top_k=40, stop=["\\n", "."], seed=7) }
select tone from ["good", "bad"]
fork n {
    fork i in range(2) { "Try {i}:" gen t(max_tokens=2) }
    join { ts = collect(t) }
    select mood from ["good", "bad"]
}
join { best_t = best(ts, by=mood) }
fork name in names { "{name}" select yes from ["y", "n"] }
join { v = vote(yes, extract="(y)") top = top_k(yes, by=yes, k=1) }
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def parse_error(text, path="<t>") -> TgError:
    with pytest.raises(TgError) as info:
        loads(text, path)
    return info.value


def test_every_construct_parses_to_the_ast(tmp_path):
    write(tmp_path, "lib.tg", '"Few-shot.\\n"\n')
    main = write(tmp_path, "main.tg", EVERYTHING)
    f = parse(open(main).read(), main)
    kinds = [type(s).__name__ for s in f.body]
    assert kinds == ["Param"] * 3 + ["Include", "Text", "Message", "Message", "Message", "Select", "Fork", "Fork"]
    assert [p.name for p in f.params] == ["question", "n", "names"] and f.params[1].type == "int"
    inc = f.body[3]
    assert inc.resolved == os.path.join(str(tmp_path), "lib.tg") and inc.body[0].parts == ("Few-shot.\n",)
    text = f.body[4]
    assert text.parts[0] == "Q: " and text.parts[1].name == "question" and text.parts[2] == "\n  indented {literal}\n"
    assert (text.parts[1].pos.line, text.parts[1].pos.col) == (7, 9)  # the position of the name inside the string
    gen = f.body[7].body[1]
    assert isinstance(gen, ast.Gen) and [k.name for k in gen.args] == ["max_tokens", "temperature", "top_p", "top_k",
                                                                         "stop", "seed"]
    assert gen.args[4].value.items[0].value == "\n"
    outer = f.body[9]
    assert outer.kind == "count" and outer.source.name == "n" and outer.join.reductions[0].fn == "best"
    inner = outer.body[0]
    assert inner.kind == "range" and inner.var == "i" and inner.join.reductions[0].target == "ts"
    each = f.body[10]
    assert each.kind == "each" and [r.fn for r in each.join.reductions] == ["vote", "top_k"]
    assert each.join.reductions[0].kwargs[0].value.value == "(y)"
    assert (outer.pos.line, outer.pos.col) == (14, 1)
    loads(open(main).read(), main)  # and it type-checks


@pytest.mark.parametrize("source,value", [
    (r'"a\nb\t\"q\" \\ \d"', 'a\nb\t"q" \\ \\d'),       # escapes; unknown ones stay (regexes)
    ('"""\n    x\n      y\n    """', "x\n  y\n"),           # dedent, closing quotes on their own line
    ('"""one"""', "one"),
    ('"""a "quoted" b"""', 'a "quoted" b'),
    ('"""\n  a \\\n  b"""', "a b"),                          # backslash-newline joins lines
    ('""', None),
])
def test_strings(source, value):
    (text,) = parse_source(source)
    assert text.parts == ((value,) if value else ())


def test_interpolation_and_braces():
    (text,) = parse_source('"{{x}} {a}{b} }}{{ { c }"')
    assert [p if isinstance(p, str) else p.name for p in text.parts] == ["{x} ", "a", "b", " }{ ", "c"]
    (sel,) = parse_source('select s from ["{not interpolated}"]')
    assert sel.choices.items[0].value == "{not interpolated}"


def test_comments_and_layout_are_free():
    a = parse_source('fork 2 { gen x } join { y = collect(x) }')
    b = parse_source('# c\nfork 2   # two\n{\n  gen x  # note "quoted"\n}\njoin\n{\n y = collect(x)\n}\n')
    strip = lambda s: re.sub(r"pos=Pos\([^)]*\)", "", repr(s))  # noqa: E731
    assert strip(a) == strip(b)


SYNTAX_ERRORS = [
    ("gen", 1, 4, "a gen needs the name of the variable it sets"),
    ("gen x(3)", 1, 7, "gen parameters are written name=value"),
    ('select x ["a"]', 1, 10, "select is written"),
    ("fork { }", 1, 6, "fork is written"),
    ("fork 2 {} join { vote(x) }", 1, 22, "a join's reductions are written NAME = FUNCTION"),
    ("x = 3", 1, 1, "unexpected name 'x'; a statement starts with"),
    ('"abc', 1, 1, "this string is not closed"),
    ('fork 3 {\n  "a"\n', 3, 1, "a '{' is not closed by '}'"),
    ("@", 1, 1, "unexpected character '@'"),
    ("join", 1, 1, "join outside a fork"),
    ('"a" join { x = collect(y) }', 1, 5, "join outside a fork"),
    ("fork 2 {} join join", 1, 16, "this fork already has a join"),
    ('"a {x y}"', 1, 4, "{x y} is not a variable"),
    ('"}"', 1, 2, "a single '}' in text"),
    ('"a {x"', 1, 4, "not closed by '}'"),
    ("fork 2 {} join { x = f(a=1, 2) }", 1, 29, "a positional argument cannot follow a keyword argument"),
]


@pytest.mark.parametrize("source,line,col,message", SYNTAX_ERRORS)
def test_syntax_errors_point_at_the_mistake(source, line, col, message):
    e = parse_error(source, "prog.tg")
    assert (e.line, e.col) == (line, col), str(e)
    assert message in e.message
    first, src, caret = str(e).split("\n")
    assert first == f"prog.tg:{line}:{col}: {e.message}"
    assert src.strip() == source.split("\n")[line - 1].strip()
    assert caret == "    " + " " * (col - 1) + "^"


SEMANTIC_ERRORS = [
    ('"{answr}"', "undefined variable 'answr'"),
    ('gen answer "{answr}"', "undefined variable 'answr' (did you mean 'answer'?)"),
    ('fork 2 { gen x } "{x}"', "it is set inside the fork at line 1, which has no join"),
    ('fork 2 { gen x } join "{x}"', "wrong type: {x} is a list of string"),
    ("fork 0 {}", "the number of branches must be an integer from 1 to 4096, got 0"),
    ('param n = "3"\nfork n {}', "wrong type: the number of branches must be an integer, but 'n' is a string"),
    ("param n = 1.5\nfork i in range(n) {}", "the number of branches must be an integer, but 'n' is a float"),
    ("fork 2 { gen x } join { y = top_k(x, by=x, k=1.5) }", "top_k: k must be an integer, got 1.5"),
    ("fork x in [] {}", "needs a non-empty list"),
    ('param q = "a"\nfork x in q {}', "needs a list, but 'q' is a string"),
    ("gen x(max_tokens=0)", "gen x: max_tokens must be an integer >= 1, got 0"),
    ("gen x(temperature=-1)", "temperature must be a finite number >= 0"),
    ('gen x(top_p="a")', "top_p must be in (0, 1]"),
    ("gen x(maxtokens=3)", "unknown parameter 'maxtokens' for gen (did you mean 'max_tokens'?"),
    ("gen x(seed=1, seed=2)", "seed is given twice"),
    ('param s = "a"\ngen x(max_tokens=s)', "wrong type: max_tokens needs a int, but 's' is a string"),
    ("select x from []", "select needs a non-empty list of choices"),
    ('select x from ["a", ""]', "each choice must be a non-empty string"),
    ('select x from ["a", 1]', "each choice must be a non-empty string, got 1"),
    ('"x" param n = 1', "parameters are declared at the top of the file"),
    ('fork 2 { param n = 1 }', "param is only allowed at the top of the main file"),
    ("param n = 1\nparam n = 2", "parameter 'n' is declared twice"),
    ("param n: integer = 1", "unknown type 'integer'"),
    ('param n: int = "a"', "wrong type: the default of 'n' is a string, but it is declared int"),
    ("param n = [[1]]", "list items must be written as strings or numbers"),
    ("user { fork 2 {} }", "only text, gen and select can appear inside a user message"),
    ("fork 2 { gen x } join { y = mean(x) }", "unknown reduction 'mean'"),
    ('fork 2 { gen x } join { y = concat(x, sep=",") }',  # (not "did you mean 'collect'?")
     "concat is a reduction of the Python DSL only (treegen.concat); a join in .tg can use collect, vote, best, top_k"),
    ("fork 2 { gen x } join { y = vote(x, by=x) }", "unknown argument 'by' for vote(values, extract)"),
    ("fork 2 { gen x } join { y = best(x) }", "best needs by: best(values, by)"),
    ("fork 2 { gen x } join { y = vote(x, extract=\"(\") }", "vote: extract '(' is not a valid regular expression"),
    ('fork 2 { gen x } join { y = vote("x") }', "vote: values must be a variable"),
    ("gen x fork 2 {} join { y = vote(x) }", "vote needs a list (one value per branch), but 'x' is a string"),
    ("fork 2 { gen x } join { y = top_k(x, by=x, k=0) }", "top_k: k must be an integer >= 1, got 0"),
    ("fork 2 { fork 2 { gen x } join } join { y = vote(x) }", "vote needs a list of single values"),
    ("fork 2 { gen x } join { y = collect(x, x) }", "too many arguments"),
    ('param xs: list = ["a", "b"]\nfork 2 { gen x } join { y = best(x, by=xs) }',
     "best: by must be a variable the fork's branches set (one value per branch); 'xs' is not set inside this fork"),
    ("fork 2 { gen x } join { a = collect(x) b = vote(a) }", "vote: values must be a variable the fork's branches set"),
    ("fork 2 { gen x } join { x = collect(x) }", "'x' is set by the fork's branches (its joined list has that name)"),
    ("fork 2 { gen x } join { a = collect(x) a = vote(x) }", "'a' is set twice in this join"),
    ("fork 2 { gen x gen logprob } join { y = best(x, by=logprob) }", "by cannot read a variable named 'logprob'"),
]


@pytest.mark.parametrize("source,message", SEMANTIC_ERRORS)
def test_semantic_errors_are_reported_with_position(source, message):
    e = parse_error(source, "prog.tg")
    assert message in e.message, e.message
    assert re.match(r"prog\.tg:\d+:\d+: ", str(e)) and str(e).count("\n") == 2 and str(e).endswith("^")


def test_error_positions_of_semantic_mistakes():
    e = parse_error('param n = 2\nfork n {\n    "Q: {qestion}"\n}\n')
    assert (e.line, e.col) == (3, 10)
    e = parse_error("fork 2 {\n  gen x(max_tokens=0)\n}")
    assert (e.line, e.col) == (2, 20)


def test_includes(tmp_path):
    write(tmp_path, "lib/shots.tg", 'include "more.tg"\n"shot {q}\\n"\n')
    write(tmp_path, "lib/more.tg", '"more\\n"\n')
    main = write(tmp_path, "main.tg", 'param q = "x"\ninclude "lib/shots.tg"\n"{q}"\n')
    inc = loads(open(main).read(), main).file.body[1]
    assert [type(s).__name__ for s in inc.body] == ["Include", "Text"]
    assert inc.body[0].body[0].parts == ("more\n",)

    write(tmp_path, "a.tg", 'include "b.tg"\n')
    write(tmp_path, "b.tg", '"x"\ninclude "a.tg"\n')
    cyc = write(tmp_path, "c.tg", 'include "a.tg"\n')
    e = parse_error(open(cyc).read(), cyc)
    chain = e.message.removeprefix("include cycle: ").split(" -> ")
    assert [os.path.basename(p) for p in chain] == ["a.tg", "b.tg", "a.tg"]
    assert e.pos.source.path.endswith("b.tg") and (e.line, e.col) == (2, 1)

    e = parse_error('"x"\ninclude "missing.tg"', main)
    assert "include: no such file 'missing.tg'" in e.message and (e.line, e.col) == (2, 1)

    write(tmp_path, "p.tg", 'param z = 1\n')
    e = parse_error('include "p.tg"', main)
    assert "an included file cannot declare parameters" in e.message and e.pos.source.path.endswith("p.tg")

    write(tmp_path, "bad.tg", '"ok"\ngen\n')
    e = parse_error('include "bad.tg"', main)
    assert e.pos.source.path.endswith("bad.tg") and e.line == 3  # errors point into the included file

    write(tmp_path, "uses.tg", '"{undefined_here}"')
    e = parse_error('include "uses.tg"', main)
    assert "undefined variable 'undefined_here'" in e.message and e.pos.source.path.endswith("uses.tg")


def test_include_sees_the_scope_it_is_included_in(tmp_path):
    write(tmp_path, "q.tg", '"Q: {problem}\\n"')
    main = write(tmp_path, "m.tg", 'fork problem in ["a", "b"] { include "q.tg" gen x } join')
    loads(open(main).read(), main)


# fuzzing --------------------------------------------------------------------------------------------
WORDS = ["param", "include", "gen", "select", "from", "fork", "in", "range", "join", "system", "user", "assistant",
         "x", "n", "vote", "best", "top_k", "collect", "extract", "by", "k", "max_tokens", "stop", "{", "}", "(", ")",
         "[", "]", "=", ",", ":", "int", "list", "0", "1", "2", "-3", "1.5", '"a"', '"{x}"', '"{n}"', '"{{"', '"}"',
         '"""m\n  l"""', '"\\n"', '"(\\d+)"', "# c\n", "\n", '"unterminated', "@", "x=", "include \"nope.tg\""]


def check_outcome(text):
    try:
        loads(text, "<fuzz>")
    except TgError as e:
        rendered = str(e)
        assert re.match(r"<fuzz>:\d+:\d+: \S", rendered), rendered
        assert e.line >= 1 and e.col >= 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=120))
def test_fuzz_any_text_parses_or_raises_tgerror(text):
    check_outcome(text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(WORDS), max_size=30).map(" ".join))
def test_fuzz_token_soup_parses_or_raises_tgerror(text):
    check_outcome(text)


def test_deep_nesting_is_an_error_not_a_crash():
    check_outcome("fork 1 { " * 400 + "}" * 400)
    check_outcome("param x = " + "[" * 2000)


NAMES = st.sampled_from(["x", "y", "n", "i", "item", "best_x"])


@st.composite
def statements(draw, depth=0):
    """Mostly well-formed statements with random names, so many programs pass the checker."""
    kinds = ["text", "gen", "select", "message"] + (["fork"] * 2 if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    name = draw(NAMES)
    if kind == "text":
        return draw(st.sampled_from(['"plain "', f'"Q: {{{name}}}\\n"', '"""\n  a\n  """']))
    if kind == "gen":
        args = draw(st.sampled_from(["", "(max_tokens=2)", "(max_tokens=n)", '(stop=["\\n"], temperature=0.5)',
                                     "(max_tokens=0)", "(top_k=i)"]))
        return f"gen {name}{args}"
    if kind == "select":
        return f'select {name} from ' + draw(st.sampled_from(['["a", "b"]', "x", "[]"]))
    if kind == "message":
        role = draw(st.sampled_from(["system", "user", "assistant"]))
        inner = draw(st.sampled_from(['"hi"', f"{{ gen {name}(max_tokens=1) }}", '{ "a" select z from ["1", "2"] }']))
        return f"{role} {inner}"
    spec = draw(st.sampled_from(["2", "n", f"{name} in range(2)", f'{name} in ["p", "q"]', f"{name} in x", "0"]))
    body = " ".join(draw(st.lists(statements(depth + 1), max_size=3)))
    join = draw(st.sampled_from(["", "join", "join { best_x = best(x, by=x) }", "join { y = vote(x, extract=\"(a)\") }",
                                 "join { y = top_k(x, by=x, k=1) }", "join { y = collect(x) }"]))
    return f"fork {spec} {{ {body} }} {join}"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(statements(), max_size=5).map(lambda xs: 'param n = 2\n' + "\n".join(xs)))
def test_fuzz_generated_programs_compile_or_raise_tgerror(tokenizer, text):
    """Programs that pass the checker also compile (lowering and tracing raise nothing but TgError)."""
    try:
        prog = loads(text, "<fuzz>")
    except TgError as e:
        assert re.match(r"<fuzz>:\d+:\d+: \S", str(e)), str(e)
        return
    try:
        prog.compile(tokenizer=tokenizer)
    except TgError as e:
        assert re.match(r"<fuzz>:\d+:\d+: \S", str(e)), str(e)


def test_branches_that_set_a_variable_again_are_joined_while_tracing(tokenizer):
    """Found by the fuzz test: a gen inside the fork sets ``x`` again; tracing (compile, no model) must see
    the branches set it (it held one shared pending marker, so the join thought they set nothing)."""
    prog = loads("param n = 2\ngen x\nfork 2 { gen x } join { best_x = best(x, by=x) }", "<t>")
    assert prog.compile(tokenizer=tokenizer).complete




@pytest.mark.parametrize("source, col, message", [
    ('param n = 0\n"x"\nfork n {\n  gen a(max_tokens=2)\n}\njoin { all = collect(a) }\n', 6,
     "the number of branches must be an integer from 1 to 4096, but parameter 'n' defaults to 0"),
    ('param k = 0\n"x"\nfork 2 {\n  gen a(max_tokens=2)\n}\njoin { t = top_k(a, by=a, k=k) }\n', 29,
     "top_k: k must be an integer >= 1, but parameter 'k' defaults to 0"),
])
def test_a_parameter_default_out_of_range_is_a_program_mistake(source, col, message):
    """`treegen check` (no model) refuses what `show` and `run` would: a count or k whose default is out of range
    (where it is the value used: ``check_values`` without that parameter; loading alone does not, a value may come)."""
    prog = loads(source)
    with pytest.raises(TgError, match=re.escape(message)) as e:
        prog.check_values({})
    assert e.value.pos.col == col


@pytest.mark.parametrize("source, col, message", [
    ('param m = 0\n"x"\ngen a(max_tokens=m)\n', 18,
     "gen a: max_tokens must be an integer >= 1, got 0 (parameter 'm' defaults to 0)"),
    ('param t = -1\n"x"\ngen a(temperature=t)\n', 19, "gen a: temperature"),
    ('param r = "(a"\n"x"\ngen a(regex=r)\n', 13, "gen a: "),
    ('param xs: list = []\n"x"\nfork x in xs {\n  gen a(max_tokens=2)\n}\njoin\n', 11,
     "fork x in ... needs a list of 1 to 4096 items, but parameter 'xs' defaults to []"),
    ('param cs: list = [""]\n"x"\nselect c from cs\n', 15,
     "select needs a non-empty list of non-empty strings, but parameter 'cs' defaults to ['']"),
])
def test_a_parameter_default_a_gen_fork_or_select_cannot_use_is_a_program_mistake(source, col, message):
    """A parameter's default read by a gen argument, a fork over a list or a select is checked there as a
    literal written there would be (it was checked only when lowered, so `treegen check` said ok)."""
    prog = loads(source)
    with pytest.raises(TgError, match=re.escape(message)) as e:
        prog.check_values({})
    assert e.value.pos.col == col
