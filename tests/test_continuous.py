"""Continuous execution on the CPU: programs resume as soon as their own work is done.

A tiny random GQA Llama whose token ids are their own text (``IdTokenizer``), so programs can be
built from ids and many of them run quickly.
"""

import random

import pytest
import torch

import treegen
from treegen.lang.batch import ProgramError
from treegen.runtime.engine import Engine
from treegen.runtime.loader import IdTokenizer
from treegen.runtime.model import LlamaFamilyModel


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaFamilyModel.random(cfg, dtype=torch.float32, device="cpu")


@pytest.fixture
def engine(model):
    return Engine(model, IdTokenizer())


def ids(rng, n):
    return " " + " ".join(str(rng.randrange(1, 300)) for _ in range(n))


PREFIX = ids(random.Random(7), 24)


@treegen.program
def grows(s, question, lengths, temperature=0.0):
    """Rounds of fork -> gen -> join -> read -> append; the next round's shape depends on the answers."""
    s += PREFIX + question
    for r, width in enumerate(lengths):
        b = s.fork(len(width))
        b += lambda i: treegen.gen("a", max_tokens=width[i], temperature=temperature, ignore_eos=True)
        s.join(b)
        answers = s["a"]
        s += " " + answers[0].split()[-1]  # a follow-up built from what was generated
    return [a.split() for a in s["a"]]


def inputs(n, seed=0):
    rng = random.Random(seed)
    return [{"question": ids(rng, rng.randint(1, 6)),
             "lengths": [[rng.randint(1, 9) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]}
            for _ in range(n)]


def test_a_dynamic_program_gives_the_same_tokens_alone_and_among_100_others(engine):
    batch = inputs(101)
    for temperature in (0.0, 1.0):
        roots = grows.run_batch(engine, [dict(x, temperature=temperature) for x in batch], seed=5)
        for k in (0, 37, 100):
            alone = grows.run(engine, **batch[k], temperature=temperature, seed=5)
            assert roots[k].ret_value == alone.ret_value
            assert roots[k].text() == alone.text()
        assert [len(r.ret_value) for r in roots] == [len(x["lengths"][-1]) for x in batch]


def test_programs_advance_without_waiting_for_the_others(engine):
    """A program with short gens finishes its three rounds while a long one still decodes its first:
    no batch-wide barrier, and its follow-up prefill rides along with the long branch's decode steps."""
    order = []
    fast = {"question": " 5", "lengths": [[2], [2], [2]]}
    slow = {"question": " 6", "lengths": [[40]]}
    roots = grows.run_batch(engine, [slow, fast], on_result=lambda i, root: order.append(i))
    assert order == [1, 0]
    tree_run = roots[0]._run.tree_run
    # the fast program's rounds ran beside the slow decode: their first prompt prefilled in a mixed step, each
    # later round (a fork after one appended token) joining a decode phase at its first step
    assert tree_run.mixed_steps >= 1 and tree_run.mixed_steps + tree_run.phase_joins >= 3
    assert tree_run.forward_passes <= 1 + 40 + 2  # the slow branch's steps, not slow + fast one after another
    assert roots[0].ret_value == grows.run(engine, **slow).ret_value
    assert roots[1].ret_value == grows.run(engine, **fast).ret_value


@treegen.program
def expands(s, question, widths, temperature=0.0):
    """A gen, then forks from its node: the first fork's only row is the gen's last token (no KV yet), later
    ones' the same token (its KV written by then)."""
    s += PREFIX + question
    s += treegen.gen("t", max_tokens=3, temperature=temperature, ignore_eos=True)
    for width in widths:
        b = s.fork(width)
        b += lambda i: treegen.gen("a", max_tokens=2 + 3 * i, temperature=temperature, ignore_eos=True)
        s.join(b)
        s["a"]
    return s["t"], s["a"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gens_forked_after_a_gen_join_a_decode_phase_with_the_same_tokens(engine, monkeypatch, temperature):
    """Forks whose only row is their conditioning token join a decode phase at its first step (one row writes
    the token's KV where it is missing, the others their own spare slot) instead of running a mixed step:
    the same tokens as with mixed steps, and as each program alone; fewer mixed steps."""
    rng = random.Random(4)
    batch = [{"question": ids(rng, rng.randint(1, 4)), "widths": [rng.randint(1, 3) for _ in range(rng.randint(1, 3))],
              "temperature": temperature} for _ in range(24)]
    got = {}
    for join in (True, False):
        monkeypatch.setenv("TREEGEN_JOIN_PHASES", "1" if join else "0")
        roots = expands.run_batch(engine, batch, seed=3)
        run = roots[0]._run.tree_run
        logprobs = [st.info["a"]["logprob"] for st in roots[0]._run.states if "logprob" in st.info.get("a", {})]
        got[join] = [r.ret_value for r in roots], logprobs, run.mixed_steps, run.phase_joins
    (joined, joined_lp, joined_mixed, joins), (mixed, mixed_lp, mixed_steps, no_joins) = got[True], got[False]
    assert joined == mixed and joined_lp == pytest.approx(mixed_lp, abs=1e-5)
    assert joins >= 24 and no_joins == 0 and joined_mixed < mixed_steps
    for k in (0, 11):
        assert expands.run(engine, **batch[k], seed=3).ret_value == joined[k]


def test_a_gen_cancelled_at_the_step_that_admits_it_joins_no_phase(model, monkeypatch):
    """A program whose fork holds a gen larger than the whole KV budget fails at the step that refuses it, which
    also admitted the fork's other gen (cancelled by the failure, in the same step): that gen joins no decode
    phase, no branch writes outside its node's range, and the other program ends as it does alone."""
    from treegen.runtime.decode import Decoder

    monkeypatch.setenv("TREEGEN_JOIN_PHASES", "1")

    @treegen.program
    def nested(s, q, big, small):
        s += PREFIX + q
        s += treegen.gen("t", max_tokens=3, ignore_eos=True)
        b = s.fork(1)
        c = b.fork(2)
        c += lambda i: treegen.gen("a", max_tokens=big if i else small, ignore_eos=True)
        b.join(c)
        s.join(b)
        return s["a"]

    cancelled, phase = [], Decoder.phase

    def watched(self, joining=()):
        done = [job for job in joining if job.done]  # (the phase starts when the loop next runs: after callbacks)
        cancelled.extend(done)
        yield from phase(self, joining)
        assert not any(job in self.jobs for job in done)  # no branch, no rows, no KV writes

    monkeypatch.setattr(Decoder, "phase", watched)
    per = Engine(model, IdTokenizer()).kv_shape.bytes_per_token
    for small, other in ((2, 3), (4, 6), (2, 12)):
        engine = Engine(model, IdTokenizer(), kv_budget_bytes=300 * per)
        with pytest.raises(ProgramError, match="program 0 failed: MemoryError") as e:
            nested.run_batch(engine, [dict(q=" 5 6", big=1000, small=small), dict(q=" 7 8", big=other, small=other)])
        alone = nested.run(Engine(model, IdTokenizer()), q=" 7 8", big=other, small=other)
        assert e.value.results[1].ret_value == alone.ret_value


def test_static_program_keeps_one_prefill_and_one_step_per_token(engine):
    @treegen.program
    def static(s, n):
        s += PREFIX
        b = s.fork(n)
        b += lambda i: treegen.gen("x", max_tokens=3 + i, ignore_eos=True)
        s.join(b)

    root = static.run(engine, 4)
    run = root._run.tree_run
    assert run.mixed_steps == 1 and run.forward_passes == 1 + 5  # prefill + first tokens, then 5 decode steps
    # scheduled only where a phase ends or a mixed step runs, never once per decode step
    assert run.schedule_calls <= run.mixed_steps + len(run.decode_phases) < run.forward_passes


def test_an_exception_in_one_program_leaves_the_others_results(engine):
    @treegen.program
    def sometimes(s, k):
        s += PREFIX + f" {k + 1}"
        s += treegen.gen("a", max_tokens=3, ignore_eos=True)
        s["a"]
        if k == 2:
            raise ValueError("bad input 2")
        b = s.fork(2)
        b += treegen.gen("b", max_tokens=4, ignore_eos=True)
        s.join(b)
        return k

    seen = []
    with pytest.raises(ProgramError, match=r"program 2 failed: ValueError: bad input 2; the other 4 programs finished") as e:
        sometimes.run_batch(engine, [{"k": k} for k in range(5)], on_result=lambda i, r: seen.append((i, r.error)))
    results = e.value.results
    assert [r.ret_value for r in results] == [0, 1, None, 3, 4]
    assert isinstance(results[2].error, ValueError) and set(e.value.errors) == {2}
    for k in (0, 1, 3, 4):
        assert results[k]["b"] == sometimes.run(engine, k)["b"]
    assert sorted(i for i, _ in seen) == [0, 1, 2, 3, 4]
    assert [i for i, err in seen if err is not None] == [2]


def test_a_program_that_never_stops_is_stopped_alone(engine):
    @treegen.program
    def forever(s, endless):
        s += PREFIX
        while True:
            s += treegen.gen("a", max_tokens=8, ignore_eos=True)
            s["a"]
            if not endless:
                return "done"

    with pytest.raises(ProgramError, match="program 1 generated 56 tokens, past its limit max_program_tokens=50") as e:
        forever.run_batch(engine, [{"endless": False}, {"endless": True}], max_program_tokens=50)
    assert e.value.results[0].ret_value == "done"


def test_a_request_larger_than_the_whole_budget_is_refused_with_its_size(model):
    engine = Engine(model, IdTokenizer(), kv_budget_bytes=100 * Engine(model, IdTokenizer()).kv_shape.bytes_per_token)

    @treegen.program
    def big(s, n):
        s += PREFIX
        s += treegen.gen("a", max_tokens=n, ignore_eos=True)

    assert len(big.run(engine, 10)["a"].split()) == 10
    with pytest.raises(MemoryError, match=r"gen \(node 0, max_tokens=200\) needs 224 tokens .* more than the whole KV budget of 100 tokens"):
        big.run(engine, 200)


def test_under_a_small_budget_a_stream_of_programs_never_exceeds_it(model):
    whole = Engine(model, IdTokenizer())
    batch = inputs(40, seed=3)
    want = grows.run_batch(whole, batch)
    per_token = whole.kv_shape.bytes_per_token
    budget = 400 * per_token
    roots = grows.run_batch(Engine(model, IdTokenizer(), kv_budget_bytes=budget), batch)
    scheduler = roots[0]._run.tree_run.scheduler
    assert scheduler.peak_slots * per_token <= budget < whole_peak(want) * per_token
    assert scheduler.memory_waits > 0
    assert [r.ret_value for r in roots] == [r.ret_value for r in want]


def whole_peak(roots):
    return roots[0]._run.tree_run.scheduler.peak_slots


def test_streamed_tokens_equal_the_final_result(engine):
    streams = {}

    def on_tokens(stream):
        key = (id(stream.state), stream.name)  # (paths repeat: every round forks from the root again)
        assert stream.tokens[: len(streams.get(key, ()))] == streams.get(key, ())  # only ever grows
        streams[key] = stream.tokens

    roots = grows.run_batch(engine, inputs(6, seed=9), on_tokens=on_tokens)
    finals = {}
    for st in roots[0]._run.states:
        if st.path and "a" in st.info and "tokens" in st.info["a"]:
            finals[(id(st), "a")] = st.vars["a"]
    assert set(streams) == set(finals)
    for key, tokens in streams.items():
        assert " ".join(map(str, tokens)) == finals[key]


def test_freed_programs_give_their_kv_back_while_others_run(engine):
    """A finished program's own nodes are freed at once; the shared prefix stays while others need it."""
    held = []

    def on_result(i, root):
        held.append(root._run.tree_run.kv.slots_reserved())

    batch = [{"question": " 1", "lengths": [[2]]}, {"question": " 2", "lengths": [[3], [30]]}]
    roots = grows.run_batch(engine, batch, on_result=on_result)
    run = roots[0]._run
    prefix_node = run.tree.path(roots[1].node)[0]
    assert held[0] < run.tree_run.scheduler.peak_slots
    assert prefix_node in run.tree.graph and len(held) == 2


def test_joined_branches_free_their_kv_and_a_failed_program_cancels_its_running_jobs(engine):
    """After a join a branch reads no more KV: its leaf is freed at once, not when its program ends.
    A program that fails while its other branches still decode has those jobs cancelled."""
    seen = {}

    @treegen.program
    def joins(s, fail):
        s += PREFIX
        b = s.fork(3)
        b += lambda i: treegen.gen("a", max_tokens=4 + 10 * i, ignore_eos=True)
        if fail:
            b[0]["a"]  # the shortest branch is done; the others still decode
            raise RuntimeError("stop here")
        s.join(b)
        s["a"]
        kv = s._run.tree_run.kv
        seen["leaves held"] = [st.node in kv.segments for st in b]
        seen["root held"] = s.node in kv.segments

    with pytest.raises(ProgramError, match="program 1 failed: RuntimeError: stop here") as e:
        joins.run_batch(engine, [{"fail": False}, {"fail": True}])
    assert seen == {"leaves held": [False, False, False], "root held": True}
    run = e.value.results[0]._run.tree_run
    assert not run.busy() and run.decoder.live == []
    assert e.value.results[0]["a"] == joins.run(engine, False)["a"]


@pytest.fixture(scope="module")
def sharp(model):
    """Weights large enough (std 1) that any wrong KV changes greedy tokens."""
    return Engine(LlamaFamilyModel.random(model.config, dtype=torch.float32, device="cpu", std=1.0), IdTokenizer())


@treegen.program
def one_prompt(s, text):
    s += PREFIX + text
    s += treegen.gen("c", max_tokens=4, ignore_eos=True)
    return s["c"], s.info["c"]["logprob"]


def test_text_queued_after_a_gen_gets_its_kv_computed(sharp):
    """The text is appended while the gen's phase still runs (its job completes mid-phase): its
    tokens must be prefilled, not counted as computed."""
    @treegen.program
    def chained(s):
        s += PREFIX
        s += treegen.gen("a", max_tokens=4, ignore_eos=True)
        s += " 5 6 7"
        s += treegen.gen("c", max_tokens=4, ignore_eos=True)
        return s["c"], s.info["c"]["logprob"]

    root = chained.run(sharp)
    want = one_prompt.run(sharp, " " + root["a"] + " 5 6 7").ret_value
    assert root.ret_value[0] == want[0] and root.ret_value[1] == pytest.approx(want[1], abs=1e-4)


def test_a_branch_done_while_its_phase_runs_on_keeps_its_kv(sharp):
    @treegen.program
    def forked(s, others):
        s += PREFIX
        b = s.fork(3)
        b += lambda i: treegen.gen("a", max_tokens=4 if i == 0 else others, ignore_eos=True)
        x = b[0]
        x["a"]
        x += " 5 6 7"
        x += treegen.gen("c", max_tokens=4, ignore_eos=True)
        return x["a"], x["c"]

    short, long = forked.run(sharp, 4).ret_value, forked.run(sharp, 12).ret_value
    assert short == long
    assert long[1] == one_prompt.run(sharp, " " + long[0] + " 5 6 7").ret_value[0]


def test_pruning_a_root_keeps_the_nodes_prefix_sharing_gave_another_program(sharp):
    @treegen.program
    def prog(s, k):
        s += PREFIX if k == 0 else PREFIX + " 5"  # program 0's prompt is a prefix of program 1's
        s += treegen.gen("a", max_tokens=2 if k == 0 else 12, ignore_eos=True)
        s["a"]
        if k == 0:
            s.prune()
            return None
        s += " 7"
        s += treegen.gen("c", max_tokens=4, ignore_eos=True)
        return s["a"], s["c"]

    assert prog.run_batch(sharp, [{"k": 0}, {"k": 1}])[1].ret_value == prog.run(sharp, 1).ret_value


def test_a_program_stopped_in_a_mixed_step_leaves_the_batch_running(sharp):
    """Program 0 passes its token limit when a 1-token gen completes in a mixed step while its other
    branch still decodes: that branch is cancelled and program 1 finishes as if alone."""
    @treegen.program
    def prog(s, k):
        if k == 0:
            s += PREFIX
            b = s.fork(2)
            b0, b1 = b[0], b[1]
            b1 += treegen.gen("long", max_tokens=60, ignore_eos=True)
            b0 += treegen.gen("a", max_tokens=45, ignore_eos=True)
            b0 += treegen.gen("z", max_tokens=1, ignore_eos=True)
            s.join(b)
            return s["z"]
        s += " 9 8 7 6 5 4 3 2 1"
        s += treegen.gen("a", max_tokens=12, ignore_eos=True)
        s["a"]
        s += " 11 12 13 14 15 16 17 18 19 20" * 3
        s += treegen.gen("c", max_tokens=30, ignore_eos=True)
        return s["a"], s["c"]

    with pytest.raises(ProgramError, match="program 0 failed: .* past its limit max_program_tokens=45") as e:
        prog.run_batch(sharp, [{"k": 0}, {"k": 1}], max_program_tokens=45)
    assert set(e.value.errors) == {0}
    assert e.value.results[1].ret_value == prog.run(sharp, 1).ret_value


def test_an_on_result_that_raises_stops_the_batch_with_its_error(engine):
    def on_result(i, root):
        raise OSError(f"disk full writing {i}")

    with pytest.raises(OSError, match="disk full writing"):
        grows.run_batch(engine, inputs(3), on_result=on_result)


def test_program_busy_answers_like_a_full_scan_under_any_order_of_completions():
    """``ProgramRun.program_busy`` starts its scan where it last found a busy state; under random completions
    (in order, reversed, shuffled) and states queued anew, it answers exactly as scanning every state would."""
    from types import SimpleNamespace

    from treegen.lang.program_run import ProgramRun

    rng = random.Random(0)
    for order in ("in_order", "reversed", "shuffled"):
        states = [SimpleNamespace(pending=[object()]) for _ in range(200)]
        run = SimpleNamespace(states_of={7: states}, _busy_hint={})
        finishing = list(range(200))
        if order == "reversed":
            finishing.reverse()
        elif order == "shuffled":
            rng.shuffle(finishing)
        for step, i in enumerate(finishing):
            states[i].pending = []
            if step % 37 == 5:  # a state queued anew (e.g. a follow-up gen)
                states[rng.randrange(200)].pending = [object()]
            assert ProgramRun.program_busy(run, 7) == any(st.pending for st in states)
        while any(st.pending for st in states):
            next(st for st in states if st.pending).pending = []
            assert ProgramRun.program_busy(run, 7) == any(st.pending for st in states)
        assert not ProgramRun.program_busy(run, 7) and not ProgramRun.program_busy(run, 8)


def test_a_finished_run_gives_its_kv_pool_back_while_its_results_live_on(engine):
    """The results hold their run; its pool's memory goes back when it finishes (a later run on the same
    engine is not squeezed by it), and what the results say stays readable."""
    batch = inputs(6, seed=3)
    roots = grows.run_batch(engine, batch)
    kv = roots[0]._run.tree_run.kv
    assert kv.num_slots == 0 and kv.k.untyped_storage().nbytes() == 0 and not kv.segments
    texts = [r.text() for r in roots]
    again = grows.run_batch(engine, batch)
    assert [r.text() for r in again] == texts and again[0]._run.tree_run.kv.num_slots == 0
    with pytest.raises(RuntimeError, match="nodes still hold slots"):
        store = again[0]._run.tree_run.kv
        store.reserve(1, 4)
        store.release()


def test_a_fault_of_the_engine_stops_the_batch_and_keeps_what_finished(engine, monkeypatch):
    """The engine raising mid-batch (not a program's error: here its loop, after some programs finished)
    stops the batch with EngineFailed — a ProgramError carrying every result: the programs finished before it
    as they are alone, the others failed with the engine's error — and frees the run's KV pool."""
    from treegen.runtime.tree_run import TreeRun

    want = grows.run_batch(engine, inputs(6))
    done_before: list[int] = []
    advance = TreeRun.advance

    def faulty(self, until=None):
        if len(done_before) >= 2:
            raise RuntimeError("device lost")
        return advance(self, until)

    monkeypatch.setattr(TreeRun, "advance", faulty)
    with pytest.raises(treegen.EngineFailed, match=r"the engine failed while running the batch: RuntimeError: "
                                                   r"device lost; 2 of 6 programs had finished") as e:
        grows.run_batch(engine, inputs(6), on_result=lambda i, root: done_before.append(i))
    assert isinstance(e.value, ProgramError) and str(e.value.__cause__) == "device lost"
    results = e.value.results
    assert len(results) == 6 and sorted(e.value.errors) == sorted(set(range(6)) - set(done_before))
    for i in done_before:
        assert results[i].error is None and results[i].ret_value == want[i].ret_value
    assert all(str(results[i].error) == "device lost" for i in e.value.errors)
    assert results[0]._run.tree_run.kv.num_slots == 0  # (the pool given back)


def test_an_on_tokens_that_raises_stops_the_batch_with_its_error_not_as_an_engine_fault(engine):
    def on_tokens(stream):
        raise OSError("socket closed")

    with pytest.raises(OSError, match="socket closed") as e:
        grows.run_batch(engine, inputs(3), on_tokens=on_tokens)
    assert not isinstance(e.value, treegen.EngineFailed)
