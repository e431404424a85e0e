"""The treegen command line and the .tg examples, run on the embedded SmolLM2 (small budgets, CPU)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import treegen
from treegen.cli import main
from treegen.lang import reduce
from treegen.lang.tg import load, loads
from treegen.runtime.engine import Engine
from treegen.runtime.loader import load_config, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def engine():
    return Engine.load()


@pytest.fixture
def cached_engine(engine, monkeypatch):
    """``treegen run`` loads the model each time; reuse one engine across these tests."""
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: engine))
    return engine


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# check ------------------------------------------------------------------------------------------------
def test_check_accepts_the_examples(capsys):
    files = sorted(EXAMPLES.glob("*.tg"))
    assert {f.name for f in files} >= {"self_consistency.tg", "two_level.tg", "tree_of_thought.tg"}
    code, out, err = run_cli(capsys, "check", *files)
    assert code == 0 and err == ""
    assert out.count(": ok") == len(files) and "n: int = 5" in out


def test_check_reports_errors_on_stderr_with_exit_status_2(capsys, tmp_path):
    bad = tmp_path / "bad.tg"
    bad.write_text('param n = 3\nfork n {\n    gen answer(max_tokens=8)\n}\njoin { a = vote(answr) }\n')
    good = EXAMPLES / "self_consistency.tg"
    code, out, err = run_cli(capsys, "check", good, bad)
    assert code == 2
    assert out.startswith(f"{good}: ok")  # the good file is still checked and reported
    lines = err.rstrip("\n").split("\n")
    assert lines[0] == f"{bad}:5:17: undefined variable 'answr' (did you mean 'answer'?)"
    assert lines[1] == "    join { a = vote(answr) }" and lines[2] == "    " + " " * 16 + "^"
    code, out, err = run_cli(capsys, "check", tmp_path / "missing.tg")
    assert code == 2 and err.strip() == f"{tmp_path / 'missing.tg'}: no such file"


def test_check_takes_var_and_reports_values_the_program_cannot_use(capsys, tmp_path):
    """`check --var` (as `run` takes it): a value given for a count, k, a gen argument or a list to fork over
    that the program cannot use is an error at file:line:col of its use, exit 2 (it said ok)."""
    prog = tmp_path / "p.tg"
    prog.write_text('param n: int\nparam k = 1\nparam m = 4\nparam xs: list = ["a"]\n"Q"\n'
                    'fork n {\n  gen a(max_tokens=m)\n}\njoin { t = top_k(a, by=a, k=k) }\n'
                    'fork x in xs {\n  gen b(max_tokens=2)\n}\njoin\n')
    code, out, err = run_cli(capsys, "check", prog)
    assert code == 0 and out.startswith(f"{prog}: ok") and err == ""  # n has no default: known when run
    code, out, err = run_cli(capsys, "check", prog, "--var", "n=3", "--var", "k=2")
    assert code == 0 and out.startswith(f"{prog}: ok")
    for var, where, message in [
            ("n=0", "6:6", "the number of branches must be an integer from 1 to 4096, but parameter 'n' is given as 0"),
            ("n=5000", "6:6", "the number of branches must be an integer from 1 to 4096, but parameter 'n' is given as 5000"),
            ("k=0", "9:29", "top_k: k must be an integer >= 1, but parameter 'k' is given as 0"),
            ("m=0", "7:20", "gen a: max_tokens must be an integer >= 1, got 0 (parameter 'm' is given as 0)"),
            ("xs=[]", "10:11", "fork x in ... needs a list of 1 to 4096 items, but parameter 'xs' is given as []"),
            ("nn=1", "1:1", "unknown parameter 'nn'; this program takes n, k, m, xs"),
            ("k=two", "2:1", "wrong type: parameter 'k' is an integer, got 'two'")]:
        extra = ["--var", "n=2"] if not var.startswith("n=") else []
        code, out, err = run_cli(capsys, "check", prog, "--var", var, *extra)
        assert code == 2 and out == "", var
        assert err.split("\n")[0] == f"{prog}:{where}: {message}", var
    code, out, err = run_cli(capsys, "run", prog, "--var", "n=0", "--no-progress")  # run refuses it the same way
    assert code == 2 and err.split("\n")[0] == f"{prog}:6:6: the number of branches must be an integer from 1 to " \
        "4096, but parameter 'n' is given as 0"


def test_a_value_given_replaces_a_default_the_program_could_not_use(capsys, tmp_path):
    """A default is checked only where it is the value used: `check` alone refuses an empty list to fork over,
    `check --var` giving a list is ok, and loading the file (as `run --batch` does, whose lines may give the
    value) refuses nothing."""
    from treegen.lang.tg import load
    from treegen.lang.tg.errors import TgError

    prog = tmp_path / "p.tg"
    prog.write_text('param xs: list = []\nparam stop: str = ""\n"Q"\n'
                    'fork x in xs {\n  gen b(max_tokens=2, stop=stop)\n}\njoin\n')
    code, out, err = run_cli(capsys, "check", prog)
    assert code == 2 and err.split("\n")[0] == f"{prog}:4:11: fork x in ... needs a list of 1 to 4096 items, but " \
        "parameter 'xs' defaults to []"
    code, out, err = run_cli(capsys, "check", prog, "--var", 'xs=["a", "b"]')
    # the empty stop default is the value used: refused there, shown as written
    assert code == 2 and err.startswith(f"{prog}:5:28: gen b: stop must be a non-empty string or a list of them, "
                                        "got '' (parameter 'stop' defaults to '')")
    code, out, err = run_cli(capsys, "check", prog, "--var", 'xs=["a", "b"]', "--var", "stop=.")
    assert code == 0 and out.startswith(f"{prog}: ok"), err
    loaded = load(str(prog))  # (no error: values may still come)
    loaded.check_values({"stop": "."}, defaults=False)
    with pytest.raises(TgError, match="parameter 'xs' defaults to"):
        loaded.check_values({"stop": "."})


def test_help_and_usage_errors(capsys):
    for argv in (["--help"], ["check", "--help"], ["show", "--help"], ["run", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "usage: treegen" in out
        if argv == ["run", "--help"]:  # batch results are JSON Lines in the order programs finish
            assert "JSON Lines" in out and "finish order" in " ".join(out.split())
    for argv in ([], ["frobnicate"], ["run"], ["run", "x.tg", "--seed", "abc"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "usage: treegen" in capsys.readouterr().err


# show -------------------------------------------------------------------------------------------------
def test_show_prints_the_tree_and_the_saving(capsys):
    code, out, err = run_cli(capsys, "show", EXAMPLES / "two_level.tg", "--var", "n=3", "--var", "max_tokens=16")
    assert code == 0
    tokenizer = load_tokenizer()
    kv = treegen.KVShape.from_config(load_config(), 4)
    compiled = load(EXAMPLES / "two_level.tg").compile(tokenizer=tokenizer, n=3, max_tokens=16)
    stats = compiled.stats(kv)
    assert stats.branches == 9 and compiled.complete
    assert f"{100 * stats.saving:.1f} %" in out
    assert f"{stats.stored_tokens} tokens, each node once" in out
    assert f"{stats.unshared_tokens} tokens, every branch its own copy" in out
    assert len(re.findall(r"#\d+ ", out)) == compiled.tree.graph.number_of_nodes() == 1 + 3 + 9
    assert "+16 gen" in out and "9 branches" in out and "Q: Tom has 3 apples" in out
    assert f"{kv.bytes_per_token} B of KV per token (float32)" in out
    code, out, _ = run_cli(capsys, "show", EXAMPLES / "two_level.tg", "--var", "n=3", "--kv-dtype", "int8")
    kv8 = treegen.KVShape.from_config(load_config(), 1, 4)  # 8-bit values plus a 4-byte scale per token and head
    assert code == 0 and f"{kv8.bytes_per_token} B of KV per token (int8)" in out
    assert kv8.bytes_per_token < kv.bytes_per_token / 3  # 64 + 4 bytes a head instead of 256


def test_run_passes_the_kv_dtype_to_the_engine(capsys, monkeypatch, engine):
    seen = {}

    def load(cls, model=None, **kw):
        seen.update(kw)
        return engine

    monkeypatch.setattr(Engine, "load", classmethod(load))
    code, out, _ = run_cli(capsys, "run", EXAMPLES / "two_level.tg", "--var", "n=2", "--var", "max_tokens=2",
                           "--kv-dtype", "fp8", "--no-progress")
    assert code == 0 and seen["kv_dtype"] == "fp8"


def test_show_partial_tree_and_mistakes(capsys, tmp_path):
    code, out, err = run_cli(capsys, "show", EXAMPLES / "tree_of_thought.tg", "--max-children", "2")
    assert code == 0 and "partial tree" in out and "tree_of_thought.tg:" in out and "more nodes here" in out
    code, out, err = run_cli(capsys, "show", EXAMPLES / "self_consistency.tg", "--var", "n=many")
    assert code == 2 and "parameter 'n' is an integer, got 'many'" in err
    code, out, err = run_cli(capsys, "show", EXAMPLES / "self_consistency.tg", "--var", "m=1")
    assert code == 2 and "unknown parameter 'm'" in err
    code, out, err = run_cli(capsys, "show", EXAMPLES / "self_consistency.tg", "--model", tmp_path / "nope")
    assert code == 2 and err.startswith("treegen: error: model") and out == ""


# run --------------------------------------------------------------------------------------------------
def run_example(capsys, tmp_path, name, *vars, seed=0):
    out_json = tmp_path / f"{name}.json"
    argv = ["run", EXAMPLES / f"{name}.tg", "--seed", seed, "--json", out_json]
    for v in vars:
        argv += ["--var", v]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert f"{name}.tg (seed {seed})" in out
    return json.loads(out_json.read_text()), out


def test_run_self_consistency(capsys, tmp_path, cached_engine):
    data, out = run_example(capsys, tmp_path, "self_consistency", "n=3", "max_tokens=5", seed=1)
    assert data["parameters"]["n"] == 3 and data["seed"] == 1
    (fork,) = data["forks"]
    branches = fork["branches"]
    assert [b["index"] for b in branches] == [0, 1, 2] and fork["joined"]
    solutions = [b["variables"]["solution"] for b in branches]
    assert data["variables"]["solution"] == solutions
    assert data["variables"]["answer"] == reduce.vote(solutions, "The answer is (-?[0-9]+)")
    for b in branches:
        assert b["full_text"] == data["text"] + b["text"]  # the shared prompt, then the branch's own text
        assert b["info"]["solution"]["tokens"] <= 5
    assert data["text"].startswith("Q: Tom has 3 apples") and "Q: Ann has 7 pens" in data["text"]
    assert "fork n (3 branches, line 14)" in out and "answer = " in out


def test_run_two_level(capsys, tmp_path, cached_engine):
    data, out = run_example(capsys, tmp_path, "two_level", "n=2", "max_tokens=3")
    (problems,) = data["forks"]
    assert len(problems["branches"]) == 3
    for p in problems["branches"]:
        assert p["bindings"]["problem"] in p["text"]
        (samples,) = p["forks"]
        assert len(samples["branches"]) == 2
        assert p["variables"]["answer"] == reduce.vote([s["variables"]["solution"] for s in samples["branches"]],
                                                       "The answer is (-?[0-9]+)")
    assert data["variables"]["answers"] == [p["variables"]["answer"] for p in problems["branches"]]


def test_run_tree_of_thought(capsys, tmp_path, cached_engine):
    data, out = run_example(capsys, tmp_path, "tree_of_thought", "width=2", "keep=1", "max_tokens=3")
    level1, level2 = data["forks"]
    ideas = [b["variables"]["idea"] for b in level1["branches"]]
    ratings = [b["variables"]["rating"] for b in level1["branches"]]
    assert all(r in "12345" for r in ratings)
    assert data["variables"]["kept"] == reduce.top_k(ideas, ratings, 1)
    (expanded,) = level2["branches"]
    assert expanded["bindings"]["idea"] == data["variables"]["kept"][0]
    openings = [b["variables"]["opening"] for b in expanded["forks"][0]["branches"]]
    scores = [b["variables"]["rating"] for b in expanded["forks"][0]["branches"]]
    assert expanded["variables"]["best_opening"] == reduce.best(openings, scores)
    assert data["variables"]["openings"] == [expanded["variables"]["best_opening"]]
    assert data["text"].startswith("<|im_start|>system\nYou are a creative writing assistant.")


def test_run_json_to_stdout_and_failures(capsys, tmp_path, cached_engine):
    code, out, err = run_cli(capsys, "run", EXAMPLES / "self_consistency.tg", "--var", "n=1", "--var", "max_tokens=2",
                             "--json", "-")
    assert code == 0 and json.loads(out)["parameters"]["n"] == 1
    code, out, err = run_cli(capsys, "run", EXAMPLES / "self_consistency.tg", "--var", "n=0")
    assert code == 2 and "self_consistency.tg:14:6: the number of branches must be an integer from 1 to 4096" in err
    code, out, err = run_cli(capsys, "run", EXAMPLES / "self_consistency.tg", "--json", tmp_path / "no" / "x.json")
    assert code == 2 and "no such folder" in err


def test_tg_and_python_runs_agree(cached_engine):
    """Run the same program in both front ends: same tree, same generated values, same reductions
    (values, info, and the record on the tree's fork node)."""
    @treegen.program
    def py(s, n, k):
        s += "Q: Name a fruit.\nA:"
        b = s.fork(n, content=lambda i: f" ({i})")
        b += treegen.gen("fruit", max_tokens=4, temperature=1.0, top_k=20)
        b += " Rate it:" + treegen.select("rating", [" 1", " 2", " 3"])
        s.join(b, f=treegen.collect("fruit"), common=treegen.vote("fruit", extract=r"\w+"),
               top=treegen.best("fruit", by="rating"), two=treegen.top_k("fruit", by="rating", k=k))

    tg_prog = loads('param n = 2\nparam k = 2\n"Q: Name a fruit.\\nA:"\nfork i in range(n) {\n" ({i})"\n'
                    'gen fruit(max_tokens=4, temperature=1.0, top_k=20)\n" Rate it:"\n'
                    'select rating from [" 1", " 2", " 3"]\n}\n'
                    'join { f = collect(fruit) common = vote(fruit, extract="\\w+") top = best(fruit, by=rating) '
                    'two = top_k(fruit, by=rating, k=k) }')
    py_root = py.run(cached_engine, 3, 2, seed=5)
    tg_result = tg_prog.run(cached_engine, seed=5, n=3, k=2)
    assert tg_result["fruit"] == py_root["fruit"] == tg_result["f"]
    for name in ("f", "common", "top", "two", "rating"):
        assert tg_result[name] == py_root[name], name
    for name in ("f", "common", "top", "two"):
        assert tg_result.state.info[name] == py_root.info[name], name
    assert py_root.info["two"]["winners"] == reduce.ranking(py_root["rating"])[:2]
    assert tg_result.to_json()["info"]["common"]["votes"] == reduce.tally(py_root["fruit"], r"\w+")
    records = [[d["reductions"] for _, d in root.tree.graph.nodes(data=True) if "reductions" in d]
               for root in (py_root, tg_result.state)]
    assert records[0] == records[1] and len(records[0]) == 1 and len(records[0][0]) == 4
    node = lambda a, b: a["tokens"] == b["tokens"] and a["kind"] == b["kind"]  # noqa: E731
    assert nx.is_isomorphic(py_root.tree.graph, tg_result.state.tree.graph, node_match=node)


def test_a_reduction_failing_at_run_time_is_reported_at_its_position(capsys, tmp_path, cached_engine):
    bad = tmp_path / "bad.tg"
    bad.write_text('"Pick:"\nfork 2 {\n    fork 2 { gen x(max_tokens=1) }\n    join\n}\n'
                   "join { b = best(x, by=x) }\n")
    code, out, err = run_cli(capsys, "run", bad, "--no-progress")
    assert code == 2, err
    assert f"{bad}:6:8: reduction 'b' (best of 'x'): a score must be a number or text, got list" in err


def test_console_script_entry_point(tmp_path):
    """``python -m treegen`` (what the ``treegen`` script runs) exits 2 with a located error, no traceback."""
    bad = tmp_path / "bad.tg"
    bad.write_text("fork 2 {\n  gen x\n}\njoin { y = vote(x, extract=\"(\") }\n")
    proc = subprocess.run([sys.executable, "-m", "treegen", "check", str(EXAMPLES / "two_level.tg"), str(bad)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stdout.startswith(f"{EXAMPLES / 'two_level.tg'}: ok")
    assert proc.stderr.startswith(f"{bad}:4:28: vote: extract '(' is not a valid regular expression")
    assert "Traceback" not in proc.stderr
