"""Inputs that arrive while a batch runs (``run_batch`` over an iterator) and radix reuse of the live tree.

The tiny random GQA Llama of ``test_continuous`` (token ids are their own text), fp32 on the CPU.
"""

import queue
import threading
import time

import pytest
import torch

import treegen
from treegen import InputsFailed
from treegen.lang.batch import ProgramError
from treegen.runtime.engine import Engine
from treegen.runtime.kv_store import KVStore
from treegen.runtime.loader import IdTokenizer
from treegen.tree.passes import match_prefix
from treegen.tree.sharing_tree import SharingTree

from test_continuous import PREFIX, grows, inputs, model  # noqa: F401 - the module's model fixture


@pytest.fixture
def engine(model):  # noqa: F811
    return Engine(model, IdTokenizer())


@treegen.program
def samples(s, question, width=3, tokens=6, temperature=1.0):
    s += PREFIX + question
    b = s.fork(width)
    b += treegen.gen("a", max_tokens=tokens, temperature=temperature, ignore_eos=True)
    s.join(b)
    return s["a"]


# ---------------------------------------------------------------------------------------------------------
# the tree layer: a node split in two, the radix lookup


def test_split_puts_a_node_of_the_first_tokens_above_and_keeps_every_branch():
    tree = SharingTree()
    root = tree.add_node(None, [1, 2, 3, 4])
    a, b = tree.add_node(root, [5]), tree.add_node(root, [6, 7])
    before = {n: tree.path_tokens(n) for n in (a, b)}
    head = tree.split(root, 3)
    assert tree.tokens(head) == [1, 2, 3] and tree.tokens(root) == [4]
    assert tree.parent(root) == head and tree.roots() == [head]
    assert {n: tree.path_tokens(n) for n in (a, b)} == before
    with pytest.raises(ValueError, match="length must be in 1..0"):
        tree.split(root, 1)


def test_match_prefix_descends_whole_nodes_and_stops_inside_one():
    tree = SharingTree()
    shared = tree.add_node(None, [1, 2, 3])
    x = tree.add_node(shared, [4, 5, 6])
    tree.add_node(x, [7])
    tree.add_node(shared, [8, 9])
    everything = lambda n: True  # noqa: E731
    m = match_prefix(tree, [1, 2, 3, 4, 5, 0], everything)
    assert (m.parent, m.matched, m.partial, m.partial_length) == (shared, 3, x, 2)
    m = match_prefix(tree, [1, 2, 3, 4, 5, 6, 9], everything)  # the whole of x: below it
    assert (m.parent, m.matched, m.partial) == (x, 6, None)
    m = match_prefix(tree, [1, 2, 3], everything)  # one token is kept for the new node
    assert (m.parent, m.matched, m.partial, m.partial_length) == (None, 0, shared, 2)
    m = match_prefix(tree, [1, 2, 3, 4, 5, 6, 9], lambda n: n != x)  # x may not be used
    assert (m.parent, m.matched, m.partial) == (shared, 3, None)
    assert match_prefix(tree, [9, 1], everything).parent is None


def test_kv_split_divides_the_slots_without_copying():
    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", initial_slots=16)
    seg = kv.reserve(0, 10)
    seg.computed = 7
    start = seg.start
    kv.split(0, 1, 4)
    assert (kv.segments[1].start, kv.segments[1].capacity, kv.segments[1].computed) == (start, 4, 4)
    assert (kv.segments[0].start, kv.segments[0].capacity, kv.segments[0].computed) == (start + 4, 6, 3)
    assert not kv.can_split(0, 6) and kv.can_split(0, 5)  # (tokens past the segment's slots have none to give)
    kv.segments[0].dropped = 1  # sparse window attention compacted it: its slots are not in token order
    assert not kv.can_split(0, 2)
    with pytest.raises(RuntimeError, match="cannot be split"):
        kv.split(0, 2, 2)


# ---------------------------------------------------------------------------------------------------------
# run_batch over an iterator


def test_inputs_from_an_iterator_give_the_tokens_of_a_list_and_of_each_program_alone(engine):
    batch = inputs(40)
    for temperature in (0.0, 1.0):
        listed = grows.run_batch(engine, [dict(x, temperature=temperature) for x in batch], seed=3)
        drawn = grows.run_batch(engine, (dict(x, temperature=temperature) for x in batch), seed=3,
                                min_shared_saving=None)
        assert [r.ret_value for r in drawn] == [r.ret_value for r in listed]
        assert [r.program for r in drawn] == list(range(len(batch)))
        alone = grows.run(engine, **batch[29], temperature=temperature, seed=3)
        assert drawn[29].ret_value == alone.ret_value
    run = drawn[0]._run
    assert run.pass_report["attached_tokens"] >= 39 * len(engine.tokenizer(PREFIX).input_ids)


def test_a_later_program_reads_the_prefix_kv_an_earlier_one_computed(engine, monkeypatch):
    """The second input comes once the first program's prompt has KV (its first tokens are streamed): its
    prompt shares only the prefix of the first one's root, which is split there — same slots, nothing
    prefilled again — and its samples are those it draws alone."""
    first_tokens = threading.Event()

    def stream():
        yield {"question": " 11 12 13", "tokens": 30}
        assert first_tokens.wait(30)
        yield {"question": " 14 15"}

    splits = []
    split = KVStore.split

    def spy(kv, node, head, length):
        splits.append((kv.computed(node), length))
        split(kv, node, head, length)

    monkeypatch.setattr(KVStore, "split", spy)
    def on_tokens(stream):
        if not first_tokens.is_set():
            first_tokens.set()
            time.sleep(0.5)  # (the input thread hands the second input over before the next step)

    roots = samples.run_batch(engine, stream(), seed=2, min_shared_saving=None, on_tokens=on_tokens)
    assert len(splits) == 1 and splits[0][0] > splits[0][1]  # the node split held KV past the shared part
    run = roots[0]._run
    tree, prefix = run.tree, engine.tokenizer(PREFIX, add_special_tokens=False).input_ids
    shared = tree.path(roots[1].origin)[0]
    assert tree.tokens(shared) == prefix and shared == tree.path(roots[0].origin)[0]
    question = len(engine.tokenizer(" 14 15", add_special_tokens=False).input_ids)
    # the second program prefilled its question and conditioning rows, not the prefix again
    alone_rows = samples.run_batch(engine, [{"question": " 14 15"}], seed=2)[0]._run.tree_run.prefill_rows
    first_rows = samples.run_batch(engine, [{"question": " 11 12 13", "tokens": 30}], seed=2)[0]._run.tree_run.prefill_rows
    assert run.tree_run.prefill_rows <= first_rows + alone_rows - len(prefix) + 3  # (conditioning rows run again)
    assert question < len(prefix)
    assert roots[1].ret_value == samples.run(engine, question=" 14 15", seed=2).ret_value
    assert roots[0].ret_value == samples.run(engine, question=" 11 12 13", tokens=30, seed=2).ret_value


def test_finished_programs_ask_follow_ups_that_join_the_same_run(engine):
    """Programs that grow as the run goes: each answer queues a follow-up, the iterator is a queue."""
    todo: queue.Queue = queue.Queue()
    for q in (" 21", " 22", " 23"):
        todo.put({"question": q, "temperature": 0.0})
    asked = []

    def on_result(i, root):
        if len(asked) < 3:
            asked.append({"question": f" 9{len(asked)} " + root.ret_value[0].split()[-1], "temperature": 0.0})
            todo.put(asked[-1])
            if len(asked) == 3:
                todo.put(None)  # the end of the inputs

    roots = samples.run_batch(engine, iter(todo.get, None), on_result=on_result)
    assert len(roots) == 6 and all(len(r.ret_value) == 3 for r in roots)
    for root, follow_up in zip(roots[3:], asked):
        assert root.ret_value == samples.run(engine, **follow_up).ret_value


def test_an_idle_engine_waits_for_the_next_input(engine):
    def slow():
        for q in (" 31", " 32", " 33"):
            time.sleep(0.3)
            yield {"question": q, "tokens": 2}

    roots = samples.run_batch(engine, slow(), seed=1)
    assert [r.ret_value for r in roots] == [samples.run(engine, question=q, tokens=2, seed=1).ret_value
                                            for q in (" 31", " 32", " 33")]


def test_programs_start_only_while_the_engine_has_room(model):  # noqa: F811
    engine = Engine(model, IdTokenizer(), max_batch=4)
    seen = []
    roots = samples.run_batch(engine, ({"question": f" {40 + i}", "width": 2} for i in range(20)),
                              on_programs=lambda done, total: seen.append(total - done))
    assert len(roots) == 20 and all(len(r.ret_value) == 2 for r in roots)
    # two branches each: a program starts only while fewer than 2 x 4 rows decode or wait (ARRIVAL_BATCHES)
    assert max(seen) <= 4


def test_ready_inputs_fill_the_batch_from_the_first_step(model):  # noqa: F811
    engine = Engine(model, IdTokenizer(), max_batch=16)
    roots = samples.run_batch(engine, ({"question": f" {50 + i}", "width": 2, "tokens": 4} for i in range(24)))
    run = roots[0]._run.tree_run
    assert run.decode_phases[0] == 16, run.decode_phases  # (taken one a step, it grew 2, 4, 6, ...)


def test_a_bad_input_fails_its_program_alone_and_a_failing_iterator_keeps_what_started(engine):
    with pytest.raises(ProgramError) as e:
        samples.run_batch(engine, iter([{"question": " 1"}, 7, {"question": " 2"}]))
    assert list(e.value.errors) == [1] and "each input must be a dict" in str(e.value.errors[1])
    assert len(e.value.results[2].ret_value) == 3

    def broken():
        yield {"question": " 3"}
        raise OSError("the queue went away")

    with pytest.raises(InputsFailed, match="reading input 1 raised OSError: the queue went away") as e:
        samples.run_batch(engine, broken())
    assert len(e.value.results) == 1 and len(e.value.results[0].ret_value) == 3


def test_arriving_inputs_take_their_seeds_from_a_function_of_their_index(engine):
    with pytest.raises(ValueError, match="cannot be a list per input: give a function of the input's index"):
        samples.run_batch(engine, iter([{"question": " 1"}]), seeds=[1])
    questions = [" 71", " 72", " 71"]
    roots = samples.run_batch(engine, ({"question": q} for q in questions), seeds=lambda i: 10 + i)
    for i, q in enumerate(questions):
        assert roots[i].ret_value == samples.run(engine, question=q, seed=10 + i).ret_value
    assert roots[0].ret_value != roots[2].ret_value  # the same input, its own seed: other samples
    with pytest.raises(ProgramError) as e:  # a seed that is not an integer fails its program alone
        samples.run_batch(engine, ({"question": q} for q in questions), seeds=lambda i: "x" if i == 1 else i)
    assert list(e.value.errors) == [1] and "the seed of input 1 must be an integer, got 'x'" in str(e.value.errors[1])
    listed = samples.run_batch(engine, [{"question": q} for q in questions], seeds=lambda i: 10 + i)
    assert [r.ret_value for r in listed] == [r.ret_value for r in roots]
    with pytest.raises(TypeError, match="the seed of input 0 must be an integer, got True"):
        samples.run_batch(engine, [{"question": " 1"}], seeds=[True])


def test_ctrl_c_while_waiting_for_an_input_keeps_the_finished_programs(engine):
    import _thread

    from treegen.lang.batch import BatchInterrupted

    import signal

    never = threading.Event()

    def stalled():
        yield {"question": " 61"}
        never.wait(60)  # a producer that hands over no other input (for a minute: the test fails, not hangs)
        yield {"question": " 62"}

    # Ctrl-C as the terminal sends it (a process started in the background, as CI may, ignores SIGINT)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(3.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(BatchInterrupted, match="1 of 1 programs had finished") as e:
            samples.run_batch(engine, stalled())
    finally:
        timer.cancel()
        never.set()
        signal.signal(signal.SIGINT, handler)
    assert len(e.value.results) == 1 and len(e.value.results[0].ret_value) == 3


@treegen.program
def pick(s, question):
    s += PREFIX + question
    s += treegen.select("c", [" 7 8", " 9"])
    s += treegen.gen("a", max_tokens=3, ignore_eos=True)
    return s["c"], s["a"]


def test_a_later_program_beside_a_selects_choices_leaves_the_choice_to_its_own_nodes(engine):
    """The second program's prompt continues the first one's whole prompt, so it is attached below the node
    whose children are the first one's pending choices (a later id than theirs): the select still scores and
    keeps its own choices."""
    inputs = [{"question": " 5"}, {"question": " 5 6 7 8"}]
    roots = pick.run_batch(engine, iter(inputs), min_shared_saving=None)
    tree = roots[0]._run.tree
    assert tree.path(roots[1].origin)[0] == tree.path(roots[0].origin)[0]  # (attached below the first one's prompt)
    assert [r.ret_value for r in roots] == [pick.run(engine, **x).ret_value for x in inputs]


def test_bad_arguments_are_refused_before_any_input_is_drawn(engine):
    inputs = iter([{"question": " 1"}, {"question": " 2"}])
    with pytest.raises(TypeError, match="on_result must be a function"):
        samples.run_batch(engine, inputs, on_result=123)
    assert next(inputs) == {"question": " 1"}


def test_an_on_programs_that_raises_as_an_input_arrives_stops_the_batch_with_its_error(engine):
    def on_programs(done, total):
        if total == 2:
            raise KeyError("progress bar gone")

    with pytest.raises(KeyError, match="progress bar gone"):
        samples.run_batch(engine, iter([{"question": " 1"}, {"question": " 2"}]), on_programs=on_programs)


def test_a_collection_with_a_length_is_known_whole(engine):
    """(a dict's values, an array, a dataset: not drawn as the run goes — a list of seeds goes with them)"""
    roots = samples.run_batch(engine, {"a": {"question": " 81"}, "b": {"question": " 82"}}.values(), seeds=[3, 4])
    assert roots[1].ret_value == samples.run(engine, question=" 82", seed=4).ret_value
