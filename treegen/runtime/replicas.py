"""Data parallel from a plain Python process or a notebook: model replicas in worker processes, driven by this one.

``Engine.load(model, data_parallel=N, tensor_parallel=T)`` outside ``torchrun`` returns a
:class:`ReplicatedEngine`. This process loads only the tokenizer and starts ``N`` replica processes
(``torch.multiprocessing``, spawn). Replica ``d`` loads the whole engine on GPUs ``d*T .. d*T+T-1`` of
this process's visible GPUs (its own ``CUDA_VISIBLE_DEVICES``), or on the CPU; with ``T > 1`` it is
itself a tensor-parallel engine started the plain-process way (:mod:`treegen.runtime.workers`: the
replica process is rank 0 of its own team, on its own port and process group). Replicas share no
process group: they never talk to each other, only to this process, through queues.

Work is a **task**: a picklable function and, per replica, its arguments. :meth:`Replicas.run`
pickles each replica's share here (so what cannot travel is named before anything runs), sends it,
waits until every replica has unpickled its share (a share that does not unpickle there is refused
by name, nothing runs, the engine stays usable), then lets them all go. A replica runs
``fn(engine, emit, *args)`` in its main thread; each ``emit(bytes)`` reaches ``on_event(d, bytes)``
in the caller's thread as soon as it arrives (the language layer sends one finished program per
event: :mod:`treegen.lang.data_parallel`).

Faults (bounded, never a hang):

* a replica whose task raises, or whose process dies (killed, out of memory), fails the call with
  :class:`~treegen.runtime.workers.WorkerError` naming the replica and its error (traceback or exit
  code): the others are told to stop at once (events they send meanwhile still reach ``on_event``:
  finished work is kept), and whatever has not stopped within ``STOP_S`` is killed. The engine then
  refuses further work (load it again), as a tensor-parallel engine does after a worker failed;
* Ctrl-C (``KeyboardInterrupt`` in the caller) stops every replica the same way and is raised again
  once they have stopped; ``on_event`` raising stops them and raises its error. The engine stays
  usable after both (a tensor-parallel replica's team does not survive an interrupt: see
  :mod:`treegen.runtime.mirror`; its next call fails then);
* a replica whose leader process is gone exits on its own; :meth:`Replicas.close`
  (``engine.close()``, garbage collection, interpreter exit) ends every replica (and their
  tensor-parallel workers), killing what does not exit within ``workers.JOIN_S``.

How a replica stops: it ignores SIGINT (a terminal's Ctrl-C reaches every process of the group; the
leader decides), and a thread reading its queue turns a ``stop`` message into a ``KeyboardInterrupt``
in its main thread, which ends its batch as Ctrl-C ends a batch in one process.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import types

import torch

from treegen.runtime.workers import WorkerError, join_or_kill, next_message

POLL_S = 0.1  # how often the leader looks at its replicas while waiting for a message
REPORT_S = 2.0  # how long the leader waits for a dead replica's report before naming its exit code
STOP_S = 30.0  # how long stopped replicas may take to finish their current step and say so
FAULT_ENV = "TREEGEN_REPLICA_FAULT"  # "D:T:K": replica D raises at the K-th emit of its T-th task (fault tests)


class NotShippable(TypeError):
    """A task's function or arguments cannot travel to (or be rebuilt in) a replica process."""


# shipping ------------------------------------------------------------------------------------------
def main_is_importable() -> bool:
    """Whether a spawned process can import what ``__main__`` defines: a script's file can be run
    again there (``__mp_main__``); a notebook or an interactive session's ``__main__`` cannot."""
    return bool(getattr(sys.modules.get("__main__"), "__file__", None))


class _Shipper(pickle.Pickler):
    """A pickler that refuses, by name, functions and classes of an interactive ``__main__`` (they
    pickle here by reference and fail only in the other process)."""

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__" \
                and not main_is_importable():
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in this notebook or interactive session "
                                       f"(__main__), which another process cannot import")
        return NotImplemented


def ship(obj) -> bytes:
    """``obj`` pickled for a replica process; :class:`NotShippable` names why it cannot be."""
    buffer = io.BytesIO()
    try:
        _Shipper(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise NotShippable(f"{type(e).__name__}: {e}") from e
    return buffer.getvalue()


# the leader's side ---------------------------------------------------------------------------------
class Replicas:
    """This process's handle on its replica processes: their queues, the first failure, closing."""

    def __init__(self, processes, inboxes, outbox, tensor_parallel: int) -> None:
        self.processes, self.inboxes, self.outbox = processes, inboxes, outbox
        self.tensor_parallel = tensor_parallel
        self.failure: str | None = None
        self.closed = False
        self.descriptions: list[str] = [""] * len(processes)
        self._tasks = 0  # tasks sent so far: replies name theirs, so a late one of a cancelled task is ignored
        atexit.register(self.close)

    @property
    def count(self) -> int:
        return len(self.processes)

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerError(self.failure)
        if self.closed:
            raise WorkerError("this engine's data-parallel replicas were closed (engine.close())")

    def _send(self, d: int, message) -> None:
        try:
            self.inboxes[d].put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - a replica that is gone is noticed by _next
            pass

    def _next(self, dead_since: dict[int, float]):
        """The next message of any replica; a replica that died without reporting becomes a
        ``("failed", d, ...)`` message after ``REPORT_S`` (its report may still be in the queue)."""
        while True:
            try:
                return self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                pass
            now = time.monotonic()
            for d, p in enumerate(self.processes):
                if not p.is_alive():
                    since = dead_since.setdefault(d, now)
                    if now - since > REPORT_S and since != float("inf"):
                        dead_since[d] = float("inf")  # reported once
                        return ("failed", d, f"exited with code {p.exitcode} without reporting an error (killed?)")

    def wait_ready(self) -> None:
        """Wait until every replica has loaded its engine; a replica that fails meanwhile ends them all."""
        waiting, dead = set(range(self.count)), {}
        while waiting:
            message = self._next(dead)
            if message[0] == "ready":
                waiting.discard(message[1])
                self.descriptions[message[1]] = message[2]
            elif message[0] == "failed":
                self._fail(f"data-parallel replica {message[1]} failed while loading the model: {message[2]}")
                raise WorkerError(self.failure)

    def run(self, fn, shares: list[tuple], on_event) -> list:
        """Run ``fn(engine, emit, *shares[d])`` on every replica ``d`` at once; returns what each
        returned, in replica order. ``on_event(d, payload)`` is called here for each ``emit`` (see the
        module doc for faults; a refused share raises :class:`NotShippable`)."""
        self.check()
        if len(shares) != self.count:
            raise ValueError(f"{len(shares)} shares for {self.count} replicas")
        blobs = [ship((fn, share)) for share in shares]  # raises before anything is sent
        self._tasks += 1
        task = self._tasks
        for d, blob in enumerate(blobs):
            self._send(d, ("task", task, blob))
        dead: dict[int, float] = {}
        waiting, refused = set(range(self.count)), {}
        try:
            while waiting:
                message = self._next(dead)
                kind, d = message[0], message[1]
                if kind in ("accepted", "refused") and message[2] == task:
                    waiting.discard(d)
                    if kind == "refused":
                        refused[d] = message[3]
                elif kind == "failed":
                    self._fail(f"data-parallel replica {d} failed: {message[2]}")
                    raise WorkerError(self.failure)
        except KeyboardInterrupt:
            for d in range(self.count):
                self._send(d, ("cancel",))
            raise
        if refused:
            for d in range(self.count):
                self._send(d, ("cancel",))
            d = min(refused)
            raise NotShippable(f"replica {d} could not rebuild its share of the work: {refused[d]}")
        for d in range(self.count):
            self._send(d, ("go",))
        return self._collect(on_event, dead)

    def _collect(self, on_event, dead: dict[int, float]) -> list:
        results: list = [None] * self.count
        running = set(range(self.count))
        failure: str | None = None
        raised: BaseException | None = None  # the caller's on_event error, or KeyboardInterrupt
        deadline: float | None = None  # set once the replicas were told to stop

        def stop() -> None:
            nonlocal deadline
            if deadline is None:
                deadline = time.monotonic() + STOP_S
                for d in running:
                    self._send(d, ("stop",))

        while running:
            try:
                if deadline is not None and time.monotonic() > deadline:
                    late = sorted(running)
                    failure = failure or f"data-parallel replicas {late} did not stop within {STOP_S:.0f} s"
                    break
                message = self._next(dead)
            except KeyboardInterrupt as e:
                raised = raised or e
                stop()
                continue
            kind, d = message[0], message[1]
            if kind == "event":
                if raised is None or isinstance(raised, KeyboardInterrupt):
                    try:
                        on_event(d, message[2])
                    except Exception as e:  # noqa: BLE001 - the caller's code: stop the replicas, raise it
                        raised = e
                        stop()
                    except KeyboardInterrupt as e:
                        raised = raised or e
                        stop()
            elif kind == "done":
                running.discard(d)
                results[d] = pickle.loads(message[2])
            elif kind == "failed":
                running.discard(d)
                failure = failure or f"data-parallel replica {d} failed: {message[2]}"
                stop()
            elif kind in ("accepted", "refused"):
                pass  # (a late reply to a task cancelled by an interrupt)
            else:
                failure = failure or f"data-parallel replica {d} sent {kind!r} while running (a bug)"
                stop()
        if failure is not None:
            self._fail(failure)
            raise WorkerError(self.failure) from raised
        if raised is not None:
            raise raised
        return results

    def _fail(self, failure: str) -> None:
        if self.failure is None:
            self.failure = f"{failure}; the replicas were stopped, load the engine again"
        self._stop()

    def _stop(self) -> None:
        for d in range(self.count):
            self._send(d, ("exit",))
        join_or_kill(self.processes)

    def close(self) -> None:
        """Tell the replicas to exit (each closes its engine and its tensor-parallel workers), join
        them, killing any that do not exit within ``workers.JOIN_S``."""
        if self.closed:
            return
        self.closed = True
        self._stop()
        atexit.unregister(self.close)


def visible_gpus() -> list[str]:
    """This process's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (their indices when unset)."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is not None:
        return [n.strip() for n in names.split(",") if n.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def start_replicas(engine_class, model, *, dtype, device: torch.device, implementation: str, tensor_parallel: int,
                   data_parallel: int, options: dict) -> Replicas:
    """Start ``data_parallel`` replica processes of ``tensor_parallel`` ranks each and wait until all
    have loaded the model (``engine_class.load``: the class is passed, not imported here)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(data_parallel)]
    threads = max(1, (os.cpu_count() or 1) // (data_parallel * tensor_parallel))
    gpus = visible_gpus() if device.type == "cuda" else []
    processes = []
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # (inherited by the replicas and their workers)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for d in range(data_parallel):
            if device.type == "cuda":  # the replica's GPUs, set before it starts (read when it first uses CUDA)
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[d * tensor_parallel:(d + 1) * tensor_parallel])
            # not daemonic: a tensor-parallel replica starts worker processes of its own
            p = ctx.Process(target=_replica_main, name=f"treegen-dp-replica{d}", daemon=False,
                            args=(engine_class, d, model, dtype, device.type, implementation, tensor_parallel, options,
                                  threads, inboxes[d], outbox))
            p.start()
            processes.append(p)
    finally:
        if device.type == "cuda":
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    replicas = Replicas(processes, inboxes, outbox, tensor_parallel)
    try:
        replicas.wait_ready()
    except BaseException:
        replicas.close()
        raise
    return replicas


class ReplicatedEngine:
    """What :meth:`Engine.load <treegen.runtime.engine.Engine.load>` returns for ``data_parallel > 1``
    from a plain process: the tokenizer here, the models in :class:`Replicas` (see the module doc).

    It runs programs, not tree runs: ``run_batch`` splits its inputs across the replicas
    (:func:`treegen.lang.data_parallel.run_batch_replicas`), ``program.run`` runs on one replica.
    :meth:`close` (or dropping the engine, or exit) ends the replica processes."""

    def __init__(self, tokenizer, replicas: Replicas, *, model_name: str, kv_shape, attention: str,
                 device: torch.device) -> None:
        import weakref

        self.tokenizer, self.replicas = tokenizer, replicas
        self.model_name, self.kv_shape, self.attention, self.device = model_name, kv_shape, attention, device
        self.parallel = None  # this process is no rank: the replicas are
        self.on_step = None  # (progress hooks are per process: the replicas' are not seen here)
        weakref.finalize(self, replicas.close)

    @property
    def data_parallel(self) -> int:
        return self.replicas.count

    @property
    def tensor_parallel(self) -> int:
        return self.replicas.tensor_parallel

    def start(self):
        raise RuntimeError("this engine's models live in its data-parallel replica processes: run programs on it "
                           "(program.run, program.run_batch, treegen.run_batch), not tree runs (engine.start); "
                           "load with data_parallel=1 for a TreeRun in this process")

    def close(self) -> None:
        """End the replica processes; the engine cannot run afterwards."""
        self.replicas.close()

    def __repr__(self) -> str:
        state = "failed" if self.replicas.failure else "closed" if self.replicas.closed else "running"
        first = self.replicas.descriptions[0] if self.replicas.descriptions else ""
        return (f"ReplicatedEngine({self.model_name}, data_parallel={self.data_parallel}, "
                f"tensor_parallel={self.tensor_parallel}, device={self.device.type}, {state}; replica 0: {first})")


# the replica's side --------------------------------------------------------------------------------
def _replica_main(engine_class, d, model, dtype, device, implementation, tensor_parallel, options, threads, inbox,
                  outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (before its workers start: they inherit "ignored")
    try:
        torch.set_num_threads(threads)
        engine = engine_class.load(model, dtype=dtype, device=device, implementation=implementation,
                                   tensor_parallel=tensor_parallel, **options)
    except BaseException:  # noqa: BLE001 - reported to the leader, then this process ends
        _report_and_exit(outbox, ("failed", d, traceback.format_exc()), 1)
    local: queue.Queue = queue.Queue()
    stopping, running = threading.Event(), threading.Event()

    def on_sigint(signum, frame) -> None:  # only the reader thread's stop makes it an interrupt
        if stopping.is_set() and running.is_set():
            raise KeyboardInterrupt("stopped by the leader")

    signal.signal(signal.SIGINT, on_sigint)
    threading.Thread(target=_read, args=(inbox, local, stopping, running), name="treegen-dp-reader",
                     daemon=True).start()
    outbox.put(("ready", d, repr(engine)))
    fault = os.environ.get(FAULT_ENV, "").split(":")
    fail_at = (int(fault[1]), int(fault[2])) if fault[0] == str(d) else None
    tasks = emitted = 0

    def emit(payload: bytes) -> None:
        nonlocal emitted
        emitted += 1
        if (tasks, emitted) == fail_at:
            raise RuntimeError(f"injected failure in data-parallel replica {d} ({FAULT_ENV})")
        outbox.put(("event", d, payload))

    requeued = None  # a task that came while this replica waited for the go of a cancelled one
    try:
        while True:
            message, requeued = requeued or local.get(), None
            if message[0] == "exit":
                break
            if message[0] != "task":
                continue  # (a stop or cancel that came after its task ended)
            try:
                fn, share = pickle.loads(message[2])
            except BaseException as e:  # noqa: BLE001 - the share cannot be rebuilt here: refused, nothing ran
                outbox.put(("refused", d, message[1], f"{type(e).__name__}: {e}"))
                continue
            outbox.put(("accepted", d, message[1]))
            go = local.get()
            while go[0] == "stop":
                go = local.get()
            if go[0] == "exit":
                break
            if go[0] == "task":
                requeued = go
            if go[0] != "go":
                continue
            stopping.clear()
            running.set()
            tasks, emitted = tasks + 1, 0
            try:
                result = fn(engine, emit, *share)
                running.clear()
            except KeyboardInterrupt:  # a stop that came as the task ended: it stopped all the same
                running.clear()
                if not stopping.is_set():
                    outbox.put(("failed", d, traceback.format_exc()))
                    break
                result = "interrupted"
            except BaseException:  # noqa: BLE001 - the leader stops the others and fails the call
                running.clear()
                outbox.put(("failed", d, traceback.format_exc()))
                break
            outbox.put(("done", d, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)))
    finally:
        try:
            engine.close()
            del engine  # (its tensor-parallel team's queues are released before the process ends)
            import gc

            gc.collect()
        finally:
            outbox.close()
            outbox.join_thread()


def _read(inbox, local: queue.Queue, stopping: threading.Event, running: threading.Event) -> None:
    """The replica's queue reader: a ``stop`` interrupts the running task at once; exits the process
    when the leader is gone."""
    while True:
        message = next_message(inbox)
        if message[0] in ("stop", "exit"):
            stopping.set()
            if running.is_set():  # a real signal: it also wakes a main thread blocked in a wait
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        local.put(message)


def _report_and_exit(outbox, message, code: int) -> None:
    try:
        outbox.put(message)
        outbox.close()
        outbox.join_thread()
    finally:
        os._exit(code)


__all__ = ["FAULT_ENV", "NotShippable", "ReplicatedEngine", "Replicas", "main_is_importable", "ship",
           "start_replicas"]
