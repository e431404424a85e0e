"""Bad input gets a clear error naming what is wrong, raised in the caller."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re

import pytest

import treegen


def compile_body(body, tokenizer):
    return treegen.program(body).compile(tokenizer=tokenizer)


@pytest.mark.parametrize("n", [0, -2, 1.5, True])
def test_fork_needs_a_positive_integer(tokenizer, n):
    with pytest.raises(ValueError, match=r"fork\(n\): n must be an integer >= 1"):
        compile_body(lambda s: (s.__iadd__("x"), s.fork(n)), tokenizer)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, r"gen\('x'\): max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": -5}, r"max_tokens must be an integer >= 1, got -5"),
        ({"temperature": -0.1}, r"gen\('x'\): temperature must be a finite number >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, r"top_k must be an integer >= 0"),
        ({"stop": ""}, r"stop must be a non-empty string or a list of them, got ''$"),
        ({"seed": "a"}, r"seed must be an integer"),
        ({"stop": 5}, r"gen\('x'\): stop must be a non-empty string or a list of them, got 5"),
        ({"temperature": float("inf")}, r"temperature must be a finite number >= 0"),
        ({"top_p": True}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_gen_parameters_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        treegen.gen("x", **kwargs)


def test_gen_and_select_names_and_choices():
    with pytest.raises(ValueError, match="identifier"):
        treegen.gen("not a name")
    with pytest.raises(ValueError, match=r"select\('c'\): choices must be a non-empty list"):
        treegen.select("c", [])
    with pytest.raises(ValueError, match="choices must be"):
        treegen.select("c", "abc")


def test_join_without_fork(tokenizer):
    def body(s):
        s += "x"
        s.join(["not", "branches"])

    with pytest.raises(TypeError, match=r"join expects the branches returned by fork\(\), got list"):
        compile_body(body, tokenizer)

    def other_parent(s):
        s += "x"
        a = s.fork(2)
        a[0].join(a)

    with pytest.raises(ValueError, match="not forked from this state"):
        compile_body(other_parent, tokenizer)

    def twice(s):
        s += "x"
        a = s.fork(2)
        s.join(a)
        s.join(a)

    with pytest.raises(ValueError, match="already joined"):
        compile_body(twice, tokenizer)


def test_appending_to_a_joined_branch(tokenizer):
    def body(s):
        s += "x"
        a = s.fork(2)
        s.join(a)
        a[0] += "more"

    with pytest.raises(RuntimeError, match="joined"):
        compile_body(body, tokenizer)


def test_unset_variable_names_the_variable(tokenizer):
    def body(s):
        s += "x" + treegen.gen("answer", max_tokens=2)
        s["answr"]

    with pytest.raises(treegen.UnsetVariableError, match=r"variable 'answr' is not set \(set variables: answer\)"):
        compile_body(body, tokenizer)


def test_per_branch_list_length_and_bad_items(tokenizer):
    def body(s):
        s += "x"
        s.fork(3, content=["a", "b"])

    with pytest.raises(ValueError, match="2 items for 3 branches"):
        compile_body(body, tokenizer)
    with pytest.raises(TypeError, match="cannot append int"):
        compile_body(lambda s: s.__iadd__(42), tokenizer)


def test_user_errors_surface_in_the_caller(tokenizer):
    def body(s):
        s += "x"
        raise ZeroDivisionError("from the user's program")

    with pytest.raises(ZeroDivisionError, match="user's program"):
        compile_body(body, tokenizer)


def test_calling_a_program_directly_explains_run(tokenizer):
    with pytest.raises(TypeError, match=r"\.run\(engine"):
        treegen.program(lambda s: None)()


@pytest.mark.parametrize("options, error, message", [
    ({"attenton": "tree"}, TypeError, r"Engine.load got unknown option attenton; the options are attention, "),
    ({"kv_dtype": "int4"}, ValueError, r"kv_dtype must be one of None, 'int8', 'fp8'"),
    ({"offload": "disk"}, ValueError, r"offload must be one of"),
    ({"max_batch": 0}, ValueError, r"max_batch must be a positive integer or None, got 0"),
    ({"kv_keep": 2}, ValueError, r"kv_keep=\.\.\.\) must be a number in \(0, 1\]"),
    ({"offload": "off", "host_reserve_bytes": 1}, ValueError, r"no KV goes to the host"),
    ({"cuda_graphs": "yes"}, ValueError, r"cuda_graphs must be True or False"),
    ({"dtype": "float64x"}, ValueError, r"dtype must be one of float32, bfloat16, float16 .*got 'float64x'"),
    ({"dtype": "int8"}, ValueError, r"dtype must be one of"),
])
def test_engine_options_are_refused_before_the_model_loads(options, error, message, monkeypatch):
    """A bad option is refused by Engine.load before any weight is read (a large model takes minutes to load)."""
    from treegen.runtime import loader

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(loader, "load_model", never)
    monkeypatch.setattr(loader, "load_config", never)
    with pytest.raises(error, match=message):
        treegen.Engine.load(**options)


def test_a_gen_past_the_context_queued_last_is_raised_not_dropped(smol):
    """A program whose last op is a gen that can never run (prompt + max_tokens past the model's context):
    run raises its error (before: it returned with the variable still pending, the error lost)."""
    @treegen.program
    def too_long(s):
        s += "Once upon a time"
        s += treegen.gen("out", max_tokens=smol.model.max_context)

    with pytest.raises(ValueError, match="past the model's context"):
        too_long.run(smol)


def test_a_dtype_may_be_named():
    import torch

    from treegen.runtime.engine import model_dtype

    assert model_dtype("bfloat16") is torch.bfloat16 and model_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="got torch.int8"):
        model_dtype(torch.int8)


def test_a_vote_extract_is_checked_where_it_is_written():
    """A bad regex is refused when the vote is written, not when the join is read after every gen ran."""
    with pytest.raises(ValueError, match=r"vote\('x'\): extract '\(\[' is not a valid regular expression: "
                                         r"unterminated character set"):  # the pattern and why
        treegen.vote("x", extract="([")
    with pytest.raises(TypeError, match=r"vote\('x'\): extract must be a regex, a function .* got int"):
        treegen.vote("x", extract=5)
    assert treegen.vote("x", extract=str.upper).extract is str.upper
    pattern = re.compile(r"is (\d+)")  # a compiled pattern, as treegen.lang.reduce.extract takes it
    assert treegen.vote("x", extract=pattern).extract is pattern


def test_a_vote_node_made_directly_checks_its_extract():
    """The IR node itself refuses a bad regex (not only treegen.vote): what any front end builds is checked."""
    from treegen.lang.ir import Reduce

    with pytest.raises(ValueError, match=r"vote\('x'\): extract 'a\)' is not a valid regular expression"):
        Reduce("vote", "x", extract="a)")
    assert Reduce("vote", "x", extract=r"(\d+)").extract == r"(\d+)"

