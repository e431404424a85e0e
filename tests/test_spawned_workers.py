"""Tensor parallel from a plain process (this pytest process is rank 0 and starts rank 1 itself, gloo on
the CPU): the tokens of one process; a worker that raises or is killed makes the user's call fail
promptly with its error, and no process is left behind."""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from distributed_programs import workload
from test_distributed import checkpoint, one_process  # noqa: F401 - the shared fixtures
from treegen.lang.batch import EngineFailed
from treegen.runtime.engine import Engine
from treegen.runtime.workers import FAULT_ENV, WorkerError


def test_a_plain_process_drives_two_ranks_to_the_tokens_of_one(checkpoint, one_process):  # noqa: F811
    engine = Engine.load(str(checkpoint), tensor_parallel=2)
    try:
        assert engine.parallel.tensor.shard.size == 2 and engine.workers is not None
        assert workload(engine) == one_process
        assert workload(engine) == one_process  # runs after runs: the mirrors stay in step
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.workers.processes)
    assert not torch.distributed.is_initialized()


def test_a_static_execute_through_the_workers_gives_the_tokens_of_one_process(checkpoint):  # noqa: F811
    """``TreeRun.execute`` (the static path: everything submitted, then advanced to the end) mirrors its
    submissions and steps one by one, so it runs through spawned workers too."""
    from treegen.runtime.engine import GenRequest
    from treegen.runtime.sampler import SamplingParams

    def static(engine):
        run = engine.start()
        root = run.tree.add_node(None, engine.tokenizer.encode("The capital of France is"))
        leaves = [run.tree.add_node(root) for _ in range(3)]
        gens = [GenRequest(leaf, SamplingParams(max_tokens=6, temperature=0.9 if i else 0.0, ignore_eos=True), key=i)
                for i, leaf in enumerate(leaves)]
        return [r.tokens for r in run.execute(gens, [])[0]]

    want = static(Engine.load(str(checkpoint)))
    engine = Engine.load(str(checkpoint), tensor_parallel=2)
    try:
        assert static(engine) == want
        assert static(engine) == want  # and again: the mirrors stay in step
    finally:
        engine.close()


def test_a_worker_that_raises_fails_the_users_call_promptly(checkpoint, monkeypatch):  # noqa: F811
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 raises at its third call
    engine = Engine.load(str(checkpoint), tensor_parallel=2)
    try:
        started = time.perf_counter()
        # (its third call is in the batch: EngineFailed, with what finished, and the worker's error as its cause)
        with pytest.raises(EngineFailed, match="(?s)worker rank 1 failed.*injected failure on rank 1") as e:
            workload(engine)
        assert isinstance(e.value.__cause__, WorkerError) and len(e.value.results) == len(e.value.errors)
        assert time.perf_counter() - started < 30
        assert not any(p.is_alive() for p in engine.workers.processes)
        with pytest.raises(WorkerError, match="injected failure on rank 1"):  # and every later call
            workload(engine)
    finally:
        engine.close()


def test_a_worker_that_dies_while_starting_fails_the_load_promptly(checkpoint, monkeypatch):  # noqa: F811
    """Before the group exists: rank 0 stops waiting for the rendezvous as soon as the worker is gone
    (it used to wait for the whole join timeout, 300 s)."""
    monkeypatch.setenv(FAULT_ENV, "1:0")  # rank 1 raises before it joins the group
    started = time.perf_counter()
    with pytest.raises(WorkerError, match="(?s)worker rank 1 failed.*injected failure on rank 1 while starting"):
        Engine.load(str(checkpoint), tensor_parallel=2)
    assert time.perf_counter() - started < 90


def test_a_killed_worker_fails_the_next_call_with_its_exit(checkpoint):  # noqa: F811
    engine = Engine.load(str(checkpoint), tensor_parallel=2)
    try:
        worker = engine.workers.processes[0]
        worker.kill()
        worker.join(10)
        started = time.perf_counter()
        with pytest.raises(WorkerError, match="rank 1 failed: exited with code -9"):
            workload(engine)
        assert time.perf_counter() - started < 30
    finally:
        engine.close()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@two_gpus
def test_two_gpus_from_a_plain_process(checkpoint, monkeypatch):  # noqa: F811
    """NCCL, cuda:0 and cuda:1, CUDA-graph decode phases, all-reduces over peer memory: the tokens of
    one GPU (fp32); then (a second engine: NCCL all-reduces) a worker that raises mid-run ends the call
    with its error (the NCCL groups aborted) within 30 s."""
    one_gpu = workload(Engine.load(str(checkpoint), device="cuda"))
    engine = Engine.load(str(checkpoint), tensor_parallel=2, device="cuda")
    try:
        assert workload(engine) == one_gpu
        assert engine.parallel.tensor.peer is not None, engine.parallel  # the all-reduce over peer memory
    finally:
        engine.close()
    monkeypatch.setenv(FAULT_ENV, "1:2")  # (a decode phase is one call: fewer calls than on the CPU)
    engine = Engine.load(str(checkpoint), tensor_parallel=2, device="cuda")
    try:
        started = time.perf_counter()
        # (its third call is in the batch: EngineFailed, with what finished, and the worker's error as its cause)
        with pytest.raises(EngineFailed, match="(?s)worker rank 1 failed.*injected failure on rank 1") as e:
            workload(engine)
        assert isinstance(e.value.__cause__, WorkerError) and len(e.value.results) == len(e.value.errors)
        assert time.perf_counter() - started < 30
        # This process mapped peer memory for the first engine; a second rendezvous with new workers
        # would hang (pytorch#196082), so the second engine's all-reduces went through NCCL.
        assert engine.parallel.tensor.peer is None and "earlier group" in repr(engine.parallel)
    finally:
        engine.close()


def test_a_drop_between_a_callbacks_messages_is_carried_out_and_the_callback_still_read():
    """Rank 0 sends ``drop`` when the collector takes one of its runs — at any moment, also while a worker
    waits for another run's callback message: the worker frees the dropped run's KV and reads on (seen as a
    flaky 'out of step with rank 0 ... rank 0 sent (drop, 0)' in a data-parallel x tensor-parallel test)."""
    import pickle
    import queue
    import types

    from treegen.runtime.workers import _receive

    inbox = queue.Queue()
    for message in (("drop", 0), ("drop", 7), ("callback", "done", 0, 123)):
        inbox.put(pickle.dumps(message))
    freed = []
    kv = types.SimpleNamespace(segments={3: None, 5: None}, free=freed.append)
    empty = types.SimpleNamespace(run=types.SimpleNamespace(kv=types.SimpleNamespace(segments={}, free=freed.append)))
    mirrors = {0: types.SimpleNamespace(run=types.SimpleNamespace(kv=kv)), 1: empty}
    assert _receive(inbox, mirrors) == ("callback", "done", 0, 123)
    assert sorted(freed) == [3, 5] and list(mirrors) == [1]  # (7: not a run this worker has: nothing to do)
    inbox.put(pickle.dumps(("drop", 1)))
    inbox.put(pickle.dumps(("call", 1)))
    assert _receive(inbox, mirrors) == ("call", 1) and mirrors == {}  # (a run with no KV: just forgotten)


def test_inputs_arriving_under_tensor_parallel_split_kv_alike_on_every_rank(checkpoint, monkeypatch):  # noqa: F811
    """run_batch over an iterator on two ranks driven from this process: a later program's prompt is attached
    below the first one's prefix, whose node (with KV) is split — an operation the worker mirrors — and every
    program samples the tokens of one process."""
    import threading

    from distributed_programs import PROBLEMS, problem
    from treegen.runtime.kv_store import KVStore

    def run(engine, splits):
        first = threading.Event()

        def arriving():
            yield PROBLEMS[0]
            assert first.wait(60)
            yield from PROBLEMS[1:]

        def on_tokens(stream):
            if not first.is_set():
                first.set()
                time.sleep(0.5)  # (the input thread hands the next input over before the next step)

        split = KVStore.split

        def spy(kv, node, head, length):
            splits.append(kv.computed(node) >= length)
            split(kv, node, head, length)

        with monkeypatch.context() as m:
            m.setattr(KVStore, "split", spy)
            roots = problem.run_batch(engine, arriving(), seed=3, on_tokens=on_tokens, min_shared_saving=None)
        return [{"x": r["x"], "greedy": r["greedy"]} for r in roots]

    alone: list = []
    want = run(Engine.load(str(checkpoint)), alone)
    engine = Engine.load(str(checkpoint), tensor_parallel=2)
    try:
        splits: list = []
        assert run(engine, splits) == want
        assert splits and splits[0], splits  # the first program's prefix node held KV when it was split
    finally:
        engine.close()
