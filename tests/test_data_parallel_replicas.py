"""Data parallel from a plain process (this pytest process loads only the tokenizer and starts the
replica processes itself, on the CPU): the tokens of one process, results in input order and
``on_result`` per program as they finish, ``.tg`` programs and the command line; a program that fails
fails alone; a program that cannot be pickled, and bad layouts, are refused before anything runs;
Ctrl-C keeps what finished; a replica that raises or dies fails the call promptly with its error and
keeps the results finished before it, and no process is left behind."""

import json
import multiprocessing
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import treegen
from distributed_programs import PROBLEMS, Unloadable, die_in_replica, problem, refuse, workload
from test_distributed import checkpoint, one_process  # noqa: F401 - the shared fixtures
from treegen.lang.batch import BatchInterrupted, ProgramError
from treegen.lang.dsl import run_batch
from treegen.runtime.engine import Engine
from treegen.runtime.replicas import FAULT_ENV, ReplicatedEngine
from treegen.runtime.workers import WorkerError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def replicated(checkpoint):  # noqa: F811
    engine = Engine.load(str(checkpoint), data_parallel=2)
    yield engine
    engine.close()
    assert not any(p.is_alive() for p in engine.replicas.processes)


@pytest.fixture(scope="module")
def one_engine(checkpoint):  # noqa: F811
    return Engine.load(str(checkpoint))


def tokens(results) -> list:
    return [(r["x"], r["greedy"], r.tokens()) for r in results]


def test_two_replicas_generate_the_tokens_of_one_process(replicated, one_process, one_engine):  # noqa: F811
    assert isinstance(replicated, ReplicatedEngine) and replicated.data_parallel == 2
    assert workload(replicated) == one_process  # a program alone (on one replica) and a two-level batch
    seen, progress = [], []
    results = problem.run_batch(replicated, PROBLEMS, seed=3, on_result=lambda i, r: seen.append((i, r)),
                                on_programs=lambda done, total: progress.append((done, total)))
    assert tokens(results) == tokens(problem.run_batch(one_engine, PROBLEMS, seed=3))  # in input order
    assert sorted(i for i, _ in seen) == list(range(len(PROBLEMS)))  # once per program ...
    assert all(results[i] is r for i, r in seen)  # ... with the root that is returned
    assert progress == [(d, len(PROBLEMS)) for d in range(len(PROBLEMS) + 1)]
    seeds = [11, 12, 13, 14, 15]  # seeded sampling: per-program seeds, whichever replica runs them
    assert tokens(problem.run_batch(replicated, PROBLEMS, seeds=seeds)) == \
        tokens(problem.run_batch(one_engine, PROBLEMS, seeds=seeds))


def test_token_streams_come_back_from_the_replicas(replicated, one_engine):
    """on_tokens on a replicated engine: every branch's stream, named by program index and path, grows
    to the tokens one process streams for it; a stream has no state to read (it stays in its replica)."""
    def collect(engine):
        last, seen = {}, []
        def on_tokens(stream):
            key = (stream.program, tuple(stream.path), stream.name)
            assert len(stream.tokens) > len(last.get(key, ()))  # each call brings new tokens
            last[key] = tuple(stream.tokens)
            seen.append(stream)
        results = problem.run_batch(engine, PROBLEMS, seed=3, on_tokens=on_tokens)
        return last, seen, results

    want, _, alone = collect(one_engine)
    got, seen, results = collect(replicated)
    assert got == want and len(got) > len(PROBLEMS)
    assert tokens(results) == tokens(alone)
    stream = seen[-1]
    assert stream.text == one_engine.tokenizer.decode(list(stream.tokens), skip_special_tokens=True)
    with pytest.raises(AttributeError, match="stays in its replica|runs in its replica"):
        stream.state


def test_tg_programs_and_the_command_line(replicated, one_engine, checkpoint, tmp_path, monkeypatch):  # noqa: F811
    from treegen.cli import main
    from treegen.lang.tg import load

    prog = load(str(ROOT / "examples" / "two_level.tg"))
    inputs = [{"n": 2, "max_tokens": 6}, {"n": 3, "max_tokens": 4, "problems": ["Add 2 and 2."]}]

    def texts(result) -> list:
        return [result.text(result.root), result["answers"]]

    assert [texts(r) for r in prog.run_batch(replicated, inputs, seed=1)] == \
        [texts(r) for r in prog.run_batch(one_engine, inputs, seed=1)]
    assert texts(prog.run(replicated, seed=2, **inputs[0])) == texts(prog.run(one_engine, seed=2, **inputs[0]))
    # treegen run --dp 2 from this process: Engine.load(data_parallel=2) (the engine above), JSON Lines streamed
    loads = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **kw: loads.append(kw) or replicated))
    batch = tmp_path / "in.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in inputs))
    out = tmp_path / "out.jsonl"
    argv = ["run", str(ROOT / "examples" / "two_level.tg"), "--model", str(checkpoint), "--batch", str(batch),
            "--json", str(out), "--dp", "2", "--seed", "1", "--no-progress"]
    assert main(argv) == 0
    assert loads[0]["data_parallel"] == 2 and loads[0]["tensor_parallel"] == 1
    lines = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert [line["variables"]["answers"] for line in lines] == \
        [r["answers"] for r in prog.run_batch(one_engine, inputs, seed=1)]


def test_a_failed_program_fails_alone(replicated):
    with pytest.raises(ProgramError, match="program 3 failed: ValueError: program 3 refuses") as caught:
        refuse.run_batch(replicated, [{"k": k} for k in range(6)])
    results = caught.value.results
    assert [r.error is not None for r in results] == [False, False, False, True, False, False]
    assert all(isinstance(r["x"], str) for i, r in enumerate(results) if i != 3)


def test_a_program_that_does_not_pickle_is_refused_before_anything_runs(replicated):
    notebook_style = treegen.program(lambda s, k: None)
    with pytest.raises(TypeError, match="(?s)must pickle, and this one does not.*Define the program in a module"):
        notebook_style.run_batch(replicated, [{"k": 1}, {"k": 2}])
    prefix = "shared"
    with pytest.raises(TypeError, match="must pickle"):
        run_batch(replicated, [lambda s: s.__iadd__(prefix)])  # (a closure)
    with pytest.raises(TypeError, match="(?s)could not rebuild its share.*ImportError: this body cannot be rebuilt"):
        run_batch(replicated, [Unloadable(), Unloadable()])  # (refused by the replicas, before anything ran)
    assert problem.run_batch(replicated, PROBLEMS[:2], seed=3)  # nothing ran; the engine goes on


def test_an_interrupt_keeps_what_finished_and_the_engine_goes_on(replicated, one_engine):
    def interrupt(i, root):
        raise KeyboardInterrupt  # (Ctrl-C while the leader hands over a result)

    with pytest.raises(BatchInterrupted) as caught:
        problem.run_batch(replicated, PROBLEMS, seed=3, on_result=interrupt)
    kept = [r for r in caught.value.results if r is not None]
    assert 1 <= len(kept) <= len(PROBLEMS) and all(r.error is None for r in kept)
    assert tokens(problem.run_batch(replicated, PROBLEMS, seed=3)) == \
        tokens(problem.run_batch(one_engine, PROBLEMS, seed=3))


def test_bad_layouts_are_refused_before_any_process_starts(checkpoint):  # noqa: F811
    before = set(multiprocessing.active_children())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="data_parallel must be an integer >= 1"):
            Engine.load(str(checkpoint), data_parallel=bad)
    if torch.cuda.device_count() < 4:
        with pytest.raises(ValueError, match="only [0-3] GPU|NCCL backend, which this torch build lacks|CUDA is not available"):
            Engine.load(str(checkpoint), data_parallel=2, tensor_parallel=2, device="cuda")
    assert set(multiprocessing.active_children()) == before


def test_a_replica_that_dies_fails_the_call_promptly_and_keeps_what_finished(replicated):
    """(Last of the tests on the shared engine: it leaves the engine failed.)"""
    inputs = [{"k": k, "die": k == 4} for k in range(6)]
    started = time.perf_counter()
    with pytest.raises(WorkerError, match=r"replica \d failed: exited with code -9") as caught:
        die_in_replica.run_batch(replicated, inputs)
    assert time.perf_counter() - started < 40
    kept = [r for r in caught.value.results if r is not None]
    assert kept and all(r.error is None and isinstance(r["y"], str) for r in kept)
    assert caught.value.results[4] is None
    assert not any(p.is_alive() for p in replicated.replicas.processes)
    with pytest.raises(WorkerError, match="exited with code -9"):  # and every later call
        problem.run_batch(replicated, PROBLEMS)


def test_data_times_tensor_parallel_and_a_replica_that_raises(checkpoint, one_engine, monkeypatch):  # noqa: F811
    """dp=2 x tp=2 (each replica process is rank 0 of its own tensor-parallel team: 4 processes) gives
    the tokens of one process; then a replica that raises mid-batch fails the call promptly with its
    error, keeps what finished, and every process ends."""
    monkeypatch.setenv(FAULT_ENV, "1:2:2")  # replica 1 raises as it sends the second program of its second task
    before = set(multiprocessing.active_children())
    engine = Engine.load(str(checkpoint), data_parallel=2, tensor_parallel=2)
    try:
        assert engine.tensor_parallel == 2
        assert tokens(problem.run_batch(engine, PROBLEMS, seed=3)) == \
            tokens(problem.run_batch(one_engine, PROBLEMS, seed=3))
        started = time.perf_counter()
        with pytest.raises(WorkerError, match="(?s)data-parallel replica 1 failed.*injected failure in "
                                              "data-parallel replica 1") as caught:
            problem.run_batch(engine, PROBLEMS + PROBLEMS, seed=3)
        assert time.perf_counter() - started < 40
        assert any(r is not None for r in caught.value.results)  # (replica 1's first program, at least)
        assert not any(p.is_alive() for p in engine.replicas.processes)
        with pytest.raises(WorkerError, match="injected failure"):  # and every later call
            problem.run_batch(engine, PROBLEMS)
    finally:
        engine.close()
    assert set(multiprocessing.active_children()) == before


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@two_gpus
def test_two_gpus_data_parallel_from_a_plain_process(checkpoint, monkeypatch):  # noqa: F811
    """Two replicas on GPUs 0 and 1 (each process sees its own GPU through CUDA_VISIBLE_DEVICES),
    CUDA-graph decode phases: the tokens of one GPU (fp32); then a replica that raises mid-batch ends
    the call with its error within 40 s."""
    one_gpu = Engine.load(str(checkpoint), device="cuda")
    want = workload(one_gpu)
    want_batch = tokens(problem.run_batch(one_gpu, PROBLEMS * 4, seed=3))
    del one_gpu
    torch.cuda.empty_cache()
    monkeypatch.setenv(FAULT_ENV, "1:4:1")  # replica 1's fourth task: the batch after the checks
    engine = Engine.load(str(checkpoint), data_parallel=2, device="cuda")
    try:
        assert workload(engine) == want  # (tasks 1 and 2)
        assert tokens(problem.run_batch(engine, PROBLEMS * 4, seed=3)) == want_batch  # (task 3)
        started = time.perf_counter()
        with pytest.raises(WorkerError, match="(?s)data-parallel replica 1 failed.*injected failure"):
            problem.run_batch(engine, PROBLEMS * 4, seed=3)
        assert time.perf_counter() - started < 40
    finally:
        engine.close()


def test_a_replica_whose_engine_fails_reports_it_and_one_whose_program_fails_does_not(monkeypatch):
    """In a replica process: EngineFailed (a fault of its engine: the programs it cut short never went out)
    leaves ``_replica_batch``, so the replica is marked failed; a ProgramError does not (each failed program
    went out with its error)."""
    from treegen.lang import data_parallel
    from treegen.lang.batch import EngineFailed, ProgramError

    def raising(error):
        def run_batch_here(*args, **kwargs):
            raise error
        return run_batch_here

    args = (None, lambda message: None, [0], [lambda s: None], [0], 0, {}, False)
    monkeypatch.setattr(data_parallel, "run_batch_here", raising(EngineFailed(RuntimeError("device lost"), [])))
    with pytest.raises(EngineFailed, match="device lost"):
        data_parallel._replica_batch(*args)
    root = type("Root", (), {"program": 0, "error": ValueError("bad input")})()
    monkeypatch.setattr(data_parallel, "run_batch_here", raising(ProgramError({0: root.error}, [root])))
    assert data_parallel._replica_batch(*args) == "ok"
